"""torchvision's classification models (the CI subset of bench/bench_zoo.py, which runs the whole zoo): a residual
CNN, a depthwise/squeeze-excite net, a ViT, a Swin V1, a Swin V2, a ShuffleNet and a MaxViT, random init with
randomised norms, layer scales, class tokens and Swin V2's logit scales. Discovery, 50% pruning of every cluster,
``shrink(..., example_input=found)`` (which runs and compares the shrunk model itself), and an independent comparison
here (eval, fp32, rel < 1e-5); what each model leaves out, and why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import discover, prune_clusters, shrink
from tests.common import torchvision_zoo as zoo

zoo.import_torchvision()  # `make setup` installs it; missing, this file fails to collect (never a silent skip)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reasons(found) -> dict[str, tuple[str, ...]]:
    return {lo.name: lo.reasons for lo in found.left_out}


@pytest.mark.parametrize("name", zoo.CI_SUBSET)
def test_zoo_model_prunes_half_and_shrinks_exactly(name):
    model = zoo.build(name)
    x = zoo.images(name, 2)
    found = discover(model, x)
    assert found.clusters
    before = sum(p.numel() for p in model.parameters())
    result = prune_clusters(model, found.clusters, 0.5)
    with torch.no_grad():
        masked = model(x)
    small = shrink(model, result, example_input=found)
    with torch.no_grad():
        out = small(zoo.images(name, 2))
    assert float(masked.norm()) > 1e-3
    assert float((out - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in small.parameters()) < before
    reasons = _reasons(found)
    if name == "resnet18":  # every convolution: only the logits are left out
        writers = {m.name for rc in result.clusters for m in rc.members if m.role == "writer"}
        assert {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)} <= writers
        assert list(reasons) == ["fc"]
    if name == "vit_b_32":  # the MLPs and heads (nn.MultiheadAttention, replaced on shrink); the stream is LayerNorm-ed
        heads = [c for c in found.clusters if c.name.endswith("self_attention")]
        assert len(found.clusters) == 24
        assert len(heads) == 12
        assert all(c.num_units == 12 for c in heads)
        assert {b.self_attention.num_heads for b in small.encoder.layers} == {6}
    if name == "swin_t":  # heads behind the packed qkv with the bias table's columns (replaced on shrink); MLPs
        heads = [c for c in found.clusters if c.name.endswith("attn.qkv")]
        assert sorted(c.num_units for c in heads) == [3, 3, 6, 6, 12, 12, 12, 12, 12, 12, 24, 24]
        assert len(found.clusters) == 24
        assert [b.attn.num_heads for s in (1, 3, 5, 7) for b in small.features[s]] == [1, 1, 3, 3, *[6] * 6, 12, 12]
    if name == "swin_v2_t":  # heads with their logit scale and cpb_mlp rows (replaced on shrink); MLPs; cpb MLPs
        heads = [c for c in found.clusters if c.name.endswith(".attn")]
        assert sorted(c.num_units for c in heads) == [3, 3, 6, 6, 12, 12, 12, 12, 12, 12, 24, 24]
        assert all(f"{c.name}.logit_scale" in c.writers and f"{c.name}.cpb_mlp.2.weight" in c.writers for c in heads)
        assert len(found.clusters) == 36  # 12 blocks: heads, MLP, the continuous position bias MLP's hidden units
        assert [b.attn.num_heads for s in (1, 3, 5, 7) for b in small.features[s]] == [1, 1, 3, 3, *[6] * 6, 12, 12]
        assert not [r for rs in reasons.values() for r in rs if "logit_scale" in r or "expand_as" in r]
    if name == "maxvit_t":  # window and grid attention heads with the bias table's columns (replaced on shrink)
        heads = {c.name.removesuffix(".attn_layer.1.to_qkv"): c for c in found.clusters if c.name.endswith("to_qkv")}
        per_stage = (2, 4, 8, 16)  # 64, 128, 256, 512 channels in heads of 32; 2, 2, 5, 2 layers of two attentions
        assert sorted(c.num_units for c in heads.values()) == sorted(
            h for h, n in zip(per_stage, (2, 2, 5, 2), strict=True) for _ in range(2 * n)
        )
        assert all(any(r.endswith(".relative_position_bias_table") for r in c.readers) for c in heads.values())
        assert len(found.clusters) == 69  # 22 heads clusters; MBConv, squeeze-excite and MLP channels
        kept = [small.get_submodule(f"{n}.attn_layer.1").n_heads for n in heads]
        assert sorted(kept) == sorted(c.num_units // 2 for c in heads.values())
        assert not [r for rs in reasons.values() for r in rs if "permute/reshape" in r or "einsum" in r]


def test_discover_with_an_input_that_does_not_fit_says_so():
    model = zoo.build("resnet18")
    with pytest.raises(ValueError, match=r"the example input does not fit ResNet's forward \(module 'conv1' raised"):
        discover(model, torch.zeros(2, 4, 32, 32))
