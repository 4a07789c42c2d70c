"""What the callback keeps between steps and across checkpoints (no Lightning here).

* :class:`StepTracker`: whether a real optimizer step happened (a step post-hook), and its learning rate.
* :class:`Progress`: where the schedule stands (real steps) and the group-lasso step sizes (sums of learning rates).
* Latent copies in a checkpoint, by format: ``tensors`` (plain parameters, identical on every rank: DDP, one
  device), ``per_rank`` (FSDP1 flat shards: every rank's pieces, gathered), ``full`` (DTensors in a full
  checkpoint: gathered into full tensors, each rank slices its piece back on restore) and ``dcp`` (DTensors in a
  distributed checkpoint: written by the checkpoint itself next to the model's shards, each rank its own piece,
  and read back with the torch distributed checkpoint reader; resharding to another layout works).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pat import distributed as D

DCP_PREFIX = "_lightning_pat.latent."  # model-state keys that carry sharded latents in a distributed checkpoint


class StepTracker:
    """Whether a real optimizer step happened since the last batch end (not on accumulation or AMP-skipped steps)."""

    def __init__(self) -> None:
        self.stepped = False
        self.last_lr: float | None = None
        self._hooks: list[Any] = []

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.detach()
        self._hooks = [opt.register_step_post_hook(self._on_step) for opt in optimizers]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.stepped = True
        self.last_lr = next((float(g["lr"]) for g in optimizer.param_groups if "lr" in g), self.last_lr)

    def consume(self) -> bool:
        stepped, self.stepped = self.stepped, False
        return stepped


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
        """From a checkpoint or carried state; a missing key starts fresh.

        A state written before ``gamma_prox`` existed starts the next direct-mode prox step from the saved ``gamma``.
        """
        gamma = float(state.get("gamma", 0.0))
        return cls(int(state.get("step", 0)), gamma, float(state.get("gamma_prox", gamma)))

    def state_dict(self) -> dict[str, Any]:
        """``step``, ``gamma`` and ``gamma_prox`` as plain numbers."""
        return {"step": self.step, "gamma": self.gamma, "gamma_prox": self.gamma_prox}

    def count_from(self, state: Mapping[str, Any]) -> None:
        """Take ``step`` and ``gamma`` from ``state`` where present (a shrunk model only counts steps)."""
        self.step, self.gamma = int(state.get("step", self.step)), float(state.get("gamma", self.gamma))

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


def latent_format(params: Iterable[Tensor], *, fsdp1: bool, sharded_ckpt: bool) -> str:
    """How latents of these parameters are written to a checkpoint (see the module docstring)."""
    if fsdp1:
        return "per_rank"
    if any(D.is_dtensor(p) for p in params):
        return "dcp" if sharded_ckpt else "full"
    return "tensors"


def latent_state(local: Mapping[str, Tensor], params: Mapping[str, Tensor], *, fmt: str) -> dict[str, Any]:
    """The checkpoint entry for rank-local latents ``local`` (a collective for ``per_rank`` and ``full``)."""
    if fmt == "tensors":
        return {"format": fmt, "tensors": {n: t.detach().cpu().clone() for n, t in local.items()}}
    if fmt == "per_rank":
        mine = {n: t.detach().cpu().clone() for n, t in local.items()}
        return {"format": fmt, "tensors": D.gather_objects(mine, group=D.world_group())}
    if fmt == "full":
        return {
            "format": fmt,
            "tensors": {n: D.full_tensor(D.as_dtensor(t, params[n])).cpu() for n, t in local.items()},
        }
    return {"format": fmt, "names": sorted(local)}


def sharded_latents(local: Mapping[str, Tensor], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Model-state entries (DTensors laid out like their parameters) for a ``dcp`` checkpoint."""
    return {DCP_PREFIX + n: D.as_dtensor(t, params[n]) for n, t in local.items()}


def saved_latents(latent: Mapping[str, Any], params: Mapping[str, Tensor], *, ckpt_path: Any) -> dict[str, Tensor]:
    """Rank-local latents from a checkpoint entry (reads the distributed checkpoint at ``ckpt_path`` for ``dcp``)."""
    fmt = latent["format"]
    if fmt == "tensors":
        return dict(latent["tensors"])
    if fmt == "per_rank":
        return dict(latent["tensors"][D.world_rank()])
    if fmt == "full":
        return {n: D.shard_like(t, params[n]) for n, t in latent["tensors"].items()}
    like = {n: params[n] for n in latent["names"]}
    holders = {DCP_PREFIX + n: D.as_dtensor(torch.empty_like(D.local_tensor(p)), p) for n, p in like.items()}
    D.load_sharded_({"state_dict": holders}, ckpt_path)
    return {n: D.local_tensor(holders[DCP_PREFIX + n]) for n in like}
