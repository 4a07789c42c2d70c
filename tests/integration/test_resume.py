"""Resume, second fit and changed options: a stopped-and-resumed run equals an uninterrupted one, bitwise.

The module's training data is a function of ``global_step`` only, so that the batches Lightning replays or skips
when a stop falls inside an epoch cannot make a difference: only the callback's state can.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import Cluster, CoupledPruningCallback, PruningWarning
from tests.common.lit_models import StepDataModule, ends_mid_ramp, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration

SCHEDULE = {"warmup_steps": 2, "ramp_steps": 6, "every_n_steps": 2}
TOTAL = 12  # final ramp step is 8; healing after it
STOPS = {"warmup": 2, "ramp-due": 4, "ramp-off-cadence": 5, "final": 8, "healing": 10}


class Recorder(pl.Callback):
    """After every batch (runs after the pruning callback): step, mask and logged sparsity."""

    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb = cb
        self.rows: dict[int, tuple] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pruning/")}
        self.rows[self.cb.step] = (copy.deepcopy(self.cb.dropped), logged)


def trainer_for(cb, *, max_steps, tmp_path=None, every=0, extra=()):
    callbacks = [cb, Recorder(cb), *extra]
    if every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=every, save_top_k=-1)
        )
    return quiet_trainer(max_steps=max_steps, callbacks=callbacks, checkpointing=bool(every), log_every_n_steps=1)


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def make_cb(mode, method, **overrides):
    kwargs = {**SCHEDULE, "mode": mode, "method": method, "reg_lambda": 0.5 if method == "group_lasso" else 0.0}
    return CoupledPruningCallback(mlp_cluster(), overrides.pop("target_sparsity", 0.5), **{**kwargs, **overrides})


@pytest.mark.parametrize(
    ("mode", "method", "optimizer", "score"),
    [
        ("latent", "hard", "sgd", "rms"),
        ("latent", "hard", "adamw", "rms"),
        ("direct", "hard", "sgd", "rms"),
        ("latent", "group_lasso", "sgd", "rms"),
        ("direct", "group_lasso", "sgd", "rms"),
        ("latent", "hard", "adamw", "activation"),
        ("direct", "hard", "sgd", "activation"),
        ("latent", "group_lasso", "sgd", "activation"),
    ],
)
def test_stop_anywhere_and_resume_equals_uninterrupted(tmp_path, mode, method, optimizer, score):
    module = StepDataModule(optimizer=optimizer, lr=0.2)
    cb = make_cb(mode, method, score=score)
    trainer = trainer_for(cb, max_steps=TOTAL, tmp_path=tmp_path, every=1)
    trainer.fit(module)
    want_rows = trainer.callbacks[1].rows
    want = weights(module)
    if score == "activation":  # the statistics really are in the state, and they matter for the selection
        state = torch.load(tmp_path / "step=5.ckpt", weights_only=False)["callbacks"][cb.state_key]
        assert state["activation"][0]["count"] == {"fc2": 5}
    if mode == "latent" and method == "hard" and score == "rms":
        # the fixture really exercises latent mode: some unit dropped during the ramp comes back later
        masks = [set(want_rows[s][0]["hidden"]) for s in range(3, 9)]
        assert any(a - b for a, b in zip(masks, masks[1:], strict=False)), masks

    for where, k in STOPS.items():
        resumed = StepDataModule(optimizer=optimizer, lr=0.2, seed=99)  # other init: everything comes from the ckpt
        cb2 = make_cb(mode, method, score=score)
        trainer2 = trainer_for(cb2, max_steps=TOTAL)
        trainer2.fit(resumed, ckpt_path=str(tmp_path / f"step={k}.ckpt"))
        rows = trainer2.callbacks[1].rows
        assert sorted(rows) == list(range(k + 1, TOTAL + 1)), where
        for step, row in rows.items():
            assert row == want_rows[step], (where, step)  # masks and logged sparsity, exactly
        got = weights(resumed)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (where, name)


def test_second_fit_with_fresh_trainer_starts_a_new_schedule():
    module = StepDataModule()
    cb = make_cb("latent", "hard")
    trainer_for(cb, max_steps=TOTAL).fit(module)
    first = cb.dropped["hidden"]
    assert len(first) == 16

    trainer2 = trainer_for(cb, max_steps=TOTAL)
    trainer2.fit(module)
    rows = trainer2.callbacks[1].rows
    assert sorted(rows) == list(range(1, TOTAL + 1))  # the schedule restarted at step 1
    assert rows[2][0] == {"hidden": []}  # warmup of the new schedule: dense
    assert len(rows[4][0]["hidden"]) == math.ceil(round(0.5 * cb.schedule.fraction(4) * 32, 9))  # ramp again
    for step in range(TOTAL - 3, TOTAL + 1):  # healing with the final mask, never an empty one
        assert len(rows[step][0]["hidden"]) == 16, step
    dropped = cb.dropped["hidden"]
    assert torch.all(module.fc1.weight[dropped] == 0)


def test_second_fit_of_the_same_trainer_continues_exactly():
    module = StepDataModule(optimizer="sgd_plain")
    reference = copy.deepcopy(module)
    trainer_for(make_cb("latent", "hard"), max_steps=TOTAL).fit(reference)

    cb = make_cb("latent", "hard")
    trainer = trainer_for(cb, max_steps=5)  # stops inside the ramp
    with ends_mid_ramp():
        trainer.fit(module)
    assert cb.step == 5
    trainer.fit_loop.epoch_loop.max_steps = TOTAL
    trainer.fit(module)  # a "continue training" cell: same Trainer, same callback
    assert cb.step == TOTAL
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(module)[name], tensor), name


def _checkpoint(tmp_path: Path, cb: CoupledPruningCallback, k: int) -> str:
    trainer = trainer_for(cb, max_steps=k, tmp_path=tmp_path, every=k)
    with ends_mid_ramp() if k < cb.schedule.final_step else contextlib.nullcontext():
        trainer.fit(StepDataModule())
    return str(tmp_path / f"step={k}.ckpt")


def test_changed_target_on_resume_continues_from_the_saved_step_with_a_warning(tmp_path):
    path = _checkpoint(tmp_path, make_cb("latent", "hard"), 4)
    cb = make_cb("latent", "hard", target_sparsity=0.75)
    trainer = trainer_for(cb, max_steps=TOTAL)
    with pytest.warns(UserWarning, match=r"resuming at step 4 with changed options \(target_sparsity: 0.5 -> 0.75\)"):
        trainer.fit(StepDataModule(), ckpt_path=path)
    rows = trainer.callbacks[1].rows
    assert min(rows) == 5  # continued, not restarted at step 1
    assert len(cb.dropped["hidden"]) == 24  # the new target from the saved step on


def test_changed_options_that_cannot_take_effect_raise(tmp_path):
    ramp_ckpt = _checkpoint(tmp_path / "a", make_cb("latent", "hard"), 6)
    before = StepDataModule()
    module = copy.deepcopy(before)
    with pytest.raises(MisconfigurationException, match=r"step 6 inside the ramp.*final ramp step at 5"):
        trainer_for(make_cb("latent", "hard", ramp_steps=3), max_steps=TOTAL).fit(module, ckpt_path=ramp_ckpt)
    heal_ckpt = _checkpoint(tmp_path / "b", make_cb("latent", "hard"), 10)
    with pytest.raises(MisconfigurationException, match=r"mask is frozen.*target_sparsity"):
        trainer_for(make_cb("latent", "hard", target_sparsity=0.25), max_steps=TOTAL).fit(module, ckpt_path=heal_ckpt)


def test_resume_without_state_for_this_callback_raises(tmp_path):
    path = _checkpoint(tmp_path, make_cb("latent", "hard"), 4)
    other = CoupledPruningCallback(
        [Cluster(name="renamed", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"])], 0.5, **SCHEDULE
    )
    with pytest.raises(MisconfigurationException, match=r"global step 4.*holds no state under this callback's key"):
        trainer_for(other, max_steps=TOTAL).fit(StepDataModule(), ckpt_path=path)


def test_latent_resume_from_a_checkpoint_without_latents_raises(tmp_path):
    """A direct-mode checkpoint inside the ramp holds no latent copies: latent mode cannot continue it exactly (a
    clear error); direct mode resumes from it."""
    path = _checkpoint(tmp_path, make_cb("direct", "hard"), 4)
    state = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "Pruning" in k)
    assert state["latents"] is None
    assert state["options"]["mode"] == "direct"
    with (
        pytest.raises(MisconfigurationException, match=r"step 4, final step 8.*no latent copies.*mode='direct'"),
        pytest.warns(PruningWarning, match=r"changed options \(mode: 'direct' -> 'latent'\)"),
    ):
        trainer_for(make_cb("latent", "hard"), max_steps=TOTAL).fit(StepDataModule(), ckpt_path=path)
    cb = make_cb("direct", "hard")
    trainer_for(cb, max_steps=TOTAL).fit(StepDataModule(), ckpt_path=path)  # direct: fine
    assert len(cb.dropped["hidden"]) == 16


def test_state_key_ignores_editable_options():
    a = make_cb("latent", "hard")
    b = make_cb("direct", "group_lasso", target_sparsity=0.9, warmup_steps=7, ramp_steps=3)
    assert a.state_key == b.state_key
    assert a.state_key != CoupledPruningCallback([Cluster(name="x", writers=["w"])]).state_key


class RawOptimizerModule(StepDataModule):
    """Manual optimization with the raw torch optimizer (``use_pl_optimizer=False``): bypasses Lightning's hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=False)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.manual_backward(loss)
        opt.step()


class TwoOptimizerModule(RawOptimizerModule):
    def training_step(self, batch, batch_idx):
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self(batch[0]), batch[1]))
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.fc1.parameters(), lr=0.1), torch.optim.SGD(self.fc2.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "module_cls", [RawOptimizerModule, TwoOptimizerModule], ids=["raw-optimizer", "two-optimizers"]
)
def test_manual_optimization_is_refused_at_setup_before_any_change(module_cls):
    module = module_cls()
    before = weights(module)
    trainer = trainer_for(make_cb("latent", "hard"), max_steps=4)
    with pytest.raises(
        MisconfigurationException, match=r"does not support manual optimization.*automatic_optimization"
    ):
        trainer.fit(module)
    assert trainer.global_step == 0
    for name, tensor in weights(module).items():
        assert torch.equal(tensor, before[name]), name


def test_warns_when_the_fit_ends_before_the_final_ramp_step():
    cb = make_cb("latent", "hard")
    with pytest.warns(UserWarning, match=r"ends after optimizer step 5, before the final ramp step 8"):
        trainer_for(cb, max_steps=5).fit(StepDataModule())


def test_warns_on_target_one():
    with pytest.warns(UserWarning, match=r"target_sparsity=1.0. removes every unit"):
        CoupledPruningCallback(mlp_cluster(), 1.0)


class FrozenModule(StepDataModule):
    def __init__(self, *, frozen: bool) -> None:
        super().__init__()
        self.frozen = frozen
        if frozen:
            self.fc2.weight.requires_grad_(False)

    def configure_optimizers(self):
        if self.frozen:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
        return torch.optim.SGD([self.fc1.weight, self.fc1.bias, self.fc2.bias], lr=0.1)  # fc2.weight in none


@pytest.mark.parametrize(("frozen", "match"), [(True, "are frozen"), (False, "are in no optimizer")])
def test_warns_on_frozen_or_unoptimized_clustered_parameters(frozen, match):
    module = FrozenModule(frozen=frozen)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=0, ramp_steps=2)
    with pytest.warns(UserWarning, match=rf"\['fc2.weight'\] {match}"):
        trainer_for(cb, max_steps=3).fit(module)
    dropped = cb.dropped["hidden"]
    assert torch.all(module.fc2.weight[:, dropped] == 0)  # masked all the same
