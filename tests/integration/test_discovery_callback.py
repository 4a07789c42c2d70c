"""`clusters="auto"` on a model no preset covers: the callback traces `example_input_array`, prunes the discovered
clusters during training, and `shrink` cuts them out exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import Cluster, CoupledPruningCallback, shrink
from tests.common.cnn_models import ResBlockNet, randomize_norms
from tests.common.lit_models import MLPModule, ends_mid_ramp, quiet_trainer

pytestmark = pytest.mark.integration


class _TracedMLP(MLPModule):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 8)


def test_auto_discovers_the_hidden_cluster_of_a_custom_module():
    module = _TracedMLP()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=5, callbacks=[cb]).fit(module)
    assert [(rc.name, rc.num_units, rc.param_names) for rc in cb.resolved] == [
        ("fc1", 32, ("fc1.weight", "fc1.bias", "fc2.weight"))
    ]
    assert len(cb.dropped["fc1"]) == 16
    x = torch.randn(5, 8)
    masked = module(x)
    shrink(module, cb)
    assert module.fc1.out_features == 16
    torch.testing.assert_close(module(x), masked, rtol=1e-5, atol=1e-6)


class _ResNetModule(MLPModule):
    """MLPModule's data and optimizer, a residual CNN as the model (inputs reshaped to 2x2x2 images)."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw", lr=1e-2)
        del self.fc1, self.fc2
        torch.manual_seed(0)
        self.net = randomize_norms(ResBlockNet())
        self.net.stem = nn.Conv2d(2, 8, 3, padding=1, bias=False)
        self.example_input_array = torch.zeros(2, 2, 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.view(-1, 2, 2, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def optimizer_step(self, *args, **kwargs):
        return super(MLPModule, self).optimizer_step(*args, **kwargs)


def test_auto_on_a_residual_cnn_keeps_batchnorm_consistent_and_shrinks_exactly():
    module = _ResNetModule()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=6, callbacks=[cb]).fit(module)
    assert sorted(rc.name for rc in cb.resolved) == ["net.a1", "net.p1", "net.proj", "net.stem"]
    for rc in cb.resolved:
        dropped = cb.dropped[rc.name]
        assert len(dropped) == rc.num_units // 2
        for m in rc.members:
            if m.name.endswith(("bs.weight", "bs.bias", "ab1.weight", "projb.bias")):
                param = dict(module.named_parameters())[m.name]
                assert torch.count_nonzero(param[list(dropped)]) == 0  # BN weight and bias zero: output zero
    module.eval()
    x = torch.randn(7, 8)
    with torch.no_grad():
        masked = module(x)
        before = sum(p.numel() for p in module.parameters())
        shrink(module, cb)
        out = module(x)
    assert float((out - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in module.parameters()) < before / 2
    assert module.net.bs.running_mean.shape == (4,)


def test_auto_on_a_preset_family_still_uses_the_preset():
    class Seq(MLPModule):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(self.fc1, nn.ReLU(), self.fc2)
            self.example_input_array = torch.zeros(2, 8)

        def forward(self, x):
            return self.seq(x)

    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    with ends_mid_ramp():
        quiet_trainer(max_steps=2, callbacks=[cb]).fit(Seq())
    assert [rc.name for rc in cb.resolved] == ["hidden.seq.0"]  # linear_chain's naming: the preset, not discovery


def test_discovered_declarations_can_be_edited_and_passed_back():
    from lightning_pat import discover

    module = _TracedMLP()
    [found] = discover(module, module.example_input_array).clusters
    edited = Cluster(found.name, found.writers, found.readers, num_units=found.num_units, target=0.25)
    cb = CoupledPruningCallback([edited], 0.9, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    assert len(cb.dropped["fc1"]) == 8  # the per-cluster target wins over the global 0.9


class _NoExample(MLPModule):
    """No example_input_array: discovery traces the first training batch's inputs."""

    def __init__(self, *, example: bool) -> None:
        super().__init__(optimizer="adamw")
        if example:
            self.example_input_array = torch.zeros(2, 8)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(self.x, self.y), batch_size=4, shuffle=True)  # the global RNG shuffles


def test_auto_traces_the_first_batch_without_disturbing_the_shuffle():
    runs = {}
    for example in (True, False):
        torch.manual_seed(123)  # the shuffle order comes from the global RNG
        module = _NoExample(example=example)
        cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
        quiet_trainer(max_steps=6, callbacks=[cb]).fit(module)
        runs[example] = (cb.resolved, cb.dropped, {k: v.detach().clone() for k, v in module.state_dict().items()})
    assert [rc.fingerprint() for rc in runs[False][0]] == [rc.fingerprint() for rc in runs[True][0]]
    assert runs[False][1] == runs[True][1]
    for name, value in runs[True][2].items():  # the peek at the first batch left the training run unchanged
        assert torch.equal(runs[False][2][name], value), name


def test_auto_without_example_or_data_says_how_to_fix_it():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    class NoData(MLPModule):
        def train_dataloader(self):
            return []  # nothing to read a batch from

    cb = CoupledPruningCallback("auto", 0.5)
    with pytest.raises(MisconfigurationException, match=r"set `self.example_input_array`.* or give `fit` training"):
        quiet_trainer(max_steps=1, callbacks=[cb]).fit(NoData())
