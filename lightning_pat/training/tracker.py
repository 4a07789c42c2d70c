"""The real-step tracker: whether an optimizer really stepped since the last batch end (no Lightning here).

Gradient accumulation and a step the AMP scaler skipped do not count; the controller advances the schedule only on
a real step and sizes the group-lasso prox step from the learning rate that step used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StepTracker:
    """Whether a real optimizer step happened since the last batch end (not on accumulation or AMP-skipped steps)."""

    def __init__(self) -> None:
        self.stepped = False
        self.last_lr: float | None = None
        self._hooks: list[Any] = []

    def attach(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Watch ``optimizers`` through step post-hooks (replacing earlier ones)."""
        self.detach()
        self._hooks = [opt.register_step_post_hook(self._on_step) for opt in optimizers]

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.stepped = True
        self.last_lr = next((float(g["lr"]) for g in optimizer.param_groups if "lr" in g), self.last_lr)

    def consume(self) -> bool:
        """Whether a step happened since the last call."""
        stepped, self.stepped = self.stepped, False
        return stepped
