"""GQA query heads and ``target_params`` on issue 37's decoder families (tiny random configs of tests.common.lm_zoo).

Each family has 4 query heads in 2 KV groups of head_dim 16. ``clusters="auto"`` with ``preset_options={"query_heads":
True}`` must cut query heads inside their KV groups (the same number in every group, the KV heads kept), shrink
exactly, reload with stock ``AutoModelForCausalLM.from_pretrained`` with the same logits, and ``target_params`` must
land where the solver says, checked against the shrunk model's own parameter count. Families whose heads cannot be
cut by query heads say so (a warning) and still prune what they can.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_pat as lp
from lightning_pat import CoupledPruningCallback
from tests.common import lm_zoo
from tests.common.lit_models import ZooStep, quiet_trainer

transformers = pytest.importorskip("transformers")

#: The GQA families whose query heads are cut: the route (preset or discovery) and the attention's output projection.
QUERY_HEADS = {
    "llama": "o_proj",
    "mistral": "o_proj",
    "qwen2": "o_proj",
    "qwen3": "o_proj",  # per-head q_norm/k_norm
    "gemma2": "o_proj",
    "gemma3_text": "o_proj",
    "starcoder2": "o_proj",  # discovery (LayerNorm, c_fc/c_proj MLP)
    "phi": "dense",  # discovery (parallel attention and MLP, partial rotary)
    "qwen3_moe": "o_proj",
    "mixtral": "o_proj",
    "gpt_oss": "o_proj",  # one sink logit per query head, cut with it
    "glm4": "o_proj",  # discovery (interleaved rotary through `stack`)
}
#: GQA families whose stock layout cannot take a query-head cut, and what says so.
NOT_EXPRESSIBLE = {
    "olmo2": "normalises",  # q_norm over all heads
    "olmoe": "normalise over all heads",
}
HEAD_DIM, KV = lm_zoo.HEAD_DIM, lm_zoo.KV


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def attentions(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def kept_heads(old_rows: torch.Tensor, new_rows: torch.Tensor) -> list[int]:
    """The heads of ``old_rows`` (``HEAD_DIM`` query rows each) that ``new_rows`` holds, read from the rows."""
    old = old_rows.detach().view(-1, HEAD_DIM, old_rows.shape[-1])
    new = new_rows.detach().view(-1, HEAD_DIM, new_rows.shape[-1])
    kept = [next(h for h in range(old.shape[0]) if torch.equal(old[h], n)) for n in new]
    assert kept == sorted(kept)
    return kept


def kept_query_heads(before: nn.Module, after: nn.Module) -> list[int]:
    """The query heads of ``before`` that ``after`` holds, read from the q_proj rows."""
    return kept_heads(before.q_proj.weight, after.q_proj.weight)


def stock_logits(small: nn.Module, path: Path, x: torch.Tensor) -> torch.Tensor:
    """``small`` exported, reloaded by stock ``AutoModelForCausalLM.from_pretrained`` (the same class), run on ``x``."""
    lp.save_pretrained(small, path, overwrite=True, tokenizer=None)
    stock = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(stock) is type(small)
    return logits(stock, x)


@pytest.fixture(scope="module")
def calibration() -> list[torch.Tensor]:
    return [lm_zoo.token_ids(seed=s) for s in (2, 3)]


@pytest.mark.parametrize("model_type", sorted(QUERY_HEADS))
def test_query_heads_are_cut_inside_their_kv_groups_exactly_with_stock_reload(model_type, calibration, tmp_path):
    model = lm_zoo.build(model_type)
    dense = [nn.Module() for _ in attentions(model)]
    for copy, attn in zip(dense, attentions(model), strict=True):
        copy.q_proj = nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features)
        copy.q_proj.weight.data = attn.q_proj.weight.detach().clone()
    heads, n_rep = model.config.num_attention_heads, model.config.num_attention_heads // KV
    x = lm_zoo.token_ids()
    res = lp.prune_clusters(model, "auto", 0.5, calibration=calibration, preset_options={"query_heads": True})
    masked = logits(model, x)
    small = lp.shrink(model, res, example_input=None)
    assert rel(logits(small, x), masked) < lm_zoo.EXACT
    for before, after in zip(dense, attentions(small), strict=True):
        kept = kept_query_heads(before, after)
        assert torch.bincount(torch.tensor(kept) // n_rep, minlength=KV).tolist() == [n_rep // 2] * KV
        assert after.k_proj.out_features == KV * HEAD_DIM  # the KV heads stay
        assert getattr(after, QUERY_HEADS[model_type]).in_features == len(kept) * HEAD_DIM
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (heads // 2, KV)
    assert rel(stock_logits(small, tmp_path, x), masked) < lm_zoo.EXACT


def test_query_heads_of_a_fused_qkv_proj_are_cut_inside_their_kv_groups_with_stock_reload(calibration, tmp_path):
    model = lm_zoo.build("phi3")  # one qkv_proj: q rows of every head, then k, then v (discovery reads the slices)
    qkv = [layer.self_attn.qkv_proj.weight.detach().clone() for layer in model.model.layers]
    heads, n_rep = model.config.num_attention_heads, model.config.num_attention_heads // KV
    x = lm_zoo.token_ids()
    res = lp.prune_clusters(model, "auto", 0.5, calibration=calibration, preset_options={"query_heads": True})
    masked = logits(model, x)
    small = lp.shrink(model, res, example_input=None)
    assert rel(logits(small, x), masked) < lm_zoo.EXACT
    for before, layer in zip(qkv, small.model.layers, strict=True):
        new = layer.self_attn.qkv_proj.weight.detach()
        kept = kept_heads(before[: heads * HEAD_DIM], new[: (heads // 2) * HEAD_DIM])
        assert torch.bincount(torch.tensor(kept) // n_rep, minlength=KV).tolist() == [n_rep // 2] * KV
        assert torch.equal(new[(heads // 2) * HEAD_DIM :], before[heads * HEAD_DIM :])  # k and v rows whole
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (heads // 2, KV)
    assert rel(stock_logits(small, tmp_path, x), masked) < lm_zoo.EXACT


@pytest.mark.parametrize("model_type", sorted(QUERY_HEADS))
def test_target_params_with_query_heads_lands_within_one_granule(model_type, calibration):
    model = lm_zoo.build(model_type)
    total = sum(p.numel() for p in model.parameters())
    body = lm_zoo.non_embedding_params(model)
    target = total - body + int(0.6 * body)  # 60% of the non-embedding parameters, the embeddings kept
    res = lp.prune_clusters(
        model, "auto", target_params=target, calibration=calibration, preset_options={"query_heads": True}
    )
    assert res.size is not None
    small = lp.shrink(model, res, example_input=None)
    counted = sum(p.numel() for p in small.parameters())  # independent of the solver: the shrunk model's own
    assert counted == res.size.achieved
    assert total - body + lm_zoo.non_embedding_params(small) == counted  # the embeddings were not cut
    assert res.size.achieved <= target < (res.size.above if res.size.above is not None else total + 1)


@pytest.mark.parametrize("model_type", sorted(NOT_EXPRESSIBLE))
def test_families_without_query_head_cuts_say_so_and_prune_the_rest(model_type, calibration, caplog, tmp_path):
    model = lm_zoo.build(model_type)
    heads = model.config.num_attention_heads
    x = lm_zoo.token_ids()
    with caplog.at_level(logging.WARNING, logger="lightning_pat"):
        res = lp.prune_clusters(model, "auto", 0.5, calibration=calibration, preset_options={"query_heads": True})
    assert NOT_EXPRESSIBLE[model_type] in caplog.text
    masked = logits(model, x)
    small = lp.shrink(model, res, example_input=None)
    assert rel(logits(small, x), masked) < lm_zoo.EXACT
    assert small.config.num_attention_heads == heads  # no head was cut
    assert lm_zoo.non_embedding_params(small) < 0.8 * lm_zoo.non_embedding_params(lm_zoo.build(model_type))


@pytest.mark.parametrize("model_type", ["qwen3", "starcoder2"])  # a preset, discovery
def test_callback_cuts_query_heads_to_a_parameter_target(model_type, tmp_path):
    module = ZooStep(model_type, example=lm_zoo.token_ids(batch=1, seq=8))
    total = sum(p.numel() for p in module.model.parameters())
    body = lm_zoo.non_embedding_params(module.model)
    target = total - body + int(0.6 * body)
    cb = CoupledPruningCallback(  # fractions: both kinds lose units (importance may keep every head of a toy model)
        "auto", warmup_steps=1, ramp_steps=2, preset_options={"query_heads": True}, target_params=target,
        target_allocation="fractions",
    )  # fmt: skip
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    assert cb.size is not None
    assert cb.size.achieved <= target
    model = module.model.eval()
    x = lm_zoo.token_ids()
    masked = logits(model, x)
    small = lp.shrink(model, cb, example_input=None)
    assert rel(logits(small, x), masked) < lm_zoo.EXACT
    assert sum(p.numel() for p in small.parameters()) == cb.size.achieved
    config = small.config
    assert config.num_key_value_heads == KV
    assert config.num_attention_heads % KV == 0
    assert config.num_attention_heads < 4  # query heads were cut, the KV heads kept
    assert rel(stock_logits(small, tmp_path, x), masked) < lm_zoo.EXACT


def test_target_params_keeps_mla_head_counts_the_stock_config_accepts(calibration, tmp_path):
    """DeepSeek-V2's config refuses a hidden size that is not a multiple of the head count (4 heads, hidden 64: 3
    heads are refused), so the heads cluster keeps 2 or 4; the export reloads stock."""
    model = lm_zoo.build("deepseek_v2")
    total = sum(p.numel() for p in model.parameters())
    body = lm_zoo.non_embedding_params(model)
    target = total - body + int(0.6 * body)
    res = lp.prune_clusters(model, "auto", target_params=target, calibration=calibration)
    x = lm_zoo.token_ids()
    masked = logits(model, x)
    small = lp.shrink(model, res, example_input=None)
    assert sum(p.numel() for p in small.parameters()) == res.size.achieved <= target
    assert small.config.num_attention_heads in (2, 4)
    assert rel(stock_logits(small, tmp_path, x), masked) < lm_zoo.EXACT
