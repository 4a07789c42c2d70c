"""Record every ``torch.distributed`` collective (calling through to the real one) and every materialization.

``Recorder`` swaps the collective functions of ``torch.distributed`` for thin wrappers that log the call (name,
group ranks, dtype, element count) and then call the original, so the communication really happens. It also
wraps ``DTensor.full_tensor``, ``DTensor.redistribute`` and ``distribute_tensor`` (in ``torch.distributed.tensor``
and in ``lightning_pat.parallel.comm.dtensor``), and runs a ``CommDebugMode`` that sees the collectives DTensor issues
internally through functional collectives, which no Python-level wrapper of ``torch.distributed`` would catch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.tensor as dtensor_mod
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce_coalesced",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@dataclass
class Call:
    name: str
    group: tuple[int, ...]
    dtype: str | None
    numel: int


def _group_of(args: tuple, kwargs: dict) -> tuple[int, ...]:
    group = kwargs.get("group")
    if group is None:
        for a in args:
            if isinstance(a, dist.ProcessGroup):
                group = a
                break
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _tensor_arg(name: str, args: tuple) -> Any:
    if name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return args[1] if len(args) > 1 else None
    return args[0] if args else None


class Recorder:
    """Context manager; ``calls`` lists collectives, ``materialized`` lists full_tensor/redistribute/distribute."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.materialized: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0
        self.comm_mode = CommDebugMode()

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                t = _tensor_arg(name, args)
                is_t = hasattr(t, "numel") and hasattr(t, "dtype")
                self.calls.append(
                    Call(name, _group_of(args, kwargs), str(t.dtype) if is_t else None, t.numel() if is_t else 0)
                )
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    def _wrap_mat(self, what: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.materialized.append(what)
            return fn(*args, **kwargs)

        return wrapper

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def __enter__(self) -> Recorder:
        from lightning_pat.parallel.comm import dtensor

        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._wrap(name, getattr(dist, name)))
        self._patch(DTensor, "full_tensor", self._wrap_mat("full_tensor", DTensor.full_tensor))
        self._patch(DTensor, "redistribute", self._wrap_mat("redistribute", DTensor.redistribute))
        distribute = dtensor_mod.distribute_tensor
        self._patch(dtensor_mod, "distribute_tensor", self._wrap_mat("distribute_tensor", distribute))
        self._patch(dtensor, "distribute_tensor", self._wrap_mat("distribute_tensor", dtensor.distribute_tensor))
        self.comm_mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.comm_mode.__exit__(*exc)
        for owner, attr, old in reversed(self._saved):
            setattr(owner, attr, old)
        self._saved.clear()

    def summary(self) -> dict[str, Any]:
        return {
            "calls": [(c.name, c.group, c.dtype, c.numel) for c in self.calls],
            "materialized": list(self.materialized),
            "comm_counts": {str(k): v for k, v in self.comm_mode.get_comm_counts().items()},
        }
