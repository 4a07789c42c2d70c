"""The world, rank zero and agreement: what every rank must know or decide alike, and who speaks for them.

The world queries work without a process group (one rank, rank 0). Agreement collectives compare digests or
flags across ranks so that every rank takes the same branch; :func:`together` turns a ``ValueError`` on one rank
into the same error on every rank. Objects travel with :func:`gather_objects` (pickles between the ranks of one
run) or :func:`broadcast_json` (plain JSON, nothing executed on receipt).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_pat.core.pruning_warning import PruningWarning

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def world_group() -> ProcessGroup | None:
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


def any_rank(flags: Sequence[bool], *, group: ProcessGroup | None) -> list[bool]:
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


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_rank_agreement(digest: Mapping[str, Any], error: str | None, *, who: str = "lightning_pat") -> None:
    """Compare ``digest`` (e.g. clusters, routes, options), or this rank's error, across all ranks (one collective).

    Args:
        digest: This rank's facts that every rank must share (JSON-able values).
        error: This rank's error message, or ``None``.
        who: The caller the disagreement message names (e.g. ``"CoupledPruningCallback"``).

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
            f"{who}: ranks disagree on {diff} (ranks {ranks} differ from rank 0). Every rank "
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


def check_selection_agreement(dropped: Mapping[str, list[int]], *, step: int, who: str = "lightning_pat") -> None:
    """Debug check: compare a hash of the selection across all ranks (one small collective).

    Args:
        dropped: This rank's dropped units per cluster.
        step: The step the selection was made at (for the message).
        who: The caller and option the message names (e.g. ``"CoupledPruningCallback (debug_check_selection)"``).

    Raises:
        RuntimeError: On every rank, if some rank selected different units than rank 0.
    """
    everyone = gather_objects(_digest(dropped), group=world_group())
    if len(set(everyone)) > 1:
        ranks = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(
            f"{who}: at step {step} ranks {ranks} selected different units "
            "than rank 0; the selection is not identical across the mesh."
        )


def gather_objects(obj: Any, *, group: ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj`` in group-rank order (``[obj]`` without a process group)."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _collective_device(group: ProcessGroup) -> torch.device:
    """Where a group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_json(obj: Any, *, src: int = 0, group: ProcessGroup | None) -> Any:
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
