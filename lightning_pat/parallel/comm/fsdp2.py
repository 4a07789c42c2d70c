"""FSDP2 (``fully_shard``) introspection and the packed gather of the teacher's forward.

What a ``fully_shard`` module keeps (its mesh dims, its mixed-precision policy, its original class) is read here so
that no other module touches FSDP2's private state. :func:`gather_packed` gathers one ``fully_shard`` group's
parameters with one all-gather per process group, as FSDP2's unshard does (:mod:`lightning_pat.parallel.teacher`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_pat.parallel.comm import dtensor, reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def fsdp2_mesh_dims(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The mesh dim names ``fully_shard`` (FSDP2) shards ``module``'s own parameters over; ``None`` if not FSDP2.

    Raises:
        ValueError: If the module is managed by FSDP2 on a mesh without dim names (the axes cannot be told apart).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return None
    # fully_shard is wrapped by contract(), which adds .state; torch annotates it by its overloads, which hide it
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    group = state._fsdp_param_group  # noqa: SLF001 - FSDP2 keeps its mesh here
    if group is None:  # fully_shard on a module without parameters of its own
        return ()
    names = group.mesh_info.mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"{type(module).__name__} is sharded by fully_shard on a mesh without dim names; build the mesh with "
            "`mesh_dim_names` (ModelParallelStrategy does) so that the data-parallel axes can be told from the others."
        )
    return tuple(names)


def fsdp2_policy(module: torch.nn.Module) -> Any | None:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` was given for ``module``; ``None`` if ``module`` is not FSDP2's.

    FSDP2 keeps it on the module's state (``fully_shard.state(module)._mp_policy``): every ``fully_shard`` module casts
    its floating-point inputs to ``param_dtype`` (with ``cast_forward_inputs``) and its outputs to ``output_dtype``;
    its group's floating-point parameters are cast to ``param_dtype`` before they are gathered.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return None
    state = fully_shard.state(module)  # type: ignore[attr-defined]  # contract()'s .state, hidden by the overloads
    return state._mp_policy  # noqa: SLF001 - FSDP2 keeps the policy here


def unsharded_class(module: torch.nn.Module) -> type[torch.nn.Module]:
    """The class ``module`` had before ``fully_shard`` swapped it for its ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return cast("type[torch.nn.Module]", cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)])
    return cls


def is_composable_state_key(key: str) -> bool:
    """Whether a module ``__dict__`` key holds the state of a composable distributed API (``fully_shard``)."""
    return key.startswith("__composable_api")


def gather_axes(tensor: Tensor, dims: Sequence[str]) -> Tensor:
    """``tensor`` gathered along the mesh axes named ``dims`` (what FSDP2's unshard gives a forward).

    A DTensor with no other sharded axis becomes a plain tensor; with other axes (tensor parallel) it stays a DTensor
    on the sub-mesh of those axes, with their placements. A plain tensor is returned as is. One collective per
    sharded axis in ``dims``.
    """
    data = tensor.detach()
    if not dtensor.is_dtensor(data):
        return data
    mesh = data.device_mesh
    names = mesh.mesh_dim_names or ()
    gathered = [i for i, name in enumerate(names) if name in dims]
    if not gathered:
        return data
    placements = [Replicate() if i in gathered else p for i, p in enumerate(data.placements)]
    full = data.redistribute(mesh, placements).to_local()
    rest = [name for i, name in enumerate(names) if i not in gathered]
    if not rest:
        return full
    return DTensor.from_local(
        full, mesh[tuple(rest)], [data.placements[i] for i, name in enumerate(names) if name in rest],
        run_check=False, shape=data.shape, stride=data.stride(),
    )  # fmt: skip


_ALIGN = 16  # bytes: every packed segment starts here, so that its bytes view as any dtype


def _packable_axis(tensor: DTensor, dims: Sequence[str]) -> int | None:
    """The mesh axis named in ``dims`` along which ``tensor`` (a DTensor) is packed, ``-1`` if none shards it.

    ``None`` for a layout FSDP2 does not make, which :func:`gather_packed` leaves to :func:`gather_axes`: several
    sharded axes in ``dims``, a partial value, or a plain ``Shard`` split again along the same tensor dim by a later
    axis (the pieces of one coordinate are then not contiguous; FSDP2 writes ``_StridedShard`` there). Global
    metadata only: every rank decides alike.
    """
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    placements = tensor.placements
    names = tensor.device_mesh.mesh_dim_names or ()
    axes = [i for i, name in enumerate(names) if name in dims and not placements[i].is_replicate()]
    if not axes:
        return -1
    axis = axes[0]
    placement = placements[axis]
    if len(axes) > 1 or not isinstance(placement, (Shard, _StridedShard)):
        return None
    later = [p for p in placements[axis + 1 :] if isinstance(p, (Shard, _StridedShard)) and p.dim == placement.dim]
    if later and not isinstance(placement, _StridedShard):
        return None
    return axis


def _after_gather(full: Tensor, like: DTensor, dims: Sequence[str]) -> Tensor:
    """``full`` (DTensor ``like`` gathered along the axes in ``dims``): plain, or a DTensor on the other axes."""
    names = like.device_mesh.mesh_dim_names or ()
    kept = [i for i, name in enumerate(names) if name not in dims]
    if not kept:
        return full
    return DTensor.from_local(
        full, like.device_mesh[tuple(names[i] for i in kept)], [like.placements[i] for i in kept],
        run_check=False, shape=like.shape, stride=like.stride(),
    )  # fmt: skip


@dataclass
class _Segment:
    """One DTensor's place in a packed gather: its (cast) local shard and every coordinate's shard shape."""

    index: int
    like: DTensor
    local: Tensor
    axis: int
    dim: int
    shapes: list[tuple[int, ...]]
    group: ProcessGroup
    offset: int = 0

    @classmethod
    def plan(cls, index: int, data: DTensor, axis: int, local: Tensor) -> _Segment:
        """Shard shapes by ``torch.chunk`` along the shard dim of what gathering ``axis`` gives this rank.

        Raises:
            ValueError: If this rank's shard does not have the shape that chunking gives.
        """
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import Shard, _StridedShard

        placement = data.placements[axis]
        assert isinstance(placement, (Shard, _StridedShard)), placement  # _packable_axis chose a sharded axis
        mesh, dim = data.device_mesh, placement.dim
        rest = [Replicate() if j == axis else p for j, p in enumerate(data.placements)]
        whole, _ = compute_local_shape_and_global_offset(data.shape, mesh, rest)
        k, n = mesh.size(axis), whole[dim]
        chunk = -(-n // k)  # torch.chunk: ceil(n / k) each, the last ones fewer or none (FSDP2's split)
        shapes = [(*whole[:dim], max(0, min(chunk, n - c * chunk)), *whole[dim + 1 :]) for c in range(k)]
        mine = shapes[mesh.get_local_rank(axis)]
        if tuple(local.shape) != mine:
            raise ValueError(
                f"A DTensor of global shape {tuple(data.shape)} and placements {tuple(data.placements)} holds a local "
                f"shard of shape {tuple(local.shape)} on this rank, expected {mine} (torch.chunk along dim {dim}, "
                "as FSDP2 shards)."
            )
        return cls(index, data, local, axis, dim, shapes, mesh.get_group(axis))

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest coordinate's shard (every rank's slot in the buffer)."""
        return max(math.prod(s) for s in self.shapes) * self.local.element_size()

    def unpack(self, rows: Tensor) -> Tensor:
        """The shards in ``rows`` (one gathered buffer per group rank) joined along ``dim`` in coordinate order."""
        order = reduce.gather_order(self.like.device_mesh, (self.axis,), self.group)
        size = self.local.element_size()
        pieces = [
            rows[order[c], self.offset : self.offset + math.prod(shape) * size].view(self.local.dtype).view(shape)
            for c, shape in enumerate(self.shapes)
        ]
        return torch.cat(pieces, dim=self.dim)


def gather_packed(tensors: Sequence[Tensor], dims: Sequence[str], *, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Every tensor gathered along the mesh axes named ``dims`` (as :func:`gather_axes`), one collective per group.

    What FSDP2's unshard does for one ``fully_shard`` group: each DTensor's local shard (cast to ``dtype`` first if
    it is a floating-point tensor and ``dtype`` is given, as FSDP2 casts to ``param_dtype`` before gathering) is
    packed as bytes into one flat buffer per process group of the sharding axis (one group in every FSDP2 layout),
    the buffer is all-gathered once, and the pieces are concatenated along each tensor's shard dim in
    mesh-coordinate order. Shards may be uneven (FSDP2 chunks dim 0 like ``torch.chunk``: later ranks may hold fewer
    rows or none): every rank computes every coordinate's size from the global shape, so the buffers have the same
    length everywhere. A DTensor also sharded along other axes (tensor parallel) comes back as a DTensor on the
    sub-mesh of those axes, with their placements; one with no sharded axis in ``dims`` and a plain tensor need no
    communication (a plain tensor is only cast). The choice of collectives depends on global metadata only.

    A layout FSDP2 does not make (several sharded axes in ``dims``, a partial value, a plain ``Shard`` split again
    by a later axis) is gathered by :func:`gather_axes` instead (per tensor).

    Args:
        tensors: The tensors (FSDP2-managed parameters), any mix of dtypes.
        dims: The mesh dim names of FSDP2's mesh.
        dtype: The dtype floating-point tensors are cast to before gathering (FSDP2's ``param_dtype``), or ``None``.

    Returns:
        The gathered tensors, in the order of ``tensors``.

    Raises:
        ValueError: If a DTensor's local shard does not have the size ``torch.chunk`` along its shard dim gives.
    """

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    out: list[Tensor | None] = [None] * len(tensors)
    packs: dict[tuple[int, ...], list[_Segment]] = {}
    for i, tensor in enumerate(tensors):
        data = tensor.detach()
        if not dtensor.is_dtensor(data):
            out[i] = cast(data)
            continue
        axis = _packable_axis(data, dims)
        if axis is None:  # not FSDP2's layout: DTensor's redistribute (one collective per sharded axis)
            out[i] = cast(gather_axes(data, dims))
        elif axis < 0:  # no sharded axis among ``dims``: nothing to gather
            out[i] = _after_gather(cast(data.to_local()), data, dims)
        else:
            segment = _Segment.plan(i, data, axis, cast(data.to_local()))
            packs.setdefault(reduce.group_key(segment.group), []).append(segment)
    for segments in packs.values():
        length = 0
        for segment in segments:
            segment.offset, length = length, length + -(-segment.slot_bytes // _ALIGN) * _ALIGN
        buffer = torch.zeros(length, dtype=torch.uint8, device=segments[0].local.device)
        for segment in segments:
            raw = segment.local.contiguous().view(-1).view(torch.uint8)
            buffer[segment.offset : segment.offset + raw.numel()] = raw
        rows = reduce.all_gather_packed(buffer, group=segments[0].group)  # the one collective of this group
        for segment in segments:
            out[segment.index] = _after_gather(segment.unpack(rows), segment.like, dims)
    return out  # type: ignore[return-value]
