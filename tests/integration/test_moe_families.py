"""Mixture-of-experts families beyond the fused-experts preset: one tiny model per cause, exact and stock.

Each case builds a tiny random model of the family (``tests/common/lm_zoo.py``), prunes half of what it declares,
shrinks it, compares the shrunk logits with the masked model's (fp32, rel < 1e-4), saves it and reloads it with stock
``AutoModelForCausalLM.from_pretrained`` (the same logits as the masked model). The causes: expert units joining
discovery where the preset does not cover the attention (Laguna, AFMoE), a router's per-expert selection bias held as
a parameter (Laguna), the config's expert count and top-k under other names (Aria), shared experts of a width of
their own with a fused ``gate_up_proj`` (MiniMax-M3), routers holding their weight in one ``nn.Linear`` (AFMoE,
Hunyuan-MoE), a ``q_proj`` that also makes a per-head output gate (Qwen3.5-MoE), MLA layers next to linear-attention
layers (Kimi-Linear), and experts whose router is not one row per expert (LongCat-Flash, ZAYA: the experts'
channels only, top-k kept).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_pat as lp
from tests.common import lm_zoo

transformers = pytest.importorskip("transformers")


def calibration() -> list[torch.Tensor]:
    return [lm_zoo.token_ids(seed=2)]


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def shrinks_exactly_and_reloads(model: nn.Module, result, tmp_path) -> nn.Module:
    """The shrunk logits and the stock reload's equal the masked model's; returns the reload."""
    ids = lm_zoo.token_ids()
    masked = logits(model, ids)
    small = lp.shrink(model, result, example_input=None)
    assert rel(logits(small, ids), masked) < lm_zoo.EXACT
    lp.save_pretrained(small, tmp_path, overwrite=True, tokenizer=None)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert rel(logits(stock, ids), masked) < lm_zoo.EXACT
    return stock


def expert_units(model_type: str, tmp_path) -> tuple[nn.Module, nn.Module, lp.PruneResult]:
    """The family's expert units alone (``presets.moe`` without heads), half of each cut: (model, reload, result)."""
    model = lm_zoo.build(model_type)
    result = lp.prune_clusters(model, lp.presets.moe(model, heads=False), 0.5, calibration=calibration())
    return model, shrinks_exactly_and_reloads(model, result, tmp_path), result


def test_laguna_selection_bias_held_as_a_parameter_is_routed_around_and_cut(tmp_path):
    model = lm_zoo.build("laguna")
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert isinstance(bias, nn.Parameter)
    with torch.no_grad():  # a large bias on every expert: a dropped expert must lose it, or it would still be picked
        bias.copy_(torch.tensor([5.0, 4.0, 3.0, 2.0]))
    result = lp.prune_clusters(model, lp.presets.moe(model, heads=False), 0.5, calibration=calibration())
    stock = shrinks_exactly_and_reloads(model, result, tmp_path)
    kept = sorted(set(range(4)) - set(result.dropped["experts.1"]))
    assert stock.config.num_experts == 2
    assert stock.model.layers[1].mlp.gate.e_score_correction_bias.tolist() == [5.0 - k for k in kept]


def test_afmoe_auto_adds_expert_units_to_discovery_router_linear_and_block_bias(tmp_path):
    model = lm_zoo.build("afmoe")  # gated attention: no preset covers it, discovery runs; router.gate, expert_bias
    result = lp.prune_clusters(model, "auto", 0.5, calibration=calibration())
    assert len(result.dropped["experts.1"]) == 2
    assert len(result.dropped["mlp.1"]) == 16
    stock = shrinks_exactly_and_reloads(model, result, tmp_path)
    block = stock.model.layers[1].mlp
    assert (stock.config.num_experts, block.router.gate.out_features, block.expert_bias.shape[0]) == (2, 2, 2)


def test_aria_expert_count_and_top_k_under_its_own_config_names(tmp_path):
    model = lm_zoo.build("aria_text")
    result = lp.prune_clusters(model, "auto", 0.5, calibration=calibration())
    stock = shrinks_exactly_and_reloads(model, result, tmp_path)
    assert (stock.config.moe_num_experts, stock.config.moe_topk) == (4, 2)


def test_minimax_m3_shared_experts_of_their_own_width_are_a_cluster(tmp_path):
    model = lm_zoo.build("minimax_m3_vl_text")  # shared_experts.gate_up_proj: 48 channels, experts 128
    result = lp.prune_clusters(model, "auto", 0.5, calibration=calibration())
    assert len(result.dropped["shared.1"]) == 24
    stock = shrinks_exactly_and_reloads(model, result, tmp_path)
    assert stock.config.shared_intermediate_size == 24


def test_hunyuan_gate_holding_its_weight_in_a_linear_is_a_router(tmp_path):
    _, stock, result = expert_units("hunyuan_v1_moe", tmp_path)
    assert len(result.dropped["experts.1"]) == 2
    assert stock.config.num_experts == 2
    assert stock.model.layers[1].mlp.gate.wg.out_features == 2


def test_qwen3_5_moe_gated_query_keeps_its_head_count(tmp_path):
    model, stock, _ = expert_units("qwen3_5_moe_text", tmp_path)
    attn = stock.model.layers[1].self_attn  # q_proj makes q and a gate per head: 2 * heads * head_dim rows
    assert attn.q_proj.out_features == 2 * stock.config.num_attention_heads * attn.head_dim
    assert stock.config.num_attention_heads == model.config.num_attention_heads


def test_kimi_linear_mla_heads_are_not_overwritten_by_its_linear_attention(tmp_path):
    model, stock, _ = expert_units("kimi_linear", tmp_path)
    assert stock.config.num_attention_heads == model.config.num_attention_heads


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_experts_without_a_router_row_each_lose_channels_and_keep_top_k(model_type, tmp_path):
    model = lm_zoo.build(model_type)
    top_k = {a: getattr(model.config, a) for a in ("num_experts_per_tok", "moe_topk") if hasattr(model.config, a)}
    clusters = lp.presets.moe(model, heads=False)
    assert {c.name for c in clusters} == {"mlp.{layer}"}  # no whole experts: the router is not one row per expert
    result = lp.prune_clusters(model, clusters, 0.5, calibration=calibration())
    stock = shrinks_exactly_and_reloads(model, result, tmp_path)
    assert {a: getattr(stock.config, a) for a in top_k} == top_k
