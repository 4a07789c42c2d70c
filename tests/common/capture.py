"""A test callback that records, at every real optimizer step, the weights the projection starts from.

An optimizer step post-hook (registered at train start, so after the pruning callback's own) copies the clustered
weights right after the update: in latent mode these are the updated latents, in direct mode the updated weights;
either way what the step's projection acts on. ``on_train_batch_end`` (after the pruning callback) files them under
the callback's step with the step's learning rate, the projected weights and the mask.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch

NAMES = ("fc1.weight", "fc1.bias", "fc2.weight")


class Capture(pl.Callback):
    def __init__(self, cb) -> None:
        self.cb = cb
        self.pre: dict[int, dict[str, torch.Tensor]] = {}
        self.post: dict[int, dict[str, torch.Tensor]] = {}
        self.lrs: dict[int, float] = {}
        self.dropped: dict[int, list[int]] = {}
        self._pending = None
        self._handle = None

    def _weights(self, module) -> dict[str, torch.Tensor]:
        params = dict(module.named_parameters())
        return {n: params[n].detach().double().clone() for n in NAMES}

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self._handle = opt.register_step_post_hook(
            lambda o, *_: setattr(self, "_pending", (self._weights(pl_module), o.param_groups[0]["lr"]))
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = self.cb.step
        self.pre[step], self.lrs[step] = self._pending
        self.post[step] = self._weights(pl_module)
        self.dropped[step] = copy.deepcopy(self.cb.dropped["hidden"])

    def on_train_end(self, trainer, pl_module):
        self._handle.remove()
