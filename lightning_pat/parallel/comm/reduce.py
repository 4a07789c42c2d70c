"""Ordered reductions: float partials gathered and summed in a fixed rank order, integer counts all-reduced.

Every function that communicates takes an explicit group (or mesh) and returns a result identical on every rank of
it. Float partials are never all-reduced: they are all-gathered (:func:`all_gather_packed`) and added one row at a
time in mesh-coordinate order (:func:`ordered_sum`), so every replica group runs the same additions on the same data.
Integer counts may be all-reduced (exact). The mesh and group helpers here say which ranks a reduction spans and in
which order their rows are added.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    # re-exported for the executors, which hold groups but do not import torch.distributed
    from torch.distributed import ProcessGroup as ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


def all_reduce_sum_(counts: Tensor, *, group: ProcessGroup) -> Tensor:
    """Sum an integer tensor over ``group`` in place (exact) and return it.

    Raises:
        TypeError: If ``counts`` is floating point (float sums are order dependent; gather instead).
    """
    if counts.dtype.is_floating_point:
        raise TypeError("all_reduce_sum_ takes integer tensors only; gather float partials and sum in rank order.")
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return counts


def reduce_counts(counts: Tensor, *, group: ProcessGroup) -> Tensor:
    """Sum int64 counts over ``group`` (one collective, exact) and return them."""
    if dist.get_world_size(group) == 1:
        return counts
    return all_reduce_sum_(counts, group=group)


def mesh_ranks_along(mesh: DeviceMesh, axes: Sequence[int]) -> list[int]:
    """Global ranks of this rank's sub-grid spanning mesh ``axes``, in row-major coordinate order over ``axes``.

    Raises:
        ValueError: If this rank is not in ``mesh``.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("This rank is not part of the mesh; it must not take part in the mesh's collectives.")
    index = tuple(slice(None) if a in axes else coord[a] for a in range(mesh.ndim))
    return mesh.mesh[index].flatten().tolist()


def mesh_is_increasing(mesh: DeviceMesh) -> bool:
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


def axes_group(mesh: DeviceMesh, axes: Sequence[int], *, cache: dict[tuple[int, ...], ProcessGroup]) -> ProcessGroup:
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
        world = dist.group.WORLD
        assert world is not None  # a process group is initialised: get_world_size() above read it
        return world
    if key not in cache:
        cache[key] = dist.new_group(ranks=list(key), use_local_synchronization=True)
    return cache[key]


def mesh_group(mesh: DeviceMesh, *, cache: dict[tuple[int, ...], ProcessGroup]) -> ProcessGroup:
    """The process group over every rank of ``mesh`` (see :func:`axes_group`)."""
    return axes_group(mesh, tuple(range(mesh.ndim)), cache=cache)


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return dist.get_world_size(group)


def group_key(group: ProcessGroup) -> tuple[int, ...]:
    """The sorted global ranks of ``group``: groups with equal keys connect the same ranks."""
    return tuple(sorted(dist.get_process_group_ranks(group)))


def gather_order(mesh: DeviceMesh, axes: Sequence[int], group: ProcessGroup) -> list[int]:
    """Row indices of an :func:`all_gather_packed` result over ``group``, in mesh-coordinate order over ``axes``.

    Summing the gathered rows in this order makes every replica group run the same additions on the same data,
    whatever rank numbering its process group uses.
    """
    group_ranks = dist.get_process_group_ranks(group)
    return [group_ranks.index(r) for r in mesh_ranks_along(mesh, tuple(sorted(axes)))]


def all_gather_packed(buffer_L: Tensor, *, group: ProcessGroup) -> Tensor:
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


def gather_sum(buffer_L: Tensor, *, group: ProcessGroup, order: Sequence[int]) -> Tensor:
    """Exact sum of every rank's ``buffer_L`` over ``group``: one all_gather, then :func:`ordered_sum` locally.

    Each rank receives ``(n - 1) * L`` elements. Every rank of every replica group runs the same additions in the
    same (mesh-coordinate) order on the same data, so the result is bitwise identical everywhere.
    """
    return ordered_sum(all_gather_packed(buffer_L, group=group), order)


def scatter_gather_sum(buffer_L: Tensor, *, group: ProcessGroup, order: Sequence[int]) -> Tensor:
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


def sum_over_ranks(buffer_L: Tensor, *, group: ProcessGroup | None) -> Tensor:
    """Sum of every rank's float ``buffer_L`` over ``group``, bitwise identical on every rank (one collective).

    Used for the activation statistics of ``score="activation"`` under DDP, where every rank sees other batches:
    one all_gather, then the rows are added in group-rank order (a float all_reduce would not promise the same
    bits on every rank). Without a process group, or in a group of one rank, ``buffer_L`` itself.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return buffer_L
    return gather_sum(buffer_L, group=group, order=list(range(dist.get_world_size(group))))


def sum_packed_over_ranks(buffers: Sequence[Tensor], *, group: ProcessGroup | None) -> list[Tensor]:
    """:func:`sum_over_ranks` of several 1-D float buffers in one collective: packed into one vector, summed, cut again.

    Every element sees the additions of its own buffer's sum, so each result has the bits of :func:`sum_over_ranks`
    of that buffer alone. The buffers are packed on the first one's device that is not the CPU (else the CPU); none
    issues no collective.

    Example::

        >>> sum_packed_over_ranks([torch.ones(2), torch.zeros(1)], group=None)
        [tensor([1., 1.]), tensor([0.])]
    """
    if not buffers:
        return []
    device = next((b.device for b in buffers if b.device.type != "cpu"), buffers[0].device)
    packed = sum_over_ranks(torch.cat([b.to(device) for b in buffers]), group=group)
    return list(torch.split(packed, [b.numel() for b in buffers]))
