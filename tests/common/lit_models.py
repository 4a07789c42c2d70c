"""Tiny LightningModules for callback tests."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import Cluster, PruningWarning

HIDDEN = 32


def mlp_cluster() -> list[Cluster]:
    return [Cluster(name="hidden", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"])]


class MLPModule(pl.LightningModule):
    """x -> fc1 -> relu -> fc2; the hidden axis of width HIDDEN is one cluster."""

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        n_batches: int = 16,
        seed: int = 0,
        skip_steps: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 4)
        self.optimizer_name = optimizer
        self.lr = lr
        self.n_batches = n_batches
        self.skip_steps = set(skip_steps)  # batch indices whose optimizer step is skipped (like an AMP inf skip)
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n_batches * 4, 8, generator=g)
        self.y = torch.randn(n_batches * 4, 4, generator=g)
        self.forward_log: list[torch.Tensor] = []  # fc1 weight rows that are all zero, seen in each training forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        if self.training:
            w = self.fc1.weight.detach()
            self.forward_log.append(((w == 0).all(dim=1) & (self.fc1.bias.detach() == 0)).clone())
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx in self.skip_steps:
            optimizer_closure()  # forward/backward ran, but the step is skipped (as GradScaler does on inf)
            return
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if self.optimizer_name == "sgd_plain":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4, shuffle=False)


class StepDataModule(MLPModule):
    """MLPModule whose batch is a function of ``global_step`` only (the loader's position does not matter), so a
    resumed run sees the same data as an uninterrupted one whatever Lightning replays inside an epoch."""

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(10_000 + self.global_step)
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 4, generator=g)
        return super().training_step((x, y), batch_idx)


#: The callback's warning for a fit that stops inside the ramp (our warnings are errors in the tests).
SHORT_FIT = "before the final ramp step"


class ZooStep(pl.LightningModule):
    """A tiny causal LM of ``tests/common/lm_zoo.py`` trained on a batch that is a function of the step (2 x 9 token
    ids: the next-token loss of the first 8), SGD at 0.05, 4 batches an epoch; its forward gives the logits, its
    ``example_input_array`` (``example``, default ``lm_zoo.token_ids()``) is what ``clusters="auto"`` traces."""

    def __init__(self, model_type: str, *, example: torch.Tensor | None = None) -> None:
        super().__init__()
        from tests.common import lm_zoo

        self.model = lm_zoo.build(model_type)
        self.example_input_array = lm_zoo.token_ids() if example is None else example
        self._token_ids = lm_zoo.token_ids

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        x = self._token_ids(batch=2, seq=9, seed=100 + self.global_step)
        return nn.functional.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)


def ends_mid_ramp() -> pytest.WarningsChecker:
    """``pytest.warns`` for a fit that stops inside the ramp on purpose: the callback must say so."""
    return pytest.warns(PruningWarning, match=SHORT_FIT)


@contextlib.contextmanager
def allow_short_fit() -> Iterator[None]:
    """Only the short-fit warning allowed, where a parametrized case may or may not get that far."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*{SHORT_FIT}", category=PruningWarning)
        yield


def quiet_trainer(*, max_steps: int, callbacks: list, checkpointing: bool = False, **kwargs) -> pl.Trainer:
    """A CPU Trainer without logger, progress bar or model summary (and without checkpointing unless asked)."""
    return pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **kwargs,
    )
