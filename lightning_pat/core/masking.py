"""Zero or scale units of one member on a (local) tensor, in place; literal-zero counts (pure torch).

A tensor here holds channels ``[offset, offset + length)`` of the member's channel axis: the whole axis for a
plain tensor, one shard's block for a DTensor's local tensor. Channels outside the member's slice are untouched.

Legend: ``C`` units, ``L`` local channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_pat.core.spec import Member
from lightning_pat.core.units import local_units, unit_channels


def zero_units_(
    tensor: Tensor, member: Member, units: Tensor, *, num_units: int, offset: int = 0, length: int | None = None
) -> None:
    """Set every local channel of ``member`` belonging to one of ``units`` to exactly zero.

    Args:
        tensor: The (local) tensor; mutated in place.
        member: The cluster member it holds.
        units: Unit indices to zero (global, ``[0, num_units)``).
        num_units: ``C`` of the cluster.
        offset: Global channel index of the first channel held locally.
        length: Number of channels held locally (defaults to ``tensor.shape[member.dim]``).
    """
    length = tensor.shape[member.dim] if length is None else length
    zero_channels_(
        tensor,
        member,
        unit_channels(member, units, num_units=num_units, offset=offset, length=length, device=tensor.device),
    )


#: Integer dtype of each floating element size: a float's bits, for the bitwise zeroing below.
_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``index_fill_`` along an axis that is not the outermost in memory (columns) costs about 30x a bitwise pass over
#: the tensor per element it writes (a strided scatter; measured on CPU, float32): from this fraction of the
#: channels on, one pass over every element is cheaper. Rows (outermost) are contiguous: filled by index.
_BITWISE_MIN_FRACTION = 1 / 32


def zero_channels_(tensor: Tensor, member: Member, channels: Tensor) -> None:
    """Zero the given local channels (indices along ``member.dim``) of ``tensor`` in place.

    Rows (the channel axis outermost in memory) are filled by index. Columns of a floating tensor, from
    ``_BITWISE_MIN_FRACTION`` of them on, are zeroed in one pass by a bitwise AND of the elements' bits with an
    all-ones / all-zeros word per channel: the same bits as ``index_fill_(dim, channels, 0.0)`` (``+0.0`` in the
    dropped channels whatever they held, NaN included; the others untouched, ``-0.0`` included), several times faster.
    """
    if not channels.numel():
        return
    dim = member.dim
    length = tensor.shape[dim]
    bits = _BITS_DTYPES.get(tensor.element_size()) if tensor.is_floating_point() else None
    outermost = tensor.stride(dim) >= max(tensor.stride())
    if bits is None or outermost or channels.numel() < _BITWISE_MIN_FRACTION * length:
        tensor.index_fill_(dim, channels, 0.0)
        return
    keep = torch.full((length,), -1, dtype=bits, device=tensor.device).index_fill_(0, channels, 0)
    shape = [1] * tensor.dim()
    shape[dim] = length
    tensor.view(bits).bitwise_and_(keep.view(shape))


def scale_units_(
    tensor: Tensor, member: Member, factors_C: Tensor, *, offset: int = 0, length: int | None = None
) -> None:
    """Multiply every local channel of ``member`` by its unit's factor (group-lasso shrinkage), in place."""
    length = tensor.shape[member.dim] if length is None else length
    if length == 0:
        return
    num_units = factors_C.numel()
    units_L = local_units(member, num_units=num_units, offset=offset, length=length, device=tensor.device)
    inside = units_L >= 0
    scale_L = torch.ones(length, dtype=factors_C.dtype, device=tensor.device)
    scale_L[inside] = factors_C.to(tensor.device)[units_L[inside]]
    shape = [1] * tensor.dim()
    shape[member.dim] = length
    tensor.copy_((tensor.to(scale_L.dtype) * scale_L.view(shape)).to(tensor.dtype))
    zero_units_(
        tensor, member, torch.nonzero(factors_C == 0).flatten(), num_units=num_units, offset=offset, length=length
    )


def count_zeros(tensor: Tensor) -> Tensor:
    """Literal zeros (entries exactly equal to 0.0) in ``tensor``, as a 0-d int64 tensor (no host sync)."""
    return (tensor == 0).sum()
