"""CoupledPruningCallback under a single-process Trainer on CPU."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import Cluster, CoupledPruningCallback
from tests.common.lit_models import HIDDEN, MLPModule, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration


class Recorder(pl.Callback):
    """Records the pruning callback's mask after every batch (runs after it)."""

    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb = cb
        self.masks: list[dict[str, list[int]]] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.masks.append(copy.deepcopy(self.cb.dropped))
        self.steps.append(self.cb.step)


def fit(module, cb, *, max_steps=12, accumulate=1, extra=(), ckpt_path=None, **kwargs):
    rec = Recorder(cb)
    trainer = quiet_trainer(
        max_steps=max_steps,
        callbacks=[cb, rec, *extra],
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        **kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, rec


def expected_drops(cb: CoupledPruningCallback, step: int, num_units: int) -> int:
    frac = cb.schedule.fraction(step)
    return math.ceil(round(cb.target_sparsity * frac * num_units, 9))


@pytest.mark.parametrize("mode", ["latent", "direct"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_forward_sees_pruned_weights_and_mask_freezes(mode, optimizer):
    module = MLPModule(optimizer=optimizer)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=4, mode=mode)
    trainer, rec = fit(module, cb, max_steps=14)

    # Schedule: exact unit counts per step, final target at the end of the ramp.
    for step, mask in zip(rec.steps, rec.masks, strict=True):
        want = 0 if step <= 2 else expected_drops(cb, step, HIDDEN)
        assert len(mask.get("hidden", [])) == want, (step, mask)
    assert len(cb.dropped["hidden"]) == HIDDEN // 2

    # Every forward after a selection sees exactly that selection as zero rows (never the dense latent).
    for batch, zero_rows in enumerate(module.forward_log[1:], start=1):
        dropped = rec.masks[batch - 1].get("hidden", [])
        assert set(dropped) <= set(torch.nonzero(zero_rows).flatten().tolist()), batch

    # Healing: the mask is frozen from the final step, and stays exactly zero under momentum / weight decay.
    final_idx = rec.steps.index(cb.schedule.final_step)
    assert all(m == rec.masks[final_idx] for m in rec.masks[final_idx:])
    dropped = cb.dropped["hidden"]
    assert torch.all(module.fc1.weight[dropped] == 0)
    assert torch.all(module.fc1.bias[dropped] == 0)
    assert torch.all(module.fc2.weight[:, dropped] == 0)
    kept = [i for i in range(HIDDEN) if i not in dropped]
    assert torch.all(module.fc1.weight[kept].abs().sum(dim=1) > 0)
    assert cb.latent_params() == {}  # freed once the mask is frozen
    assert trainer.callback_metrics["pruning/unit_sparsity"] == pytest.approx(0.5)
    assert trainer.callback_metrics["pruning/hidden/unit_sparsity"] == pytest.approx(0.5)
    assert trainer.callback_metrics["pruning/param_sparsity"] == pytest.approx(0.5)


def _project_oracle(fc1_w, fc1_b, fc2_w, num_drop):
    """Independent hard projection: drop the rows/columns with the lowest joint rms norm (ties: lower index)."""
    q = fc1_w.double().pow(2).sum(1) + fc1_b.double().pow(2) + fc2_w.double().pow(2).sum(0)
    order = sorted(range(q.numel()), key=lambda i: (q[i].item(), i))
    drop = sorted(order[:num_drop])
    fc1_w[drop] = 0
    fc1_b[drop] = 0
    fc2_w[:, drop] = 0
    return drop


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_matches_plain_loop_oracle(mode):
    """The callback equals an independent plain-loop statement of the algorithm (gradient at the projected
    weights; latent mode updates the dense latent, direct mode the projected weights)."""
    module = MLPModule(optimizer="sgd_plain", lr=0.1)
    oracle = copy.deepcopy(module)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, mode=mode, score="rms")  # the oracle
    fit(module, cb, max_steps=8)

    opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    params = [oracle.fc1.weight, oracle.fc1.bias, oracle.fc2.weight]
    latent = None
    drop: list[int] = []
    for step, (x, y) in enumerate(oracle.train_dataloader(), start=1):
        if step > 8:
            break
        opt.zero_grad()
        torch.nn.functional.mse_loss(oracle(x), y).backward()
        with torch.no_grad():
            if mode == "latent" and latent is not None and step <= cb.schedule.final_step:
                for p, z in zip(params, latent, strict=True):
                    p.copy_(z)
            if step > cb.schedule.final_step:  # healing: no gradient reaches dropped units
                oracle.fc1.weight.grad[drop] = 0
                oracle.fc1.bias.grad[drop] = 0
                oracle.fc2.weight.grad[:, drop] = 0
        opt.step()
        with torch.no_grad():
            if step <= cb.schedule.warmup_steps:
                continue
            if step <= cb.schedule.final_step:
                if mode == "latent":
                    latent = [p.clone() for p in params]
                drop = _project_oracle(*params, expected_drops(cb, step, HIDDEN))
            else:
                oracle.fc1.weight[drop] = 0
                oracle.fc1.bias[drop] = 0
                oracle.fc2.weight[:, drop] = 0
    assert cb.dropped["hidden"] == drop
    for a, b in zip(params, [module.fc1.weight, module.fc1.bias, module.fc2.weight], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradient_accumulation_counts_real_steps():
    module = MLPModule(n_batches=16)
    cb = CoupledPruningCallback(mlp_cluster(), 0.25, warmup_steps=1, ramp_steps=2)
    _, rec = fit(module, cb, max_steps=6, accumulate=2)
    assert cb.step == 6
    # masks change only on batches that completed an optimizer step (every second batch)
    assert rec.steps == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert rec.masks[2] == {"hidden": []} or rec.masks[2] == {}  # step 1 is warmup
    assert len(rec.masks[3]["hidden"]) == expected_drops(cb, 2, HIDDEN)
    assert rec.masks[3] == rec.masks[4]  # micro-batch: no re-selection
    assert len(cb.dropped["hidden"]) == 8


def test_skipped_optimizer_step_does_not_advance_schedule():
    module = MLPModule(skip_steps=(3, 4))
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, mode="latent")
    _, rec = fit(module, cb, max_steps=8)
    assert rec.steps[:6] == [1, 2, 3, 3, 3, 4]
    assert rec.masks[3] == rec.masks[2] == rec.masks[4]
    # the forward after a skipped step still sees the pruned weights, not the swapped-in latent
    for batch in (4, 5):
        dropped = set(rec.masks[batch - 1]["hidden"])
        assert dropped <= set(torch.nonzero(module.forward_log[batch]).flatten().tolist())


class InfLossModule(MLPModule):
    """Returns an infinite loss on some batches, so a GradScaler finds inf gradients and skips the step."""

    def __init__(self, inf_batches: tuple[int, ...]) -> None:
        super().__init__()
        self.inf_batches = set(inf_batches)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx in self.inf_batches else loss


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_amp_grad_scaler_skipped_steps_do_not_advance_schedule(mode):
    from lightning.pytorch.plugins import MixedPrecision

    module = InfLossModule(inf_batches=(3, 4))
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, mode=mode)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer, rec = fit(module, cb, max_steps=8, plugins=[plugin])
    assert trainer.global_step == 8  # Lightning counts the skipped steps; the schedule does not
    assert rec.steps == [1, 2, 3, 3, 3, 4, 5, 6]
    assert rec.masks[3] == rec.masks[2] == rec.masks[4]
    for batch in (4, 5):  # forwards after a skipped step still see the pruned weights
        assert set(rec.masks[batch - 1]["hidden"]) <= set(torch.nonzero(module.forward_log[batch]).flatten().tolist())
    assert len(cb.dropped["hidden"]) == HIDDEN // 2


def test_group_lasso_reaches_exact_target_at_final_step():
    module = MLPModule(optimizer="sgd")
    cb = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=4, method="group_lasso", reg_lambda=0.5, mode="latent"
    )
    _, rec = fit(module, cb, max_steps=8)
    final_idx = rec.steps.index(cb.schedule.final_step)
    assert len(rec.masks[final_idx]["hidden"]) == HIDDEN // 2
    assert rec.masks[-1] == rec.masks[final_idx]
    # during the ramp, the soft threshold shrinks kept units: a ramp forward sees scaled (not just masked) rows
    assert torch.all(module.fc1.weight[cb.dropped["hidden"]] == 0)


def test_per_cluster_target_and_multiple_of():
    module = MLPModule()
    clusters = [
        Cluster(name="hidden", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"], target=0.3, multiple_of=8)
    ]
    cb = CoupledPruningCallback(clusters, 0.9, warmup_steps=0, ramp_steps=1)
    fit(module, cb, max_steps=3)
    assert len(cb.dropped["hidden"]) == 16  # ceil(0.3*32)=10 dropped -> 22 kept -> rounded down to 16 kept


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_sparsity": 1.5}, "target_sparsity"),
        ({"target_sparsity": True}, "target_sparsity"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"ramp_steps": 0}, "ramp_steps"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"ramp": "exp"}, "`ramp`"),
        ({"method": "l0"}, "method"),
        ({"score": "max"}, "score"),
        ({"mode": "shadow"}, "mode"),
        ({"executor": "gpu"}, "executor"),
        ({"method": "group_lasso"}, "reg_lambda"),
        ({"reg_lambda": -1.0}, "reg_lambda"),
        ({"group_count_ref": 0}, "group_count_ref"),
        ({"clusters": []}, "clusters"),
    ],
)
def test_bad_options_raise_at_construction(kwargs, match):
    kwargs = {"clusters": mlp_cluster(), **kwargs}
    with pytest.raises(MisconfigurationException, match=match):
        CoupledPruningCallback(**kwargs)


def test_bad_cluster_raises_at_fit_start_before_any_mutation():
    module = MLPModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    cb = CoupledPruningCallback([Cluster(name="hidden", writers=["fc1.wieght"], readers=["fc2.weight"])], 0.5)
    with pytest.raises(MisconfigurationException, match=r"Cluster 'hidden'.*fc1\.wieght.*fc1\.weight"):
        fit(module, cb, max_steps=2)
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_deepspeed_is_rejected_at_setup():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cb = CoupledPruningCallback(mlp_cluster(), 0.5)

    class FakeTrainer:
        strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)

    with pytest.raises(MisconfigurationException, match="DeepSpeedStrategy.*ModelParallelStrategy"):
        cb.setup(FakeTrainer(), MLPModule(), "fit")


def test_checkpoint_resume_restores_mask_and_step(tmp_path):
    module = MLPModule(n_batches=16)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[cb, ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module)
    saved_mask = cb.dropped
    path = next(tmp_path.glob("*.ckpt"))

    resumed_module = MLPModule(n_batches=16)
    cb2 = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3)
    _, rec = fit(resumed_module, cb2, max_steps=9, ckpt_path=str(path))
    assert rec.steps[0] == 7  # resumed at step 6, first new step is 7 (healing)
    assert all(m == saved_mask for m in rec.masks)
    assert torch.all(resumed_module.fc1.weight[saved_mask["hidden"]] == 0)

    other = CoupledPruningCallback(
        [Cluster(name="hidden", writers=["fc1.weight"], readers=["fc2.weight"])], 0.5, warmup_steps=1, ramp_steps=3
    )
    with pytest.raises(MisconfigurationException, match="different clusters"):
        fit(MLPModule(n_batches=16), other, max_steps=9, ckpt_path=str(path))
