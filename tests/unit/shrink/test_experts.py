"""The shrink's rules for fused experts: the same experts in every part of a MoE block, the same gate/up channels."""

from __future__ import annotations

import pytest
import torch

from lightning_pat import Cluster, resolve_clusters
from lightning_pat.shrink.plan import build_plan
from lightning_pat.shrink.surgery import apply_plan

transformers = pytest.importorskip("transformers")


def tiny_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=3, num_experts_per_tok=2, vocab_size=32,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


P = "model.layers.0.mlp."


def shrink(model, clusters, dropped):
    return apply_plan(model, build_plan(resolve_clusters(model, clusters), dropped), check_zeros=False)


def test_experts_without_their_router_rows_are_refused():
    model = tiny_mixtral()
    with pytest.raises(ValueError, match=r"MoE block 'model.layers.0.mlp' would keep different experts"):
        shrink(model, Cluster("e", [P + "experts.gate_up_proj", P + "experts.down_proj"]), {"e": [1]})
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 3  # nothing changed


def test_gate_and_up_halves_cut_differently_are_refused():
    model = tiny_mixtral()
    clusters = Cluster("c", [P + "experts.gate_up_proj@1[0/2]"], [P + "experts.down_proj@2"])
    with pytest.raises(ValueError, match=r"different intermediate channels in the gate and up parts"):
        shrink(model, clusters, {"c": [2]})


def test_every_expert_dropped_is_refused():
    model = tiny_mixtral()
    clusters = Cluster("e", [P + "gate.weight", P + "experts.gate_up_proj", P + "experts.down_proj"])
    with pytest.raises(ValueError, match=r"would keep no expert"):
        shrink(model, clusters, {"e": [0, 1, 2]})


def test_sizes_follow_the_cut():
    model = tiny_mixtral()
    clusters = [
        Cluster("e", [P + "gate.weight", P + "experts.gate_up_proj", P + "experts.down_proj"]),
        Cluster(
            "c", [P + "experts.gate_up_proj@1[0/2]", P + "experts.gate_up_proj@1[1/2]"], [P + "experts.down_proj@2"]
        ),
    ]
    shrink(model, clusters, {"e": [0, 2], "c": [1, 5]})
    block = model.model.layers[0].mlp
    assert (block.experts.num_experts, block.experts.intermediate_dim, block.gate.num_experts) == (1, 6, 1)
    assert (block.gate.top_k, block.top_k) == (1, 1)
    assert (model.config.num_local_experts, model.config.intermediate_size, model.config.num_experts_per_tok) == (
        1,
        6,
        1,
    )


E = "model.layers.1.mlp."  # Ergo's MoE layer (its first layer is dense)


def tiny_ergo():
    from tests.common import lm_zoo

    return lm_zoo.build("ergo")  # gate-less experts: up_proj (4, 64, 32), down_proj (4, 32, 64), post_expert_norm


def test_gateless_experts_are_read_by_their_shapes():
    from lightning_pat.shrink.experts import FusedLayout, expert_norms, fused_layout

    experts = tiny_ergo().model.layers[1].mlp.experts
    assert fused_layout(experts) == FusedLayout(transposed=True, gated=False)
    assert [n for n, _ in expert_norms(experts)] == ["post_expert_norm"]
    inkling_like = torch.nn.Module()  # a gate of its own next to up_proj: not gate-less experts
    for name, shape in (("gate_proj", (1, 8, 4)), ("up_proj", (1, 8, 4)), ("down_proj", (1, 4, 8))):
        inkling_like.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    assert fused_layout(inkling_like) is None


def test_gateless_up_and_down_channels_cut_differently_are_refused():
    model = tiny_ergo()
    clusters = Cluster("c", [E + "experts.up_proj@2"])  # down_proj's channels left whole
    with pytest.raises(ValueError, match=r"list `up_proj@2`, `down_proj@1`"):
        shrink(model, clusters, {"c": [3]})
    assert model.model.layers[1].mlp.experts.up_proj.shape == (4, 64, 32)


def test_gateless_experts_without_their_norm_rows_are_refused_and_sizes_follow_the_cut():
    model = tiny_ergo()
    parts = [E + "gate.linear.weight", E + "experts.up_proj", E + "experts.down_proj"]
    with pytest.raises(ValueError, match=r"post_expert_norm.weight"):
        shrink(model, Cluster("e", parts), {"e": [1]})
    clusters = [
        Cluster("e", [*parts, E + "experts.post_expert_norm.weight"]),
        Cluster("c", [E + "experts.up_proj@2"], [E + "experts.down_proj@1"]),
    ]
    shrink(model, clusters, {"e": [1, 2], "c": list(range(8))})
    block = model.model.layers[1].mlp
    assert block.experts.post_expert_norm.weight.shape == (2, 64)
    assert block.gate.e_score_correction_bias.shape == (2,)
    assert (model.config.num_experts, model.config.moe_intermediate_size) == (2, 24)
