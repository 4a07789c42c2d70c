"""Group lasso in the callback against the independent float64 reference (tests/common/reference.py).

At every ramp step the projection acts on the weights right after the optimizer update (the latent in latent mode):
the scheduled target is a floor (the lowest-scoring units are dropped as with ``hard``) and every other unit is
scaled by ``max(0, 1 - lambda * gamma * sqrt(G) / ||u||)``, where ``gamma`` is the sum of learning rates since
warmup in latent mode and this step's learning rate in direct mode (a proximal gradient step). Before the fix the
ramp target was 0 (nothing dropped until the final step) and direct mode used the cumulative sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pat import CoupledPruningCallback
from tests.common.capture import NAMES, Capture
from tests.common.lit_models import HIDDEN, MLPModule, mlp_cluster, quiet_trainer
from tests.common.reference import RefCluster, RefMember, reference_step

pytestmark = pytest.mark.integration

REF = RefCluster(
    "hidden",
    [RefMember("fc1.weight", 0, 0, HIDDEN), RefMember("fc1.bias", 0, 0, HIDDEN), RefMember("fc2.weight", 1, 0, HIDDEN)],
    HIDDEN,
)
LAMBDA, WARMUP, RAMP = 0.5, 1, 6


def run(mode: str, *, lr_decay: bool) -> tuple[CoupledPruningCallback, Capture]:
    class Decaying(MLPModule):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            if not lr_decay:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Decaying(optimizer="sgd", lr=0.05)
    cb = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, method="group_lasso", reg_lambda=LAMBDA, mode=mode,
        score="rms",  # the reference ranks by the weights
    )  # fmt: skip
    cap = Capture(cb)
    trainer = quiet_trainer(max_steps=WARMUP + RAMP + 2, callbacks=[cb, cap])
    trainer.fit(module)
    return cb, cap


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_every_ramp_step_matches_the_reference_floor_and_step_size(mode):
    cb, cap = run(mode, lr_decay=True)
    final = cb.schedule.final_step
    shrunk_not_dropped = 0
    for step in range(WARMUP + 1, final + 1):
        lrs = [cap.lrs[u] for u in range(WARMUP + 1, step + 1)]
        gamma = sum(lrs) if mode == "latent" else lrs[-1]
        target = 0.5 * cb.schedule.fraction(step)
        method = "hard" if step == final else "group_lasso"
        ref = reference_step(
            {n: cap.pre[step][n] for n in NAMES}, [REF], target, method=method, reg_lambda=LAMBDA, gamma=gamma
        )
        floor = math.ceil(round(target * HIDDEN, 9))
        assert len(cap.dropped[step]) >= floor > 0, step  # the scheduled target is a floor during the ramp
        assert cap.dropped[step] == ref.dropped["hidden"], step
        for n in NAMES:
            torch.testing.assert_close(cap.post[step][n], ref.weights[n], rtol=1e-6, atol=1e-7, msg=f"{step} {n}")
        post = cap.post[step]["fc1.weight"].norm(dim=1)
        pre = cap.pre[step]["fc1.weight"].norm(dim=1)
        shrunk_not_dropped += int(((post > 0) & (post < pre * (1 - 1e-6))).sum())
    assert shrunk_not_dropped > 0  # the soft threshold really acted (not only the floor)
    assert len(cb.dropped["hidden"]) == HIDDEN // 2


def test_direct_mode_shrinks_a_unit_by_this_steps_lr_only():
    """Direct mode: a kept unit's norm shrinks by exactly ``lambda * lr_t * sqrt(G)`` at step t (no compounding)."""
    cb, cap = run("direct", lr_decay=True)
    g = 8 + 1 + 4  # elements per unit: an fc1 row, its bias, an fc2 column
    checked = 0
    for step in range(WARMUP + 2, cb.schedule.final_step):
        pre, post = cap.pre[step], cap.post[step]
        norm_pre = torch.cat([pre["fc1.weight"], pre["fc1.bias"][:, None], pre["fc2.weight"].T], dim=1).norm(dim=1)
        norm_post = torch.cat([post["fc1.weight"], post["fc1.bias"][:, None], post["fc2.weight"].T], dim=1).norm(dim=1)
        kept = norm_post > 0
        expected = norm_pre[kept] - LAMBDA * cap.lrs[step] * math.sqrt(g)
        torch.testing.assert_close(norm_post[kept], expected, rtol=1e-6, atol=1e-7)
        checked += int(kept.sum())
    assert checked > 0
