"""Discovery on tiny Hugging Face causal LMs whose heads it did not read (issue 37, cause 3), one model per cause.

GPT-J and CodeGen (``stack`` in their rotary), Bloom (``select`` of its ``(heads, 3, head_dim)`` fused QKV), Phi-3
(its fused ``qkv_proj`` sliced into q, k and v; GQA) and Falcon (its fused multi-query ``query_key_value``, old and
new decoder architecture): the heads are found, with the members each family's attention code implies (written out
here), and each returned cluster passed discovery's trial shrink (exact on random weights). Where the stock config
cannot express a head cut (the head size is ``hidden // heads``), the stock-config probe names the head clusters and
``clusters="auto"`` still prunes the rest exactly and reloads with stock ``from_pretrained`` (``lm_zoo.chain``, on
Falcon; ``bench/bench_lmzoo.py`` runs it on every family).
"""

from __future__ import annotations

import pytest

from lightning_pat import discover
from lightning_pat.shrink.stock_config import stock_refusals
from tests.common import lm_zoo

pytest.importorskip("transformers")

LAYERS = (0, 1)


def _by_name(found):
    return {c.name: c for c in found.clusters}


@pytest.mark.parametrize(
    ("model_type", "writers", "reader"),
    [
        ("gptj", ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"], "attn.out_proj.weight"),
        ("codegen", ["attn.qkv_proj.weight"], "attn.out_proj.weight"),  # one unit: one of CodeGen's 4 mp shards
    ],
)
def test_rotary_stack_keeps_the_heads_and_the_stock_probe_drops_them(model_type, writers, reader):
    model = lm_zoo.build(model_type)
    found = discover(model, lm_zoo.token_ids())
    clusters = _by_name(found)
    for i in LAYERS:
        first = writers[0].rsplit(".", 1)[0]
        heads = clusters[f"transformer.h.{i}.{first}"]
        assert heads.writers == [f"transformer.h.{i}.{w}" for w in writers]
        assert heads.readers == [f"transformer.h.{i}.{reader}"]
        assert heads.num_units == lm_zoo.HEADS
    refused = stock_refusals(model, found.clusters)
    assert set(refused) == {f"transformer.h.{i}.{writers[0].rsplit('.', 1)[0]}" for i in LAYERS}


def test_bloom_heads_are_whole_heads_left_out_for_their_alibi_bias():
    model = lm_zoo.build("bloom")
    found = discover(model, lm_zoo.token_ids())
    assert sorted(_by_name(found)) == [f"transformer.h.{i}.mlp.dense_h_to_4h" for i in LAYERS]
    for i in LAYERS:
        attn = f"transformer.h.{i}.self_attention"
        [heads] = [lo for lo in found.left_out if lo.name == f"{attn}.query_key_value"]
        assert heads.units == lm_zoo.HEADS  # not 3 (q, k, v) nor the 4 heads read as parts: select picks the parts
        assert heads.members == (
            f"{attn}.query_key_value.weight",
            f"{attn}.query_key_value.bias",
            f"{attn}.dense.weight",
        )
        assert heads.reasons == (
            "`baddbmm` adds a tensor computed apart from these channels (e.g. a per-head ALiBi bias)",
        )


def test_phi3_fused_qkv_slices_give_query_groups_and_query_heads_end_to_end():
    model = lm_zoo.build("phi3")
    q, kv = lm_zoo.HEADS * lm_zoo.HEAD_DIM, lm_zoo.KV * lm_zoo.HEAD_DIM
    groups = _by_name(discover(model, lm_zoo.token_ids()))
    heads = _by_name(discover(model, lm_zoo.token_ids(), query_heads=True))
    for i in LAYERS:
        attn = f"model.layers.{i}.self_attn"
        group = groups[f"{attn}.qkv_proj"]
        qkv = f"{attn}.qkv_proj.weight"
        assert group.writers == [f"{qkv}[0:{q}]", f"{qkv}[{q}:{q + kv}]", f"{qkv}[{q + kv}:{q + 2 * kv}]"]
        assert (group.readers, group.num_units, group.unit_groups) == ([f"{attn}.o_proj.weight"], lm_zoo.KV, 1)
        head = heads[f"{attn}.qkv_proj"]
        assert (head.writers, head.readers) == ([f"{qkv}[0:{q}]"], [f"{attn}.o_proj.weight"])
        assert (head.num_units, head.unit_groups) == (lm_zoo.HEADS, lm_zoo.KV)
    assert stock_refusals(model, list(groups.values())) == {}
    out = lm_zoo.chain(model)
    assert out.ok, out.error
    assert out.cut is not None
    assert out.cut > 0.45  # heads and MLP halved (the MLP alone: a third)


@pytest.mark.parametrize(
    ("overrides", "writers", "units"),
    [
        ({}, "query_key_value.weight[0:64]", lm_zoo.HEADS),  # multi-query: query heads; one key, one value
        ({"new_decoder_architecture": True}, "query_key_value.weight", lm_zoo.KV),  # whole KV groups
        ({"multi_query": False, "num_kv_heads": lm_zoo.HEADS}, "query_key_value.weight", lm_zoo.HEADS),
    ],
)
def test_falcon_fused_query_key_value_heads(overrides, writers, units):
    model = lm_zoo.build("falcon", **overrides)
    found = discover(model, lm_zoo.token_ids())
    clusters = _by_name(found)
    for i in LAYERS:
        attn = f"transformer.h.{i}.self_attention"
        heads = clusters[f"{attn}.query_key_value"]
        assert (heads.writers, heads.readers) == ([f"{attn}.{writers}"], [f"{attn}.dense.weight"])
        assert heads.num_units == units
    assert set(stock_refusals(model, found.clusters)) == {
        f"transformer.h.{i}.self_attention.query_key_value" for i in LAYERS
    }
    if not overrides:  # "auto" prunes the MLPs it can express, exactly, and stock from_pretrained reloads them
        out = lm_zoo.chain(model)
        assert out.ok, out.error
