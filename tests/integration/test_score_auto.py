"""``score="auto"`` (the default): the activation score wherever it runs, else ``"rms"``; a resume keeps its score.

References: the same run with the score named explicitly (``"activation"`` or ``"rms"``), which the tests in
``test_activation_callback.py`` check against an independent implementation; here the default must be bitwise the
same run as the score it resolves to, and a different run from the other one.
"""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pat import Cluster, CoupledPruningCallback, OneShotPruningCallback
from tests.common.lit_models import HIDDEN, MLPModule, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration


def fit(cb, module=None, steps=10, **trainer_kw):
    module = module or MLPModule(optimizer="adamw", lr=0.05)
    quiet_trainer(max_steps=steps, callbacks=[cb, *trainer_kw.pop("callbacks", [])], **trainer_kw).fit(module)
    return module


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_auto_is_the_default_and_is_the_activation_run_bitwise(caplog):
    auto = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=5)
    assert auto.options.score == "auto"
    assert OneShotPruningCallback(mlp_cluster(), 0.5).options.score == "auto"
    with caplog.at_level(logging.INFO, logger="lightning_pat"):
        m_auto = fit(auto)
    act = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=5, score="activation")
    rms = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=5, score="rms")
    m_act = fit(act)
    fit(rms)
    assert auto.score == "activation"
    assert auto.dropped == act.dropped
    assert same_weights(m_auto, m_act)
    assert rms.dropped != act.dropped  # the test tells the two scores apart
    assert "score='auto' scores units by 'activation'" in caplog.text


class ScaleReader(MLPModule):
    """The hidden channels are read by a plain parameter too (no nn.Linear reader: no activation statistics)."""

    def __init__(self):
        super().__init__(optimizer="adamw", lr=0.05)
        self.scale = torch.nn.Parameter(torch.ones(4, HIDDEN))

    def forward(self, x):
        return torch.relu(self.fc1(x)) @ self.scale.t()


def scale_cluster():
    return [Cluster("hidden", writers=["fc1.weight", "fc1.bias"], readers=["scale"])]


def test_auto_falls_back_to_rms_where_activation_cannot_score_the_clusters(caplog):
    auto = CoupledPruningCallback(scale_cluster(), 0.5, warmup_steps=1, ramp_steps=3)
    with caplog.at_level(logging.INFO, logger="lightning_pat"):
        m_auto = fit(auto, ScaleReader(), steps=6)
    rms = CoupledPruningCallback(scale_cluster(), 0.5, warmup_steps=1, ramp_steps=3, score="rms")
    m_rms = fit(rms, ScaleReader(), steps=6)
    assert auto.score == "rms"
    assert auto.dropped == rms.dropped
    assert len(auto.dropped["hidden"]) == HIDDEN // 2
    assert same_weights(m_auto, m_rms)
    assert "score='auto' scores units by 'rms' (the activation score cannot score these clusters" in caplog.text
    explicit = CoupledPruningCallback(scale_cluster(), 0.5, warmup_steps=1, ramp_steps=3, score="activation")
    with pytest.raises(MisconfigurationException, match=r"reader 'scale' is the `scale` of the root module"):
        fit(explicit, ScaleReader(), steps=6)  # naming the score explicitly still refuses


@pytest.mark.parametrize("saved", ["rms", "activation"])
def test_a_resumed_run_keeps_the_score_its_checkpoint_was_written_with(tmp_path, saved):
    """A healing checkpoint written with either score (e.g. ``rms``, the default before ``auto``) resumes under the
    default ``auto`` with that score, bitwise as a resume naming it, instead of refusing a changed mask option."""
    opts = {"warmup_steps": 1, "ramp_steps": 3}
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    first = CoupledPruningCallback(mlp_cluster(), 0.5, score=saved, **opts)
    fit(first, steps=6, callbacks=[ckpt], checkpointing=True)

    def resume(**score):
        cb = CoupledPruningCallback(mlp_cluster(), 0.5, **opts, **score)
        module = MLPModule(optimizer="adamw", lr=0.05)
        quiet_trainer(max_steps=9, callbacks=[cb]).fit(module, ckpt_path=str(tmp_path / "step=6.ckpt"))
        return cb, module

    (auto, m_auto), (named, m_named) = resume(), resume(score=saved)
    assert auto.options.score == "auto"
    assert auto.score == saved
    assert auto.dropped == named.dropped
    assert same_weights(m_auto, m_named)


def test_a_model_left_in_eval_mode_still_collects_statistics_in_training_batches():
    """Lightning keeps a submodule's eval mode during fit (how ``from_pretrained`` models arrive): its forwards in a
    training batch are still training forwards; a validation forward (no grad) and an eval forward outside a batch
    are not."""

    def run(eval_reader: bool):
        module = MLPModule(optimizer="adamw", lr=0.05)
        if eval_reader:
            module.fc2.eval()  # kept by the Trainer (no dropout here: the same numbers as in train mode)
        cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=2, ramp_steps=5)
        quiet_trainer(max_steps=10, callbacks=[cb]).fit(module)
        return cb, module

    (cb_eval, m_eval), (cb_train, m_train) = run(True), run(False)
    assert not m_eval.fc2.training  # the Trainer really kept the eval mode
    assert cb_eval.score == "activation"
    assert cb_eval.dropped == cb_train.dropped
    assert same_weights(m_eval, m_train)
    stats = cb_eval.controller.run.collectors.act
    stats.attach()  # the fit removed the hooks; the flag the controller sets around each training batch decides
    before = stats.state_dict()["ema"]["fc2"].clone()
    x = torch.randn(4, 8)
    m_eval(x)  # an eval-mode forward outside a training batch does not count
    assert torch.equal(stats.state_dict()["ema"]["fc2"], before)
    with torch.no_grad():
        stats.in_batch = True
        m_eval(x)  # nor does a forward without grad (validation)
    assert torch.equal(stats.state_dict()["ema"]["fc2"], before)
    m_eval(x)  # inside a training batch with grad: it counts
    stats.detach()
    assert not torch.equal(stats.state_dict()["ema"]["fc2"], before)
