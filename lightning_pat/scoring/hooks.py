"""Forward hooks that count each training batch once (pure torch): the base of statistics collected while training.

:class:`TrainingForwardHooks` registers one hook per named module (:meth:`~TrainingForwardHooks.attach`,
:meth:`~TrainingForwardHooks.detach`) and tells a hook whether the call is a training forward to count
(:meth:`~TrainingForwardHooks.training_forward`): grad enabled, and ``module.training`` or
:attr:`~TrainingForwardHooks.in_batch` (between :meth:`~TrainingForwardHooks.begin_batch` and
:meth:`~TrainingForwardHooks.end_batch`: the batch window of a
:class:`~lightning_pat.scoring.collector.Collector`). Under activation checkpointing each batch still counts once:
a forward recomputed during the backward is skipped when its first pass was counted (non-reentrant checkpoint) and
counted when that pass ran under ``no_grad`` (reentrant checkpoint).
Used by :mod:`lightning_pat.scoring.activation` (reader inputs), :mod:`lightning_pat.scoring.layers` (layer
cosines) and :mod:`lightning_pat.pruning.repair` (the readers' Gram matrices); :func:`run_batches` runs their
calibration batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def in_backward() -> bool:
    """Whether autograd is running a backward pass right now (a checkpointed forward being recomputed).

    ``torch.utils.checkpoint`` (reentrant or not) recomputes a forward inside the backward's graph task; a training
    forward runs outside any. Tested against both checkpoint variants on the pinned torch.
    """
    return torch._C._current_graph_task_id() != -1  # noqa: SLF001 - the check torch.utils.checkpoint itself relies on


class TrainingForwardHooks:
    """One hook per module of :meth:`hooked_modules`, registered by :meth:`register_hook` (subclasses define both)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._unrecomputed: dict[str, int] = {}  # counted forwards that activation checkpointing may recompute
        self._forced = False  # inside collecting(): every forward counts
        #: A training batch is open (set by the caller, e.g. the pruning controller): a forward counts with grad
        #: enabled even if the module is in eval mode (Lightning keeps the eval mode of submodules during fit, which
        #: is how a model from ``from_pretrained`` arrives).
        self.in_batch = False

    def hooked_modules(self) -> Mapping[str, nn.Module]:
        """Name -> module to hook."""
        raise NotImplementedError

    def register_hook(self, name: str, module: nn.Module) -> Any:
        """Register the hook of ``module`` and return its handle."""
        raise NotImplementedError

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> None:
        """Register one hook per module (again: a no-op)."""
        if self._handles:
            return
        self._handles = [self.register_hook(name, module) for name, module in self.hooked_modules().items()]

    def detach(self) -> None:
        """Remove the hooks (what they collected is kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin_batch(self) -> None:
        """A training batch opens: its forwards count (see :attr:`in_batch`)."""
        self.in_batch = True

    def end_batch(self, *, stepped: bool) -> None:
        """The training batch is over: forwards count again only in train mode (whether it ``stepped`` is moot)."""
        self.in_batch = False

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Count every forward while inside (also in eval mode or under ``no_grad``): calibration."""
        attached = self.attached
        self.attach()
        self._forced = True
        try:
            yield
        finally:
            self._forced = False
            if not attached:
                self.detach()

    def training_forward(self, name: str, module: nn.Module) -> bool:
        """Whether this call of ``module`` counts: a training forward, or any forward inside :meth:`collecting`.

        A training forward runs with grad enabled, in train mode or while :attr:`in_batch` is set; a forward that
        activation checkpointing recomputes during the backward counts only if its first pass did not.
        """
        if self._forced:
            return True
        if not (module.training or self.in_batch):
            return False
        if in_backward():  # activation checkpointing recomputes this forward during the backward
            if self._unrecomputed.get(name, 0) > 0:  # its first pass was counted (non-reentrant)
                self._unrecomputed[name] -= 1
                return False
            return True  # the first pass ran under no_grad (reentrant checkpoint): count the batch now
        if not torch.is_grad_enabled():
            return False
        self._unrecomputed[name] = self._unrecomputed.get(name, 0) + 1
        return True


def run_batches(model: nn.Module, batches: Iterable[Any], *, forward: Callable[[nn.Module, Any], Any] | None) -> None:
    """Run ``model(batch)`` (or ``forward(model, batch)``) for every batch, without grad (calibration)."""
    with torch.no_grad():
        for batch in batches:
            if forward is not None:
                forward(model, batch)
            else:
                model(batch)
