"""DTensor queries and rank-local views of a tensor that may be a DTensor (plain tensors pass through).

Nothing here communicates except :func:`full_tensor` (DTensor's own all-gather over the sharded mesh dims). The
write-backs (:func:`write_back_`, :func:`shard_like`) slice a dense tensor that is identical on every rank, so each
rank takes its own piece without a broadcast.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (parameters included); narrows its type."""
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


def as_dtensor(local: Tensor, like: Tensor) -> Tensor:
    """Wrap a rank-local tensor laid out like DTensor ``like`` (same mesh, placements, global shape) as a DTensor."""
    if not isinstance(like, DTensor):
        raise TypeError(f"as_dtensor: `like` must be a DTensor, got {type(like).__name__}")
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def shard_like(dense: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of a dense tensor (identical on every rank) laid out like ``like``; no communication."""
    if not is_dtensor(like):
        return dense
    return distribute_tensor(dense, like.device_mesh, like.placements, src_data_rank=None).to_local()


def distribute_on(dense: Tensor, mesh: object, placements: tuple[object, ...]) -> Tensor:
    """A dense tensor (identical on every rank) as a DTensor on ``mesh`` with ``placements``; no communication."""
    return distribute_tensor(dense, mesh, placements, src_data_rank=None)  # type: ignore[arg-type]


def distribute_like(dense: Tensor, like: Tensor) -> Tensor:
    """A dense tensor (identical on every rank) as a DTensor on ``like``'s mesh, with its placements.

    The global shape is ``dense``'s own; each rank keeps its piece, no communication. A plain ``like`` gives ``dense``.
    """
    if not is_dtensor(like):
        return dense
    return distribute_tensor(dense, like.device_mesh, like.placements, src_data_rank=None)


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


def is_device_mesh(obj: object) -> bool:
    """Whether ``obj`` is a ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)
