"""Issue 14, "never silently wrong", through a real Trainer.

* ``StochasticWeightAveraging`` writes averaged weights (taken partly before units were dropped) into the model at the
  end of fit and before its BatchNorm-update epoch: the callback re-applies the mask after both, so the dropped units
  are exactly zero after fit, BatchNorm statistics are those of the masked model, and ``shrink`` equals the model.
* ``trainer.validate(ckpt_path=...)`` with a checkpoint written before a ``shrink_on_freeze`` shrink says so.
* a non-finite distillation KL stops the run before the optimizer update and before any checkpoint is written.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from torch import nn

from lightning_pat import CoupledPruningCallback, shrink
from tests.common.lit_models import MLPModule, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration


class BNModule(MLPModule):
    """x -> fc1 -> relu -> fc2 -> bn -> relu -> fc3: the pruned hidden axis feeds a BatchNorm through fc2."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd_plain", lr=0.05, n_batches=8)
        torch.manual_seed(1)
        self.fc2 = nn.Linear(32, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.bn(self.fc2(torch.relu(self.fc1(x))))))


def _dropped_are_zero(module: MLPModule, dropped: list[int]) -> bool:
    return (
        bool((module.fc1.weight[dropped] == 0).all())
        and bool((module.fc1.bias[dropped] == 0).all())
        and bool((module.fc2.weight[:, dropped] == 0).all())
    )


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_swa_average_keeps_dropped_units_at_exact_zero_and_shrink_equals_the_model(mode):
    module = MLPModule(optimizer="sgd_plain", n_batches=8)
    # 8 steps per epoch; SWA averages the weights at the start of epochs 1 and 2 (steps 8, 16), the mask freezes at
    # step 12: the first snapshot has units that are dropped later, so the average is non-zero there
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, ramp_steps=12, mode=mode)
    swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)
    trainer = quiet_trainer(max_steps=-1, max_epochs=3, callbacks=[cb, swa])
    trainer.fit(module)
    dropped = cb.dropped["hidden"]
    assert len(dropped) == 16
    assert _dropped_are_zero(module, dropped)
    x = module.x[:16]
    with torch.no_grad():
        masked = module(x)
    small = shrink(copy.deepcopy(module), cb)
    assert small.fc1.out_features == 16
    with torch.no_grad():
        torch.testing.assert_close(small(x), masked, rtol=0, atol=1e-6)


class _BeforeBatchNormEpoch(pl.Callback):
    """A copy of the module as its first forward of SWA's BatchNorm-update epoch sees it."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.seen = epoch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == 0:
            self.seen = copy.deepcopy(pl_module)


def test_swa_batchnorm_update_runs_on_the_masked_model():
    module = BNModule()
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, ramp_steps=12)
    swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)
    probe = _BeforeBatchNormEpoch(epoch=3)  # epochs 0-2 train, SWA adds epoch 3 for its BatchNorm update
    trainer = quiet_trainer(max_steps=-1, max_epochs=3, callbacks=[swa, cb, probe])  # probe: after cb
    trainer.fit(module)
    dropped = cb.dropped["hidden"]
    assert _dropped_are_zero(module, dropped)
    assert probe.seen is not None
    assert _dropped_are_zero(probe.seen, dropped)  # the statistics were taken on the masked model
    # independent reference: SWA's BatchNorm update (reset, cumulative average, one pass) on those weights
    ref = probe.seen.train()
    ref.bn.reset_running_stats()
    ref.bn.momentum = None
    with torch.no_grad():
        for i in range(0, module.x.shape[0], 4):
            ref(module.x[i : i + 4])
    torch.testing.assert_close(module.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module.bn.running_var, ref.bn.running_var, rtol=1e-5, atol=1e-6)


def test_swa_with_shrink_on_freeze_is_refused_at_setup():
    module = MLPModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, ramp_steps=2, shrink_on_freeze=True)
    trainer = quiet_trainer(max_steps=-1, max_epochs=2, callbacks=[cb, StochasticWeightAveraging(swa_lrs=0.02)])
    with pytest.raises(MisconfigurationException, match=r"shrink_on_freeze=True\) cannot run with Stochastic"):
        trainer.fit(module)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


class ValModule(MLPModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def val_dataloader(self):
        return self.train_dataloader()


def test_validate_with_a_checkpoint_from_before_the_shrink_says_so(tmp_path):
    module = ValModule()
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, ramp_steps=4, shrink_on_freeze=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(max_steps=8, callbacks=[cb, ckpt], checkpointing=True, limit_val_batches=2)
    trainer.fit(module)
    assert module.fc1.out_features == 16  # shrunk at step 4
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(MisconfigurationException, match=r"the checkpoint predates the shrink.*'fc1.weight' of shape"):
        trainer.validate(module, ckpt_path=str(tmp_path / "step=2.ckpt"), verbose=False)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    # a checkpoint written after the shrink validates on the shrunk module; the old one on a fresh full-size module
    after = trainer.validate(module, ckpt_path=str(tmp_path / "step=6.ckpt"), verbose=False)
    fresh = trainer.validate(ValModule(), ckpt_path=str(tmp_path / "step=2.ckpt"), verbose=False)
    assert after[0]["val_loss"] >= 0
    assert fresh[0]["val_loss"] >= 0


def test_a_non_finite_distillation_kl_stops_before_the_update_and_before_any_checkpoint(tmp_path):
    """Issue 23 (A6): a temperature that overflows the softmax (finite, so accepted) makes the KL NaN at the first
    distilled step; the run stops there with its own message, before the optimizer applies it, and no checkpoint
    ever holds a non-finite weight."""
    module = MLPModule(optimizer="sgd_plain", n_batches=8)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=2, distill_alpha=0.5,
                                distill_temperature=1e-300)  # fmt: skip
    every = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = quiet_trainer(max_steps=4, callbacks=[cb, every], checkpointing=True)
    seen = {}

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["before"] = copy.deepcopy(pl_module.state_dict())

    trainer.callbacks.append(Snapshot())
    with pytest.raises(MisconfigurationException, match=r"the distillation KL is not finite \(nan\) at step 3") as err:
        trainer.fit(module)
    assert "distill_temperature=1e-300" in str(err.value)
    assert trainer.global_step == 2  # the step that computed it was not applied
    for k, v in module.state_dict().items():
        assert torch.equal(v, seen["before"][k]), k
    saved = sorted(tmp_path.glob("*.ckpt"))
    assert [p.name for p in saved] == ["step=1.ckpt", "step=2.ckpt"]
    for path in saved:
        weights = torch.load(path, weights_only=True)["state_dict"]
        assert all(bool(torch.isfinite(v).all()) for v in weights.values()), path
