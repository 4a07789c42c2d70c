"""Discovery on vision models no one here wrote (transformers ResNet, ConvNeXt, MobileNetV2, ViT from tiny
configs): the discovered clusters are checked against the architectures' structure, pruned 50% with the callback
for a few steps, shrunk, and compared with the masked model (eval, fp32, rel < 1e-5)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import CoupledPruningCallback, discover, resolve_clusters, shrink
from tests.common.lit_models import quiet_trainer
from tests.common.vision_models import BUILDERS, build, images

pytest.importorskip("transformers")  # a guard only: the test extra installs it, so these tests run in CI
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


class VisionModule(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = build(name)
        self.example_input_array = images(2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _writer_weights(model: nn.Module, clusters) -> set[str]:
    return {m.name for rc in resolve_clusters(model, clusters) for m in rc.members if m.role == "writer"}


def test_resnet_every_convolution_is_prunable():
    model = build("resnet")
    found = discover(model, images(2))
    convs = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert convs <= _writer_weights(model, found.clusters)
    # 4 stages x (2 bottleneck-inner clusters + 1 residual stream; stage 0's stream is the stem's)
    assert len(found.clusters) == 12
    assert [lo.name for lo in found.left_out] == ["classifier.1"]


def test_convnext_mlps_are_found_and_the_layernormed_stream_is_left_out():
    model = build("convnext")
    found = discover(model, images(2))
    pw = {f"{n}.weight" for n, m in model.named_modules() if n.endswith("pwconv1")}
    assert {c.writers[0] for c in found.clusters} == pw
    reasons = {r for lo in found.left_out for r in lo.reasons}
    # the residual stream: its per-channel layer scales are members now (cut with their channels), and it is left out
    # for the LayerNorm over it
    (stream,) = [lo for lo in found.left_out if any(m.endswith("layer_scale_parameter") for m in lo.members)][:1]
    assert any("LayerNorm normalises over this channel axis" in r for r in stream.reasons)
    assert not any("layer_scale_parameter is used directly" in r for r in reasons)
    assert any("LayerNorm normalises over this channel axis" in r for r in reasons)


def test_mobilenet_v2_expansions_and_depthwise_convolutions_are_prunable():
    model = build("mobilenet_v2")
    found = discover(model, images(2))
    writers = _writer_weights(model, found.clusters)
    depthwise = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1}
    expand = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and "expand_1x1" in n}
    assert depthwise
    assert expand
    assert depthwise | expand <= writers
    assert "classifier.weight" not in writers


def test_vit_mlps_and_heads_are_found_and_the_stream_is_left_out():
    model = build("vit")
    found = discover(model, images(2))
    cfg = model.config
    assert len(found.clusters) == 2 * cfg.num_hidden_layers
    mlps = [c for c in found.clusters if c.num_units == cfg.intermediate_size]
    heads = [c for c in found.clusters if c.num_units == cfg.num_attention_heads]
    assert len(mlps) == len(heads) == cfg.num_hidden_layers
    hd = cfg.hidden_size // cfg.num_attention_heads
    for rc in resolve_clusters(model, heads):  # q, k, v rows and biases, o columns: head_dim channels per head
        assert {(m.name.rsplit(".", 2)[-2], m.dim, m.block) for m in rc.members} == {
            *((f"{p}_proj", 0, hd) for p in "qkv"),
            ("o_proj", 1, hd),
        }
    reasons = {r for lo in found.left_out for r in lo.reasons}
    assert any("cls_token is used directly" in r for r in reasons)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_callback_prunes_half_and_shrink_is_exact(name):
    # every discovered cluster (`clusters="auto"` keeps only the cuts a stock config can express, and these configs
    # hold one width per stage: see the next test); the export then loads with lightning_pat.load_pretrained
    module = VisionModule(name)
    data = TensorDataset(images(16, seed=1), torch.randint(0, module.model.config.num_labels, (16,)))
    cb = CoupledPruningCallback(discover(module, images(2)).clusters, 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module, DataLoader(data, batch_size=4))
    assert cb.resolved
    for rc in cb.resolved:
        assert len(cb.dropped[rc.name]) == rc.num_units // 2
    module.eval()
    x = images(4, seed=2)
    with torch.no_grad():
        masked = module(x)
        before = sum(p.numel() for p in module.parameters())
        shrink(module, cb)
        out = module(x)
    assert float(masked.norm()) > 1e-3  # a real signal, not vanishing logits
    assert float((out - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in module.parameters()) < before


def test_auto_refuses_cuts_the_stock_config_cannot_hold_and_names_discover():
    # ResNetConfig holds one width per stage: no per-layer cut found is expressible, so "auto" stops at fit start (as
    # prune_clusters does), before any step, and says how to cut them anyway
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    module = VisionModule("resnet")
    data = TensorDataset(images(8, seed=1), torch.randint(0, module.model.config.num_labels, (8,)))
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    with pytest.raises(MisconfigurationException, match=r"can express none of the cuts found") as info:
        quiet_trainer(max_steps=2, callbacks=[cb]).fit(module, DataLoader(data, batch_size=4))
    assert "lightning_pat.discover(model, example_input).clusters" in str(info.value)
    assert module.trainer.global_step == 0
