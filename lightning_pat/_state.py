"""What the callback keeps between steps and across checkpoints (no Lightning here).

* :class:`StepTracker`: whether a real optimizer step happened (a step post-hook), and its learning rate.
* Latent copies in a checkpoint, by format: ``tensors`` (plain parameters, identical on every rank: DDP, one
  device), ``per_rank`` (FSDP1 flat shards: every rank's pieces, gathered), ``full`` (DTensors in a full
  checkpoint: gathered into full tensors, each rank slices its piece back on restore) and ``dcp`` (DTensors in a
  distributed checkpoint: written by the checkpoint itself next to the model's shards, each rank its own piece,
  and read back with the torch distributed checkpoint reader; resharding to another layout works).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
