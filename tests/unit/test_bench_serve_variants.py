"""bench/bench_serve.py's ``per-layer-heads`` variant: KV groups cut alike in every layer, then ranked MLP widths,
exported as DeciLM and read back exactly (the per-layer shape vLLM's DeciLM can hold with fewer heads)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_pat import load_pretrained, save_pretrained
from tests.common.bench_modules import load_bench

pytest.importorskip("transformers")


def test_per_layer_heads_variant_cuts_kv_groups_uniformly_and_exports_decilm(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    serve = load_bench("bench_serve")
    source = serve.tiny_model_and_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(source)
    batches = serve.calibration_batches(tok, batches=1, seq=32)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    full = sum(p.numel() for p in model.parameters())
    assert serve.cut_kv_groups(model, batches, keep=2) is model  # nothing to cut: the model as it was
    small = serve.cut_kv_groups(model, batches, keep=1)
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (2, 1)
    hd = small.config.head_dim
    assert {layer.self_attn.k_proj.out_features for layer in small.model.layers} == {hd}
    assert {layer.self_attn.q_proj.out_features for layer in small.model.layers} == {2 * hd}
    with pytest.raises(ValueError, match="per-layer-heads needs kv_keep"):
        serve.cut_variant(model, "per-layer-heads", batches, fraction=0.5, kv_keep=None, multiple_of=8)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()  # the dense one again
    small, formats = serve.cut_variant(model, "per-layer-heads", batches, fraction=0.5, kv_keep=1, multiple_of=8)
    assert formats == ["decilm", "gguf"]
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (2, 1)
    assert len({layer.mlp.down_proj.in_features for layer in small.model.layers}) > 1  # ranked: widths per layer
    assert sum(p.numel() for p in small.parameters()) <= round(0.5 * full)
    save_pretrained(small, tmp_path / "d", format="decilm", tokenizer=tok)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["num_attention_heads"] == 2
    assert {b["attention"]["n_heads_in_group"] for b in config["block_configs"]} == {2}
    back = load_pretrained(tmp_path / "d")
    ids = torch.tensor([tok("The return statement leaves the function.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, small(ids).logits, rtol=1e-5, atol=1e-5)


def test_table_pairs_each_round_with_dense_of_the_same_round():
    serve = load_bench("bench_serve")
    common = {"engine": "vllm", "agree": 16, "load_s": 1.0, "ttft_s": 0.1}
    dense = {"variant": "dense", "fraction": 1.0, "params": 100e6, "tokens_per_s": 110.0,
             "tokens_per_s_rounds": [110.0, 90.0, 100.0], **common}  # fmt: skip
    small = {"variant": "uniform", "fraction": 0.5, "params": 50e6, "tokens_per_s": 190.0,
             "tokens_per_s_rounds": [190.0, 180.0, 170.0], **common}  # fmt: skip
    # by hand: 190/110 = 1.727, 180/90 = 2.0, 170/100 = 1.7; median 1.727; the best-of ratio is 190/110 = 1.727 too
    assert serve.paired_ratios(small, dense) == pytest.approx([190 / 110, 2.0, 1.7])
    row = serve.table([dense, small], 16).splitlines()[-1]
    assert "| 1.73x | 1.73x (1.70-2.00) |" in row
    small["tokens_per_s_rounds"] = [150.0, 200.0, 190.0]  # the best round of each falls in different rounds
    small["tokens_per_s"] = 200.0
    row = serve.table([dense, small], 16).splitlines()[-1]
    assert "| 1.82x | 1.90x (1.36-2.22) |" in row  # best-of 200/110; paired median of 1.364, 2.222, 1.9
    hf = {**small, "engine": "hf", "tokens_per_s_rounds": [200.0]}
    hf_dense = {**dense, "engine": "hf", "tokens_per_s_rounds": [110.0]}
    assert "| 1.82x | 1.82x |" in serve.table([hf_dense, hf], 16).splitlines()[-1]  # one round: no range
