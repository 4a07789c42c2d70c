"""Unit <-> channel arithmetic of one member, shared by scoring and masking (pure torch).

A member's channel axis holds ``C`` units of ``block`` consecutive channels each, starting at ``member.start``. A
(local) tensor holds channels ``[offset, offset + length)`` of that axis: the whole axis for a plain tensor, one
shard's block for a DTensor's local tensor. Channels outside the member's slice belong to no unit (-1).

Legend: ``C`` units, ``L`` local channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_pat.core.spec import Member


def unit_of_channels(*, start: int, block: int, offset: int, length: int, device: torch.device) -> Tensor:
    """Unit index of each of ``length`` channels beginning at global channel ``offset`` (-1 if outside the slice).

    Args:
        start: First channel of the member's slice.
        block: Channels per unit.
        offset: Global index of the first channel held.
        length: Number of channels held.
        device: Device of the result.

    Returns:
        A ``[length]`` int64 tensor.
    """
    idx = torch.arange(offset, offset + length, device=device) - start
    units = torch.div(idx, block, rounding_mode="floor")
    return torch.where(idx >= 0, units, torch.full_like(units, -1))


def fold_to_units(sums_L: Tensor, units_L: Tensor, *, num_units: int) -> Tensor:
    """Add channel sums into their units; channels with unit -1 or >= ``num_units`` are outside and ignored."""
    out_C = torch.zeros(num_units, dtype=sums_L.dtype, device=sums_L.device)
    keep = (units_L >= 0) & (units_L < num_units)
    return out_C.index_add_(0, units_L[keep], sums_L[keep])


def local_units(member: Member, *, num_units: int, offset: int, length: int, device: torch.device) -> Tensor:
    """Unit index of each local channel, or -1 for channels outside the member's slice."""
    units_L = unit_of_channels(start=member.start, block=member.block, offset=offset, length=length, device=device)
    return torch.where(units_L < num_units, units_L, torch.full_like(units_L, -1))


def unit_channels(
    member: Member, units: Tensor, *, num_units: int, offset: int, length: int, device: torch.device
) -> Tensor:
    """Local indices (along ``member.dim``) of the channels of ``units`` held in ``[offset, offset + length)``.

    ``units`` are sorted unit indices; the result is sorted too. Where the held part of the member's slice is whole
    units (always for a full tensor), the channels are computed arithmetically from ``units``; otherwise by lookup.
    """
    if units.numel() == 0 or length == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    units = units.to(device)
    lo, hi = max(member.start, offset), min(member.stop, offset + length)
    first, last = lo - member.start, hi - member.start
    block = member.block
    if hi > lo and first % block == 0 and last % block == 0 and last // block <= num_units:
        u0, u1 = first // block, last // block
        held = units if u0 == 0 and u1 == num_units else units[(units >= u0) & (units < u1)]
        base = held * block + (member.start - offset)
        if block == 1:
            return base
        return (base[:, None] + torch.arange(block, device=device)).flatten()
    units_L = local_units(member, num_units=num_units, offset=offset, length=length, device=device)
    return torch.nonzero(torch.isin(units_L, units)).flatten()
