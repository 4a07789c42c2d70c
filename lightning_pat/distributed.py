"""The only module that calls ``torch.distributed`` collectives; DTensor and mesh helpers.

Every function that communicates takes an explicit group or mesh and returns a result identical on every
participating rank. Float partials are gathered and summed in fixed rank order, never all-reduced; integer counts
may be all-reduced (exact).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
except ImportError:  # pragma: no cover - old torch
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (parameters included)."""
    return DTensor is not None and isinstance(tensor, DTensor)


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
