"""Local pieces of sharded tensors and sharded-path eligibility, from global metadata only (pure, no comms).

A DTensor's placements say, per mesh axis, how the global tensor is split: ``Shard(d)`` cuts tensor dim ``d``
into ``mesh_shape[axis]`` chunks with ``torch.chunk`` semantics (chunk ``ceil(L / n)``, trailing chunks may be
short or empty); two ``Shard`` on one tensor dim nest in mesh-axis order. ``_StridedShard(d, split_factor=f)``
(FSDP2 on top of tensor parallel) cuts the current range into ``f`` chunks first and takes this rank's chunk of
each; it is supported when every rank's piece is one contiguous range. ``Replicate`` keeps the whole range.

Everything here is a function of (global shape, placements, mesh shape, coordinate) so that every rank takes
the same decision. A piece is described per tensor dim by ``(offset, length)`` into the global tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache
from typing import cast

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from lightning_pat.core.spec import ResolvedCluster

Range = tuple[int, int]  # (global offset, length)
_Intervals = tuple[Range, ...]


def chunk_range(length: int, *, num_chunks: int, index: int) -> Range:
    """``(offset, length)`` of chunk ``index`` of ``num_chunks`` over ``length`` elements (``torch.chunk`` rule).

    Example::

        >>> [chunk_range(8, num_chunks=3, index=i) for i in range(3)], chunk_range(2, num_chunks=4, index=3)
        ([(0, 3), (3, 3), (6, 2)], (2, 0))
    """
    size = -(-length // num_chunks)
    start = min(size * index, length)
    stop = min(size * (index + 1), length)
    return start, max(0, stop - start)


def _take(intervals: _Intervals, start: int, length: int) -> _Intervals:
    """Elements ``[start, start + length)`` of the concatenation of ``intervals``."""
    out: list[Range] = []
    pos = 0
    for off, n in intervals:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if hi > lo:
            out.append((off + lo - pos, hi - lo))
        pos += n
    return tuple(out)


def _merge(intervals: _Intervals) -> _Intervals:
    out: list[Range] = []
    for off, n in intervals:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return tuple(out)


def _split(intervals: _Intervals, placement: Placement, *, num_chunks: int, index: int) -> _Intervals:
    total = sum(n for _, n in intervals)
    if isinstance(placement, _StridedShard):
        pieces: list[Range] = []
        factor = cast(int, placement.split_factor)  # int | SymInt in torch's types; an int outside tracing
        for outer in range(factor):
            o_start, o_len = chunk_range(total, num_chunks=factor, index=outer)
            i_start, i_len = chunk_range(o_len, num_chunks=num_chunks, index=index)
            pieces.extend(_take(intervals, o_start + i_start, i_len))
        return _merge(tuple(pieces))
    start, length = chunk_range(total, num_chunks=num_chunks, index=index)
    return _merge(_take(intervals, start, length))


def unsupported_reason(placements: Sequence[Placement], *, ndim: int) -> str | None:
    """Why a placement tuple is not handled by the sharded path (``None`` if every entry is understood).

    Example::

        >>> unsupported_reason((Shard(0), Replicate()), ndim=2) is None
        True
    """
    for axis, p in enumerate(placements):
        kind = type(p)
        if kind is Replicate:
            continue
        if kind in (Shard, _StridedShard):
            dim = cast("Shard | _StridedShard", p).dim
            if not -ndim <= dim < ndim:
                return f"placement {p!r} on mesh axis {axis} shards dim {dim} of a {ndim}-D tensor"
            continue
        return f"placement {p!r} on mesh axis {axis} is not Shard/Replicate (Partial or unknown)"
    return None


def _pieces(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
) -> tuple[_Intervals, ...]:
    per_dim: list[_Intervals] = [((0, size),) if size else () for size in shape]
    for axis, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        dim = cast("Shard | _StridedShard", p).dim % len(shape)  # unsupported_reason let only these through
        per_dim[dim] = _split(per_dim[dim], p, num_chunks=mesh_shape[axis], index=coordinate[axis])
    return tuple(per_dim)


def local_box(
    shape: Sequence[int], placements: Sequence[Placement], *, mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> tuple[Range, ...]:
    """Per tensor dim, the ``(offset, length)`` of the piece held at mesh ``coordinate``.

    Raises:
        ValueError: If a placement is unsupported, or the piece is not one contiguous range in some dim.

    Example::

        >>> local_box((8, 4), (Shard(0),), mesh_shape=(3,), coordinate=(2,))
        ((6, 2), (0, 4))
    """
    shape, placements = tuple(shape), tuple(placements)
    reason = unsupported_reason(placements, ndim=len(shape))
    if reason is not None:
        raise ValueError(f"Cannot compute a local box: {reason}.")
    out: list[Range] = []
    for dim, intervals in enumerate(_pieces(shape, placements, tuple(mesh_shape), tuple(coordinate))):
        if len(intervals) > 1:
            raise ValueError(f"The local piece of dim {dim} is not contiguous: {list(intervals)}.")
        out.append(intervals[0] if intervals else (0, 0))
    return tuple(out)


@lru_cache(maxsize=4096)
def _layout_reason(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> str | None:
    reason = unsupported_reason(placements, ndim=len(shape))
    if reason is not None:
        return reason
    if len(placements) != len(mesh_shape):
        return f"{len(placements)} placements for a {len(mesh_shape)}-D mesh"
    if not any(isinstance(p, _StridedShard) for p in placements):
        return None  # nested chunks of a contiguous range are contiguous
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        for dim, intervals in enumerate(_pieces(shape, placements, mesh_shape, coordinate)):
            if len(intervals) > 1:
                return (
                    f"{placements} gives mesh coordinate {coordinate} a non-contiguous piece of dim {dim} "
                    f"{list(intervals)}"
                )
    return None


def layout_reason(shape: Sequence[int], placements: Sequence[Placement], *, mesh_shape: Sequence[int]) -> str | None:
    """Why one tensor layout is ineligible for the sharded path, or ``None`` if every rank's piece is a box.

    Example::

        >>> from torch.distributed.tensor import Partial
        >>> layout_reason((8, 4), (Partial(),), mesh_shape=(2,))
        'placement Partial(sum) on mesh axis 0 is not Shard/Replicate (Partial or unknown)'
    """
    return _layout_reason(tuple(shape), tuple(placements), tuple(mesh_shape))


def gather_axes(placements: Sequence[Sequence[Placement]]) -> tuple[int, ...]:
    """Mesh axes on which any of the given placement tuples is sharded: the partial sums are gathered over these.

    Example::

        >>> gather_axes([(Replicate(), Shard(0)), (Replicate(), Replicate())])
        (1,)
    """
    axes = {axis for ps in placements for axis, p in enumerate(ps) if type(p) is not Replicate}
    return tuple(sorted(axes))


def contributes(placements: Sequence[Placement], *, coordinate: Sequence[int], axes: Sequence[int]) -> bool:
    """Whether this rank's partial of a tensor enters the sum over ``axes``.

    A tensor replicated on a gathered axis contributes only at coordinate 0 of that axis, so that the sum over the
    gather group counts every piece exactly once.

    Example::

        >>> contributes((Shard(0), Replicate()), coordinate=(1, 1), axes=(0, 1))
        False
    """
    return all(coordinate[a] == 0 for a in axes if type(placements[a]) is Replicate)


def cluster_reason(
    cluster: ResolvedCluster, placements: Sequence[Sequence[Placement]], *, mesh_shape: Sequence[int]
) -> str | None:
    """Why ``cluster`` cannot take the sharded path, or ``None`` if it can.

    Args:
        cluster: The resolved cluster (global shapes, channel axes).
        placements: Per member (same order as ``cluster.members``), its DTensor placements.
        mesh_shape: Shape of the members' common device mesh.

    Example::

        >>> from lightning_pat.core.spec import Member
        >>> rc = ResolvedCluster("h", (Member("w", "writer", 0, 0, 8, 1, (8, 4)),), num_units=8)
        >>> cluster_reason(rc, [(Shard(1),)], mesh_shape=(4,)) is None
        True
    """
    if len(placements) != len(cluster.members):
        raise ValueError(f"Cluster {cluster.name!r}: {len(placements)} placements for {len(cluster.members)} members.")
    for member, ps in zip(cluster.members, placements, strict=True):
        reason = layout_reason(member.shape, ps, mesh_shape=mesh_shape)
        if reason is not None:
            return f"member {member.name!r}: {reason}"
    return None
