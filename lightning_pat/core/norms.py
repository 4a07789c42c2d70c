"""Per-unit squared norms and scores (pure torch, no communication).

The canonical partial is the sum of squares per channel of a (local) tensor along the member's channel axis,
accumulated in float64 on every path and for every parameter dtype: a square of a float32 (or bf16/fp16) value is
exact in float64 and sums of them keep about 16 digits, so pieces added in another order (another world size,
another layout, the materializing path) give the same selection except at exact or sub-1e-15 ties.
Channel sums fold into unit sums by index; a rank that holds a
piece of a tensor produces partial unit sums that add up, over pieces, to the full ones.

Legend for shape suffixes: ``C`` units in a cluster, ``L`` channels held locally.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lightning_pat.core.spec import Member
from lightning_pat.core.units import fold_to_units, unit_of_channels

ScoreType = Literal["rms", "l2", "param_cost", "activation", "taylor"]
#: Scores computed from the weights alone (every executor, every layout).
WEIGHT_SCORES: tuple[str, ...] = ("rms", "l2", "param_cost")
#: Scores that need data: ``"activation"`` (the readers' input statistics, ``lightning_pat.scoring.activation``) and
#: ``"taylor"`` (``|w * g|`` summed over training steps, ``lightning_pat.scoring.taylor``).
DATA_SCORES: tuple[str, ...] = ("activation", "taylor")
#: Every score type.
SCORE_TYPES: tuple[str, ...] = (*WEIGHT_SCORES, *DATA_SCORES)


#: The dtype scores accumulate in, for every parameter dtype: selections do not depend on the layout.
ACCUMULATION_DTYPE = torch.float64


_CHUNK_ELEMS = 1 << 18  # float64 temporaries of at most 2 MiB (cache-sized: faster than larger chunks)


def _channel_sums(tensor: Tensor, other_tensor: Tensor | None, *, dim: int, acc_dtype: torch.dtype) -> Tensor:
    """Per channel, the sum of ``x^2`` (``other_tensor`` None) or of ``|x * y|``, converted first, in chunks."""
    if tensor.dim() == 1:
        x = tensor.to(acc_dtype)
        return x.square() if other_tensor is None else (x * other_tensor.to(acc_dtype)).abs_()
    if tensor.dim() > 2:  # a convolution's weight: every dim but the channel axis is one flattened "other" axis
        if other_tensor is not None:
            other_tensor = other_tensor.movedim(dim, 0).reshape(other_tensor.shape[dim], -1)
        tensor, dim = tensor.movedim(dim, 0).reshape(tensor.shape[dim], -1), 0
    other = 1 - dim
    num, width = tensor.shape[dim], tensor.shape[other]
    if width == 0 or num == 0:
        return torch.zeros(num, dtype=acc_dtype, device=tensor.device)
    step = max(1, _CHUNK_ELEMS // width)
    out = torch.empty(num, dtype=acc_dtype, device=tensor.device)
    for i in range(0, num, step):
        n = min(step, num - i)
        chunk = tensor.narrow(dim, i, n).to(acc_dtype, copy=True)  # a copy: changed in place below
        if other_tensor is None:
            chunk.square_()
        else:
            chunk.mul_(other_tensor.narrow(dim, i, n).to(acc_dtype)).abs_()
        torch.sum(chunk, dim=other, out=out[i : i + n])
    return out


def channel_sq_sums(tensor: Tensor, *, dim: int, acc_dtype: torch.dtype) -> Tensor:
    """Sum of squares of every channel (index along ``dim``) of ``tensor``, in ``acc_dtype``.

    Each element is converted to ``acc_dtype`` before it is squared (a float32 square is exact in float64), in
    chunks of channels so that the temporary stays small.

    Args:
        tensor: A (local) tensor of any rank >= 1.
        dim: The channel axis.
        acc_dtype: The accumulation dtype.

    Returns:
        A ``[tensor.shape[dim]]`` tensor.
    """
    return _channel_sums(tensor, None, dim=dim, acc_dtype=acc_dtype)


def channel_abs_prod_sums(weight: Tensor, grad: Tensor, *, dim: int, acc_dtype: torch.dtype) -> Tensor:
    """Sum over every channel (index along ``dim``) of ``|weight * grad|``, in ``acc_dtype``.

    Chunked like :func:`channel_sq_sums`; both operands are converted before the product, so a float32 product is
    exact.

    Args:
        weight: A (local) tensor of any rank >= 1.
        grad: Its gradient (same shape).
        dim: The channel axis.
        acc_dtype: The accumulation dtype.

    Returns:
        A ``[weight.shape[dim]]`` tensor.
    """
    return _channel_sums(weight, grad, dim=dim, acc_dtype=acc_dtype)


def member_unit_abs_prod_sums(
    weight: Tensor, grad: Tensor, member: Member, *, num_units: int, acc_dtype: torch.dtype, offset: int = 0
) -> Tensor:
    """Partial ``[C]`` sums of ``|weight * grad|`` of one member's units (as :func:`member_unit_sq_sums`)."""
    lo = max(member.start, offset)
    hi = min(member.stop, offset + weight.shape[member.dim])
    if hi <= lo:
        return torch.zeros(num_units, dtype=acc_dtype, device=weight.device)
    sums_L = channel_abs_prod_sums(
        weight.narrow(member.dim, lo - offset, hi - lo), grad.narrow(member.dim, lo - offset, hi - lo),
        dim=member.dim, acc_dtype=acc_dtype,
    )  # fmt: skip
    return _fold(sums_L, member, lo, hi, num_units=num_units)


def member_unit_sq_sums(
    tensor: Tensor, member: Member, *, num_units: int, acc_dtype: torch.dtype, offset: int = 0
) -> Tensor:
    """Partial ``Q`` (``[C]``) of one member from a tensor holding its channels ``[offset, offset + L)``.

    Only the channels inside the member's slice are read; a tensor holding a piece of the reduction axis gives
    partial sums that add up over pieces. Per-channel sums do not depend on which channels are held, so a full
    tensor and its shards produce the same per-channel values. Where the held channels are whole units (always for a
    full tensor), channel sums fold into unit sums with a reshape; otherwise by index.
    """
    lo = max(member.start, offset)
    hi = min(member.stop, offset + tensor.shape[member.dim])
    if hi <= lo:
        return torch.zeros(num_units, dtype=acc_dtype, device=tensor.device)
    sums_L = channel_sq_sums(tensor.narrow(member.dim, lo - offset, hi - lo), dim=member.dim, acc_dtype=acc_dtype)
    return _fold(sums_L, member, lo, hi, num_units=num_units)


def _fold(sums_L: Tensor, member: Member, lo: int, hi: int, *, num_units: int) -> Tensor:
    """Channel sums of the member's channels ``[lo, hi)`` folded into ``[C]`` unit sums."""
    acc_dtype = sums_L.dtype
    first, last = lo - member.start, hi - member.start
    if first % member.block == 0 and last % member.block == 0 and last // member.block <= num_units:
        u0, u1 = first // member.block, last // member.block
        units_U = sums_L if member.block == 1 else sums_L.view(u1 - u0, member.block).sum(dim=1)
        if u0 == 0 and u1 == num_units:
            return units_U
        out_C = torch.zeros(num_units, dtype=acc_dtype, device=sums_L.device)
        out_C[u0:u1] = units_U
        return out_C
    units_L = unit_of_channels(start=member.start, block=member.block, offset=lo, length=hi - lo, device=sums_L.device)
    return fold_to_units(sums_L, units_L, num_units=num_units)


def normalise(q_C: Tensor, *, unit_numel: int, score: ScoreType) -> Tensor:
    """Scores from unit squared norms ``Q``: ``sqrt(Q)`` divided by ``sqrt(G)`` (rms), 1 (l2) or ``G`` (param_cost).

    Raises:
        ValueError: If ``score`` is not one of ``rms``, ``l2``, ``param_cost``.

    Example::

        >>> normalise(torch.tensor([4.0, 16.0]), unit_numel=4, score="rms")
        tensor([1., 2.])
    """
    norm = q_C.sqrt()
    if score == "rms":
        return norm / math.sqrt(unit_numel)
    if score == "l2":
        return norm
    if score == "param_cost":
        return norm / unit_numel
    raise ValueError(
        f"`score` must be one of {WEIGHT_SCORES}, got {score!r} (activation scores: lightning_pat.scoring.activation)."
    )


def group_count_correction(scores_C: Tensor, *, reference: int | None) -> Tensor:
    """Multiply scores by ``sqrt(C / reference)`` so clusters of different sizes compete fairly in one budget."""
    if reference is None:
        return scores_C
    return scores_C * math.sqrt(scores_C.numel() / reference)
