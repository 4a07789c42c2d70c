"""The only module that calls ``torch.distributed`` collectives; DTensor and mesh helpers.

Every function that communicates takes an explicit group or mesh and returns a result identical on every
participating rank. Float partials are gathered and summed in fixed rank order, never all-reduced; integer counts
may be all-reduced (exact).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_pat.core.pruning_warning import PruningWarning


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (parameters included)."""
    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """The rank-local storage of ``tensor`` (itself for a plain tensor); in-place writes reach the parameter."""
    data = tensor.detach()
    if is_dtensor(data):
        with torch.no_grad():
            return data.to_local()  # a view of the local shard: in-place writes reach the storage
    return data


def participates(tensor: Tensor) -> bool:
    """False on a rank outside the mesh of a DTensor (it must issue no collectives for it)."""
    return not is_dtensor(tensor) or tensor.device_mesh.get_coordinate() is not None


def full_tensor(tensor: Tensor) -> Tensor:
    """A dense copy of ``tensor`` on this rank: an all-gather over every sharded mesh dim for a DTensor."""
    data = tensor.detach()
    if is_dtensor(data):
        return data.full_tensor()
    return data


def write_back_(tensor: Tensor, dense: Tensor) -> None:
    """Copy a dense tensor (identical on every rank) into ``tensor``; each rank slices its own shard, no broadcast."""
    data = tensor.detach()
    if is_dtensor(data):
        shard = distribute_tensor(dense, data.device_mesh, data.placements, src_data_rank=None)
        local_tensor(data).copy_(shard.to_local())
    elif dense.data_ptr() != data.data_ptr():
        data.copy_(dense)


def is_counting_replica(tensor: Tensor) -> bool:
    """Whether this rank's piece of ``tensor`` should be counted, so that per-rank counts sum to the truth.

    A DTensor is counted only by ranks at coordinate 0 of every mesh dim on which it is replicated. A plain tensor
    is replicated over the whole default group (DDP), so only global rank 0 counts it when one is initialised.
    """
    if is_dtensor(tensor):
        coord = tensor.device_mesh.get_coordinate()
        if coord is None:
            return False
        return all(c == 0 for c, p in zip(coord, tensor.placements, strict=True) if isinstance(p, Replicate))
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def all_reduce_sum_(counts: Tensor, *, group: Any) -> Tensor:
    """Sum an integer tensor over ``group`` in place (exact) and return it.

    Raises:
        TypeError: If ``counts`` is floating point (float sums are order dependent; gather instead).
    """
    if counts.dtype.is_floating_point:
        raise TypeError("all_reduce_sum_ takes integer tensors only; gather float partials and sum in rank order.")
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts


# ---------------------------------------------------------------------------------------------- sharded path
def mesh_ranks_along(mesh: Any, axes: Sequence[int]) -> list[int]:
    """Global ranks of this rank's sub-grid spanning mesh ``axes``, in row-major coordinate order over ``axes``.

    Raises:
        ValueError: If this rank is not in ``mesh``.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("This rank is not part of the mesh; it must not take part in the mesh's collectives.")
    index = tuple(slice(None) if a in axes else coord[a] for a in range(mesh.ndim))
    return mesh.mesh[index].flatten().tolist()


def mesh_is_increasing(mesh: Any) -> bool:
    """Whether global ranks increase along every axis of ``mesh`` (global metadata, the same on every rank).

    ``DTensor.full_tensor`` gathers each mesh axis in process-group rank order, which is the coordinate order only
    on such meshes; on others it assembles rows in the wrong order (torch 2.13).

    Example::

        >>> class _Mesh:
        ...     def __init__(self, ranks): self.mesh = torch.tensor(ranks)
        >>> mesh_is_increasing(_Mesh([[0, 1], [2, 3]])), mesh_is_increasing(_Mesh([[2, 0], [1, 3]]))
        (True, False)
    """
    ranks = mesh.mesh
    return all(bool((ranks.diff(dim=d) > 0).all()) for d in range(ranks.dim()) if ranks.shape[d] > 1)


def axes_group(mesh: Any, axes: Sequence[int], *, cache: dict[tuple[int, ...], Any]) -> Any:
    """The process group spanning mesh ``axes`` through this rank; only the group's members create it.

    One axis is the mesh's own group. Several axes reuse WORLD when they cover every rank, and otherwise create
    a group once per ``cache`` (owned by the caller, e.g. an executor, so that a group never outlives the process
    group it was made from) with local synchronisation (only its members call ``new_group``, in the same order).

    Raises:
        ValueError: If ``axes`` is empty or this rank is not in ``mesh``.
    """
    axes = tuple(sorted(axes))
    if not axes:
        raise ValueError("`axes` must name at least one mesh axis.")
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    key = tuple(sorted(mesh_ranks_along(mesh, axes)))
    if key == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    if key not in cache:
        cache[key] = dist.new_group(ranks=list(key), use_local_synchronization=True)
    return cache[key]


def mesh_group(mesh: Any, *, cache: dict[tuple[int, ...], Any]) -> Any:
    """The process group over every rank of ``mesh`` (see :func:`axes_group`)."""
    return axes_group(mesh, tuple(range(mesh.ndim)), cache=cache)


def any_rank(flags: Sequence[bool], *, group: Any) -> list[bool]:
    """Per flag, whether it is true on any rank of ``group`` (one int64 all_reduce; the same on every rank).

    Used where a rank-local condition (a local shape, a missing gradient) decides whether to raise or to enter a
    collective, so that every rank takes the same branch.
    """
    if not flags or group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(flags)
    value = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":  # pragma: no cover - GPU only
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in value.tolist()]


def group_size(group: Any) -> int:
    """Number of ranks in ``group``."""
    return dist.get_world_size(group)


def group_key(group: Any) -> tuple[int, ...]:
    """The sorted global ranks of ``group``: groups with equal keys connect the same ranks."""
    return tuple(sorted(dist.get_process_group_ranks(group)))


def gather_order(mesh: Any, axes: Sequence[int], group: Any) -> list[int]:
    """Row indices of an :func:`all_gather_packed` result over ``group``, in mesh-coordinate order over ``axes``.

    Summing the gathered rows in this order makes every replica group run the same additions on the same data,
    whatever rank numbering its process group uses.
    """
    group_ranks = dist.get_process_group_ranks(group)
    return [group_ranks.index(r) for r in mesh_ranks_along(mesh, tuple(sorted(axes)))]


def all_gather_packed(buffer_L: Tensor, *, group: Any) -> Tensor:
    """Gather one 1-D buffer from every rank of ``group``: an ``[n, L]`` tensor, row ``i`` from group rank ``i``.

    Exact (no arithmetic); a group of one rank issues no collective.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return buffer_L.unsqueeze(0)
    out = torch.empty(n * buffer_L.numel(), dtype=buffer_L.dtype, device=buffer_L.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gather(out, buffer_L.contiguous(), group=group)
    return out.view(n, buffer_L.numel())


def ordered_sum(rows_nL: Tensor, order: Sequence[int]) -> Tensor:
    """Sum the rows of ``rows_nL`` one at a time in ``order`` (a fixed association: bitwise reproducible)."""
    acc_L = rows_nL[order[0]].clone()
    for i in order[1:]:
        acc_L += rows_nL[i]
    return acc_L


def gather_sum(buffer_L: Tensor, *, group: Any, order: Sequence[int]) -> Tensor:
    """Exact sum of every rank's ``buffer_L`` over ``group``: one all_gather, then :func:`ordered_sum` locally.

    Each rank receives ``(n - 1) * L`` elements. Every rank of every replica group runs the same additions in the
    same (mesh-coordinate) order on the same data, so the result is bitwise identical everywhere.
    """
    return ordered_sum(all_gather_packed(buffer_L, group=group), order)


def scatter_gather_sum(buffer_L: Tensor, *, group: Any, order: Sequence[int]) -> Tensor:
    """The same bits as :func:`gather_sum` with ``2 (n - 1) / n * L`` elements received: two collectives.

    The buffer is cut into ``n`` blocks; block ``j`` goes to the rank at coordinate index ``j`` (``all_to_all``),
    which adds the ``n`` pieces in coordinate order exactly as :func:`ordered_sum` would, then the summed blocks are
    all-gathered. Every element sees the same additions in the same order as on the one-collective path.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return buffer_L.clone()
    length = buffer_L.numel()
    block = -(-length // n)
    padded = torch.zeros(n * block, dtype=buffer_L.dtype, device=buffer_L.device)
    padded[:length] = buffer_L
    send_nB = torch.empty(n, block, dtype=buffer_L.dtype, device=buffer_L.device)
    for j, row in enumerate(order):  # the group rank at coordinate index j owns block j
        send_nB[row] = padded[j * block : (j + 1) * block]
    recv_nB = torch.empty_like(send_nB)
    dist.all_to_all_single(recv_nB, send_nB, group=group)  # row g: rank g's piece of my block
    mine_B = ordered_sum(recv_nB, order)
    rows_nB = all_gather_packed(mine_B, group=group)
    return torch.cat([rows_nB[row] for row in order])[:length]


def sum_over_ranks(buffer_L: Tensor, *, group: Any) -> Tensor:
    """Sum of every rank's float ``buffer_L`` over ``group``, bitwise identical on every rank (one collective).

    Used for the activation statistics of ``score="activation"`` under DDP, where every rank sees other batches:
    one all_gather, then the rows are added in group-rank order (a float all_reduce would not promise the same
    bits on every rank). Without a process group, or in a group of one rank, ``buffer_L`` itself.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return buffer_L
    return gather_sum(buffer_L, group=group, order=list(range(dist.get_world_size(group))))


def world_group() -> Any:
    """The default (WORLD) process group, or ``None`` when torch.distributed is not initialised."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def world_rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _launch_rank() -> int:
    """This process's global rank; before the process group exists, the launcher's ``RANK`` (else 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def rank_zero_warn(message: str) -> None:
    """A :class:`~lightning_pat.core.pruning_warning.PruningWarning` on global rank 0 only.

    Every rank reaches the same conclusion; one rank says it.
    """
    if _launch_rank() == 0:
        warnings.warn(message, PruningWarning, stacklevel=3)


def rank_zero_info(message: str, *, logger: logging.Logger) -> None:
    """``logger.info(message)`` on global rank 0 only."""
    if _launch_rank() == 0:
        logger.info(message)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_rank_agreement(digest: Mapping[str, Any], error: str | None) -> None:
    """Compare ``digest`` (e.g. clusters, routes, options), or this rank's error, across all ranks (one collective).

    Raises:
        ValueError: The same error on every rank if any rank failed (its message, naming the rank) or the digests
            differ (naming the parts and the ranks).
    """
    mine = error or _digest(digest)
    everyone = gather_objects((error is not None, mine, dict(digest)), group=world_group())
    failed = [(r, m) for r, (bad, m, _) in enumerate(everyone) if bad]
    if failed:
        rank, msg = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise ValueError(f"{msg} [raised on rank {rank}{others}; all ranks stop here]")
    if len({m for _, m, _ in everyone}) > 1:
        ref = everyone[0][2]
        diff = sorted({k for _, _, d in everyone for k in d if d[k] != ref[k]})
        ranks = [r for r, (_, m, _) in enumerate(everyone) if m != everyone[0][1]]
        raise ValueError(
            f"CoupledPruningCallback: ranks disagree on {diff} (ranks {ranks} differ from rank 0). Every rank "
            "must build the same model and pass the same cluster declarations and options; check code that "
            "depends on the rank (e.g. `if trainer.global_rank == 0`)."
        )


@contextlib.contextmanager
def together(prefix: str | None = None) -> Iterator[None]:
    """Fail on every rank together: a ``ValueError`` raised inside the block stops every rank, naming the rank.

    The block's ``ValueError`` is caught; then one agreement collective (:func:`check_rank_agreement`) runs on every
    rank, so every rank must enter the block (and the ranks that succeeded raise the failed rank's message too). Values
    the block assigns must be initialised before it. Outside torch.distributed the one rank is rank 0.

    Args:
        prefix: Put before the message (e.g. ``"CoupledPruningCallback"``), unless ``None``.

    Raises:
        ValueError: On every rank, if the block raised one on any rank.

    Example::

        >>> with together("X"):
        ...     pass
        >>> try:
        ...     with together("X"):
        ...         raise ValueError("no")
        ... except ValueError as err:
        ...     print(err)
        X: no [raised on rank 0; all ranks stop here]
    """
    error = None
    try:
        yield
    except ValueError as err:
        error = str(err) if prefix is None else f"{prefix}: {err}"
    check_rank_agreement({}, error)


def check_selection_agreement(dropped: Mapping[str, list[int]], *, step: int) -> None:
    """Debug check: compare a hash of the selection across all ranks (one small collective).

    Raises:
        RuntimeError: On every rank, if some rank selected different units than rank 0.
    """
    everyone = gather_objects(_digest(dropped), group=world_group())
    if len(set(everyone)) > 1:
        ranks = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(
            f"CoupledPruningCallback (debug_check_selection): at step {step} ranks {ranks} selected different units "
            "than rank 0; the selection is not identical across the mesh."
        )


def gather_objects(obj: Any, *, group: Any) -> list[Any]:
    """Every rank's picklable ``obj`` in group-rank order (``[obj]`` without a process group)."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _collective_device(group: Any) -> torch.device:
    """Where a group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_json(obj: Any, *, src: int = 0, group: Any) -> Any:
    """Rank ``src``'s JSON-able ``obj`` on every rank of ``group`` (``obj`` itself without a process group).

    The object travels as UTF-8 JSON bytes in a ``uint8`` tensor after its length (two broadcasts), never as a
    pickle: the receivers decode plain data and execute nothing. Other ranks' ``obj`` is ignored (pass ``None``).

    Raises:
        TypeError: On rank ``src``, if ``obj`` is not JSON-serialisable.
    """
    if group is None or dist.get_world_size(group) == 1:
        return obj
    device = _collective_device(group)
    payload = json.dumps(obj).encode() if dist.get_rank() == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.cpu().tolist()).decode()) if dist.get_rank() != src else obj


def as_dtensor(local: Tensor, like: Tensor) -> Tensor:
    """Wrap a rank-local tensor laid out like DTensor ``like`` (same mesh, placements, global shape) as a DTensor."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def shard_like(dense: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of a dense tensor (identical on every rank) laid out like ``like``; no communication."""
    if not is_dtensor(like):
        return dense
    return distribute_tensor(dense, like.device_mesh, like.placements, src_data_rank=None).to_local()


def fsdp2_mesh_dims(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The mesh dim names ``fully_shard`` (FSDP2) shards ``module``'s own parameters over; ``None`` if not FSDP2.

    Raises:
        ValueError: If the module is managed by FSDP2 on a mesh without dim names (the axes cannot be told apart).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return None
    group = fully_shard.state(module)._fsdp_param_group  # noqa: SLF001 - FSDP2 keeps its mesh here
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
    return fully_shard.state(module)._mp_policy  # noqa: SLF001 - FSDP2 keeps the policy here


def unsharded_class(module: torch.nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` swapped it for its ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


def is_device_mesh(obj: object) -> bool:
    """Whether ``obj`` is a ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


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
    if not is_dtensor(data):
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


def _packable_axis(tensor: Tensor, dims: Sequence[str]) -> int | None:
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
    if len(axes) > 1 or not isinstance(placements[axis], (Shard, _StridedShard)):
        return None
    dim = placements[axis].dim
    later = [p for p in placements[axis + 1 :] if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if later and not isinstance(placements[axis], _StridedShard):
        return None
    return axis


def _after_gather(full: Tensor, like: Tensor, dims: Sequence[str]) -> Tensor:
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
    like: Tensor
    local: Tensor
    axis: int
    dim: int
    shapes: list[tuple[int, ...]]
    group: Any
    offset: int = 0

    @classmethod
    def plan(cls, index: int, data: Tensor, axis: int, local: Tensor) -> _Segment:
        """Shard shapes by ``torch.chunk`` along the shard dim of what gathering ``axis`` gives this rank.

        Raises:
            ValueError: If this rank's shard does not have the shape that chunking gives.
        """
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh, dim = data.device_mesh, data.placements[axis].dim  # type: ignore[attr-defined]
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
        order = gather_order(self.like.device_mesh, (self.axis,), self.group)
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
        if not is_dtensor(data):
            out[i] = cast(data)
            continue
        axis = _packable_axis(data, dims)
        if axis is None:  # not FSDP2's layout: DTensor's redistribute (one collective per sharded axis)
            out[i] = cast(gather_axes(data, dims))
        elif axis < 0:  # no sharded axis among ``dims``: nothing to gather
            out[i] = _after_gather(cast(data.to_local()), data, dims)
        else:
            segment = _Segment.plan(i, data, axis, cast(data.to_local()))
            packs.setdefault(group_key(segment.group), []).append(segment)
    for segments in packs.values():
        length = 0
        for segment in segments:
            segment.offset, length = length, length + -(-segment.slot_bytes // _ALIGN) * _ALIGN
        buffer = torch.zeros(length, dtype=torch.uint8, device=segments[0].local.device)
        for segment in segments:
            raw = segment.local.contiguous().view(-1).view(torch.uint8)
            buffer[segment.offset : segment.offset + raw.numel()] = raw
        rows = all_gather_packed(buffer, group=segments[0].group)  # the one collective of this group
        for segment in segments:
            out[segment.index] = _after_gather(segment.unpack(rows), segment.like, dims)
    return out  # type: ignore[return-value]


def load_sharded_(state: dict[str, Any], path: Any) -> None:
    """Fill the (DTensor) entries of ``state`` in place from a torch distributed checkpoint at ``path``.

    Every rank of the checkpoint's process group must call this (it communicates); entries absent from ``state``
    are not read.
    """
    from torch.distributed.checkpoint import load

    load(state, checkpoint_id=path)


def reduce_counts(counts: Tensor, *, group: Any) -> Tensor:
    """Sum int64 counts over ``group`` (one collective, exact) and return them."""
    if dist.get_world_size(group) == 1:
        return counts
    return all_reduce_sum_(counts, group=group)


def _dcp_metadata_global(module: str, name: str) -> bool:
    """The globals a ``torch.distributed.checkpoint`` ``.metadata`` pickle may name (its dataclasses, sizes, dtypes)."""
    if module == "torch.distributed.checkpoint.metadata":
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    if (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_distributed_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read a distributed checkpoint directory (``torch.distributed.checkpoint``) into one state dict in memory.

    Like torch's ``dcp_to_torch_save`` (one process, no process group), but without running code from the files:
    the ``.metadata`` pickle is read through an allow-list (its own dataclasses, sizes, dtypes), every shard file it
    names must lie inside ``directory``, and non-tensor entries load with ``torch.load(weights_only=True)``. Nothing is
    written.

    Args:
        directory: The checkpoint directory (e.g. written by Lightning's ``ModelParallelStrategy``).

    Returns:
        The full (unsharded) state dict, nested as it was saved.

    Raises:
        ValueError: If ``.metadata`` names an object outside the allow-list, a shard name leads outside
            ``directory``, or a file is truncated.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightning_pat.core.safe_io import confined, restricted_unpickle

    root = Path(directory)
    what = f"distributed checkpoint {root}"

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            name = Path(self._get_metadata_path(kwargs.get("rank"))).name
            path = confined(root, name, what=what)
            if not path.is_file():  # torch first asks for a rank-local file, then for the global one
                raise FileNotFoundError(f"{what}: no {name}")
            metadata = restricted_unpickle(path, allowed=_dcp_metadata_global, what=f"{what}: {name}")
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                confined(root, getattr(info, "relative_path", None), what=f"{what}: {name}")
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    state: dict[str, Any] = {}
    reader = SafeReader(root)
    reader.read_metadata()  # the refusals above, raised as they are (torch would wrap them)
    try:
        _load_state_dict(state, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - torch wraps reader errors in CheckpointException
        cause = getattr(err, "failures", None) or err
        raise ValueError(f"cannot read {what}: not a valid distributed checkpoint or truncated ({cause})") from None
    return state
