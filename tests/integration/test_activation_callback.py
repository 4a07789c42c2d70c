"""``score="activation"`` in the callback: selections against an independent reference, hook lifetime, refusals.

The reference keeps its own statistics with its own forward pre-hook on the reader (``fc2``): per input channel the
float64 mean of x^2 over the batch in every training forward, averaged exponentially (0.9, the first batch as the
start), and scores ``sqrt(E[x_c^2] * ||fc2.weight[:, c]||^2)`` from the weights the projection starts from.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_pat import Cluster, CoupledPruningCallback
from tests.common.capture import Capture
from tests.common.lit_models import HIDDEN, MLPModule, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration


class RefStats(pl.Callback):
    """The test's own EMA of the reader's input, filed per step (runs after the pruning callback)."""

    def __init__(self, cb) -> None:
        self.cb, self.ema, self.at = cb, None, {}

    def on_train_start(self, trainer, pl_module):
        def hook(module, args):
            if module.training and torch.is_grad_enabled():
                x = args[0].detach().double()
                m = (x * x).mean(dim=0)
                self.ema = m if self.ema is None else 0.9 * self.ema + 0.1 * m

        self.handle = pl_module.fc2.register_forward_pre_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at[self.cb.step] = self.ema.clone()

    def on_train_end(self, trainer, pl_module):
        self.handle.remove()


def trainer_for(callbacks, max_steps):
    return quiet_trainer(max_steps=max_steps, callbacks=callbacks)


def hooks(module) -> int:
    return len(module.fc2._forward_pre_hooks)


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_every_selection_drops_the_lowest_reference_activation_scores(mode):
    module = MLPModule(optimizer="adamw", lr=0.05)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=5, score="activation", mode=mode)
    cap, ref = Capture(cb), RefStats(cb)
    trainer_for([cb, cap, ref], 10).fit(module)
    weight_score_differs = False
    for step in range(3, cb.schedule.final_step + 1):
        w = cap.pre[step]["fc2.weight"]
        scores = (ref.at[step] * (w * w).sum(dim=0)).sqrt().tolist()
        num = math.ceil(round(0.5 * cb.schedule.fraction(step) * HIDDEN, 9))
        want = sorted(sorted(range(HIDDEN), key=lambda c: (scores[c], c))[:num])
        assert cap.dropped[step] == want, step
        pre = cap.pre[step]
        rms = (pre["fc1.weight"].square().sum(1) + pre["fc1.bias"].square() + pre["fc2.weight"].square().sum(0)).sqrt()
        by_weight = sorted(sorted(range(HIDDEN), key=lambda c: (float(rms[c]), c))[:num])
        weight_score_differs |= by_weight != want
    assert weight_score_differs  # the test tells the activation score from the weight score


def test_hooks_live_only_while_selecting_and_never_leak_across_fits():
    module = MLPModule()
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, score="activation")
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((cb.step, hooks(pl_module)))

    trainer_for([cb, Probe()], 7).fit(module)
    # one hook while warmup and ramp need statistics; none from the frozen mask on (step 4 is the final step)
    assert seen == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0)]
    assert hooks(module) == 0
    trainer = trainer_for([cb, Probe()], 7)
    trainer.fit(module)  # a second fit (a notebook cell run again): one hook again, removed again
    assert seen[7] == (0, 1)
    assert hooks(module) == 0
    count = cb.controller.run.collectors.act.state_dict()["count"]["fc2"]
    assert count == 4  # the new schedule started from empty statistics: batches of steps 1..4


def test_heal_false_keeps_collecting_and_a_crashed_fit_removes_the_hook():
    module = MLPModule()
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=0, ramp_steps=2, heal=False, score="activation")

    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cb.step == 5:
                assert hooks(pl_module) == 1  # past the ramp without healing: still selecting
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trainer_for([cb, Boom()], 8).fit(module)
    assert hooks(module) == 0


@pytest.mark.parametrize("score", ["activation", "taylor"])
def test_fsdp1_is_refused_at_setup_and_model_parallel_is_accepted(score):
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, score=score)
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(
        MisconfigurationException,
        match=rf"score='{score}'\) supports a single device, DDP and ModelParallelStrategy .*FSDPStrategy.*fully_shard",
    ):
        cb.setup(trainer, MLPModule(), "fit")
    CoupledPruningCallback(mlp_cluster(), 0.5).setup(trainer, MLPModule(), "fit")  # a weight score is fine
    cb.setup(SimpleNamespace(strategy=DDPStrategy()), MLPModule(), "fit")  # DDP is supported
    cb.setup(SimpleNamespace(strategy=ModelParallelStrategy()), MLPModule(), "fit")  # and FSDP2/TP (tests/distributed)


def test_a_reader_that_is_not_a_linear_is_refused_at_fit_start():
    class Head(MLPModule):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4, HIDDEN))

    module = Head()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    clusters = [Cluster("hidden", writers=["fc1.weight", "fc1.bias"], readers=["scale"])]
    cb = CoupledPruningCallback(clusters, 0.5, score="activation")
    trainer = trainer_for([cb], 2)
    with pytest.raises(
        MisconfigurationException,
        match=r"Cluster 'hidden': .*reader 'scale' is the `scale` of the root module \(Head\).*weight score",
    ):
        trainer.fit(module)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert hooks(module) == 0


def test_tiny_gpt_preset_heads_and_mlp_then_shrink_on_freeze():
    """The preset's MLP and GQA head clusters (readers down_proj / o_proj) score by activation, then shrink."""
    from tests.integration.test_shrink_on_freeze import LM

    module = LM()
    cb = CoupledPruningCallback(
        "tiny_gpt", 0.5, warmup_steps=1, ramp_steps=3, score="activation", shrink_on_freeze=True
    )
    trainer_for([cb], 6).fit(module)
    assert cb.controller.run.collectors.act is None  # the statistics went with the shrink
    layers = module.model.layers
    assert [layer.mlp.gate_proj.out_features for layer in layers] == [32, 32]
    assert all(len(v) > 0 for v in cb.dropped.values())
    assert not any(m._forward_pre_hooks for m in module.modules())


def test_taylor_on_frozen_clustered_weights_is_refused_at_fit_start():
    """Audit 2026-12b A4: with every clustered weight frozen, score='taylor' has no evidence and would drop by index."""
    module = MLPModule()
    for p in (module.fc1.weight, module.fc1.bias, module.fc2.weight):  # the cluster's members; fc2.bias trains
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=2, score="taylor")
    with pytest.raises(
        MisconfigurationException,
        match=r"score='taylor'.*cluster 'hidden' has no member with a gradient.*requires_grad=False.*score='rms'",
    ):
        trainer_for([cb], 4).fit(module)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert cb.step == 0
