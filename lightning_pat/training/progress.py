"""Where a run stands in steps: did an optimizer really step (:class:`StepTracker`), how many did (:class:`Progress`).

No Lightning here. Gradient accumulation and a step the AMP scaler skipped do not count: the controller advances the
schedule only on a real step (the tracker's step post-hooks say so) and sizes the group-lasso prox step from the
learning rates those steps used (the progress sums them). The progress is saved with the state
(:mod:`lightning_pat.training.state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Progress:
    """Completed real optimizer steps and the sums of learning rates the group-lasso prox step is sized from.

    Attributes:
        step: Completed real optimizer steps seen by the schedule.
        gamma: Sum of learning rates of the steps since warmup.
        gamma_prox: ``gamma`` at the last fresh selection (a direct-mode prox step sums the lrs from there).
    """

    step: int = 0
    gamma: float = 0.0
    gamma_prox: float = 0.0

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Progress:
        """From a state (missing keys start fresh)."""
        return cls(int(state.get("step", 0)), float(state.get("gamma", 0.0)), float(state.get("gamma_prox", 0.0)))

    def state_dict(self) -> dict[str, Any]:
        """``step``, ``gamma`` and ``gamma_prox`` as plain numbers."""
        return {"step": self.step, "gamma": self.gamma, "gamma_prox": self.gamma_prox}

    def tick(self) -> int:
        """Count one real optimizer step; return the new step."""
        self.step += 1
        return self.step

    def add_lr(self, lr: float | None) -> None:
        """Add a step's learning rate to ``gamma`` (past warmup; an unknown lr adds nothing)."""
        self.gamma += lr or 0.0

    def prox_step(self, *, latent: bool) -> float:
        """The group-lasso step size of a fresh selection now (see the callback's ``reg_lambda``).

        Latent mode shrinks the unshrunk latent, so the step is the sum of learning rates since warmup; direct mode
        shrinks weights that earlier selections already shrank, so the step is the sum of learning rates since the
        previous fresh selection (this step's lr when ``every_n_steps=1``): a proximal gradient step.
        """
        return self.gamma if latent else self.gamma - self.gamma_prox

    def mark_selection(self) -> None:
        """A fresh selection happened: the next direct-mode prox step sums the learning rates from here."""
        self.gamma_prox = self.gamma


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
