"""Sharded-path eligibility and local boxes from global metadata (pure: no process group needed).

The reference is torch's own DTensor metadata code (``_compute_local_shape_and_global_offset`` for the box and
``Shard/_StridedShard.local_shard_size_and_offset`` for the exact index set a rank holds), which is independent of
``lightning_pat.parallel.placement``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from lightning_pat.core.spec import Member, ResolvedCluster
from lightning_pat.parallel.placement import (
    chunk_range,
    cluster_reason,
    contributes,
    gather_axes,
    layout_reason,
    local_box,
    unsupported_reason,
)

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _torch_indices(length: int, placements: tuple, mesh_shape: tuple, coord: tuple, dim: int) -> torch.Tensor:
    """Global indices along tensor ``dim`` held at ``coord``, computed by torch's placement classes."""
    idx = torch.arange(length)
    for axis, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)) or p.dim != dim:
            continue
        if isinstance(p, _StridedShard):
            _, offs = p.local_shard_size_and_offset(
                idx.numel(), mesh_shape[axis], coord[axis], offset_mode=_StridedShardOffsetMode.ALL
            )
            idx = idx[torch.tensor(offs, dtype=torch.long)] if offs else idx[:0]
        else:
            size, off = Shard.local_shard_size_and_offset(idx.numel(), mesh_shape[axis], coord[axis])
            idx = idx[off : off + size]
    return idx


PLACEMENT_CHOICES = [
    R,
    S0,
    S1,
    _StridedShard(0, split_factor=2),
    _StridedShard(1, split_factor=2),
    _StridedShard(0, split_factor=3),
]
MESHES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (4, 2)]
SHAPES = [(0, 3), (1, 5), (2, 7), (5, 3), (7, 6), (8, 8), (12, 10), (13,), (6,)]


def _cases():
    for mesh_shape in MESHES:
        for shape in SHAPES:
            for placements in itertools.product(PLACEMENT_CHOICES, repeat=len(mesh_shape)):
                if any(isinstance(p, (Shard, _StridedShard)) and p.dim >= len(shape) for p in placements):
                    continue
                yield shape, placements, mesh_shape


def test_local_box_and_contiguity_match_torch():
    checked = strided_ok = strided_rejected = 0
    for shape, placements, mesh_shape in _cases():
        reason = layout_reason(shape, placements, mesh_shape=mesh_shape)
        any_gap = False
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            per_dim = [_torch_indices(size, placements, mesh_shape, coord, d) for d, size in enumerate(shape)]
            gap = any(
                i.numel() > 1 and not torch.equal(i, torch.arange(int(i[0]), int(i[0]) + i.numel())) for i in per_dim
            )
            any_gap |= gap
            if gap:
                with pytest.raises(ValueError, match="not contiguous"):
                    local_box(shape, placements, mesh_shape=mesh_shape, coordinate=coord)
                continue
            box = local_box(shape, placements, mesh_shape=mesh_shape, coordinate=coord)
            assert tuple(n for _, n in box) == tuple(i.numel() for i in per_dim), (shape, placements, coord)
            for (off, n), i in zip(box, per_dim, strict=True):
                if n:
                    assert off == int(i[0]), (shape, placements, coord)
            t_shape, t_off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            assert tuple(t_shape) == tuple(n for _, n in box)
            assert all(o == to for (o, n), to in zip(box, t_off, strict=True) if n)
            checked += 1
        assert (reason is not None) == any_gap, (shape, placements, mesh_shape, reason)
        if any(isinstance(p, _StridedShard) for p in placements):
            strided_ok += reason is None
            strided_rejected += reason is not None
    assert checked > 4000
    assert strided_ok > 100
    assert strided_rejected > 100


def test_chunk_semantics_uneven_and_empty():
    assert [chunk_range(14, num_chunks=4, index=i) for i in range(4)] == [(0, 4), (4, 4), (8, 4), (12, 2)]
    assert [chunk_range(5, num_chunks=4, index=i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [chunk_range(4, num_chunks=3, index=i) for i in range(3)] == [(0, 2), (2, 2), (4, 0)]


def test_nested_shards_on_one_dim_follow_mesh_axis_order():
    # (Shard(0), Shard(0)) on a 2x2 mesh: mesh axis 0 splits first, axis 1 splits the local chunk.
    boxes = {c: local_box((8, 2), (S0, S0), mesh_shape=(2, 2), coordinate=c)[0] for c in [(0, 0), (0, 1), (1, 0)]}
    assert boxes == {(0, 0): (0, 2), (0, 1): (2, 2), (1, 0): (4, 2)}
    # FSDP2 + TP: _StridedShard on the dp axis is applied after the tp split (right to left).
    ss = (_StridedShard(0, split_factor=2), S0)
    assert local_box((8, 2), ss, mesh_shape=(2, 2), coordinate=(0, 1))[0] == (4, 2)
    assert local_box((8, 2), ss, mesh_shape=(2, 2), coordinate=(1, 0))[0] == (2, 2)


@pytest.mark.parametrize(
    ("placements", "match"),
    [((Partial(),), "Partial"), ((S0, Partial()), "mesh axis 1"), ((Shard(2),), "shards dim 2")],
)
def test_unsupported_placements_have_reasons(placements, match):
    reason = unsupported_reason(placements, ndim=2)
    assert reason is not None
    assert match in reason
    assert layout_reason((4, 4), placements, mesh_shape=(2,) * len(placements)) == reason
    with pytest.raises(ValueError, match="Cannot compute a local box"):
        local_box((4, 4), placements, mesh_shape=(2,) * len(placements), coordinate=(0,) * len(placements))


def test_strided_noncontiguous_reason_names_coordinate():
    reason = layout_reason((6, 2), (_StridedShard(0, split_factor=2),), mesh_shape=(2,))
    assert reason is not None
    assert "non-contiguous" in reason
    assert "(0,)" in reason


def test_gather_axes_and_replica_contribution():
    assert gather_axes([(S0, R), (R, R)]) == (0,)
    assert gather_axes([(R, S1), (S0, R)]) == (0, 1)
    assert gather_axes([(R, R)]) == ()
    assert gather_axes([(_StridedShard(0, split_factor=2), S0)]) == (0, 1)
    # A member replicated on a gathered axis contributes only at coordinate 0 of that axis.
    assert contributes((R, S0), coordinate=(0, 1), axes=(0, 1))
    assert not contributes((R, S0), coordinate=(1, 1), axes=(0, 1))
    # Replication on an axis that is not gathered does not matter: each replica group sums on its own.
    assert contributes((S0, R), coordinate=(1, 1), axes=(0,))
    # Over all coordinates of the gather group, each piece of a replicated member is counted exactly once.
    for placements in [(R, S0), (S0, R), (R, R), (S1, S0)]:
        count = sum(contributes(placements, coordinate=c, axes=(0, 1)) for c in itertools.product(range(2), range(3)))
        sharded_ways = 1
        for n, p in zip((2, 3), placements, strict=True):
            sharded_ways *= n if not isinstance(p, Replicate) else 1
        assert count == sharded_ways


def test_cluster_reason_names_the_member():
    members = (Member("w", "writer", 0, 0, 8, 1, (8, 4)), Member("r", "reader", 1, 0, 8, 1, (4, 8)))
    rc = ResolvedCluster("c", members, num_units=8)
    assert cluster_reason(rc, [(S0,), (S1,)], mesh_shape=(3,)) is None
    reason = cluster_reason(rc, [(S0,), (Partial(),)], mesh_shape=(3,))
    assert reason is not None
    assert reason.startswith("member 'r'")
    with pytest.raises(ValueError, match="2 members"):
        cluster_reason(rc, [(S0,)], mesh_shape=(3,))
