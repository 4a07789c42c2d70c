"""What a stock Hugging Face config can express (``shrink/stock_config.py``), and the MLP widths it is told."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
from torch import nn

from lightning_pat import Cluster, discover, presets
from lightning_pat.shrink.model_meta import _mlp_widths
from lightning_pat.shrink.stock_config import stock_expressible, stock_refusals
from tests.common import lm_zoo

pytest.importorskip("transformers")


def test_a_llama_preset_is_expressible_as_it_is():
    model = lm_zoo.build("llama")
    declared = presets.llama(model)
    assert stock_refusals(model, declared) == {}
    assert stock_expressible(model, declared) is declared


def test_heads_sized_from_hidden_over_heads_are_refused_with_the_shapes():
    model = lm_zoo.build("gpt_neox")
    found = discover(model, lm_zoo.token_ids()).clusters
    refused = stock_refusals(model, found)
    heads = {c.name for c in found if "query_key_value" in c.name}
    assert heads
    assert set(refused) == heads
    assert "builds gpt_neox.layers.0.attention.query_key_value" in refused[min(heads)]
    assert [c.name for c in stock_expressible(model, found)] == [c.name for c in found if c.name not in heads]


def test_a_module_holding_the_model_is_probed_through_it():
    # the callback is given the LightningModule, which holds the Hugging Face model: the same refusals, its names
    wrapper = nn.Module()
    wrapper.model = lm_zoo.build("gpt_neox")
    found = discover(wrapper.model, lm_zoo.token_ids()).clusters
    held = [
        replace(c, writers=[f"model.{w}" for w in c.writers], readers=[f"model.{r}" for r in c.readers]) for c in found
    ]
    refused = stock_refusals(wrapper, held)
    assert set(refused) == {c.name for c in found if "query_key_value" in c.name} != set()
    assert "builds model.gpt_neox.layers.0.attention.query_key_value" in refused[min(refused)]
    wrapper.other = lm_zoo.build("gpt_neox")  # two models held: no config to probe
    assert stock_refusals(wrapper, held) == {}


def test_a_fixed_mlp_width_is_refused_and_nothing_left_raises():
    model = lm_zoo.build("bloom")
    mlp = [Cluster("mlp.{layer}", [r"re:transformer\.h\.(?P<layer>\d+)\.mlp\.dense_h_to_4h\.(?:weight|bias)"],
                   [r"re:transformer\.h\.(?P<layer>\d+)\.mlp\.dense_4h_to_h\.weight"])]  # fmt: skip
    assert "dense_h_to_4h.weight as [256, 64]" in stock_refusals(model, mlp)["mlp.{layer}"]
    with pytest.raises(ValueError, match="can express none of the cuts"):
        stock_expressible(model, mlp)


def test_a_model_without_a_stock_config_is_not_probed():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert stock_refusals(net, [Cluster("h", ["0.weight", "0.bias"], ["2.weight"])]) == {}


def test_mlp_width_fields_follow_the_readers_of_the_old_width():
    config = types.SimpleNamespace(n_inner=None, intermediate_size=None, ffn_dim=96)
    reads = [("h.0.mlp.fc_out", 256, 128), ("h.1.mlp.fc_out", 256, 128), ("h.0.attn.out_proj", 64, 32)]
    _mlp_widths(config, reads, 64)
    assert (config.n_inner, config.intermediate_size, config.ffn_dim) == (128, None, 96)
    config = types.SimpleNamespace(intermediate_size=64)  # the attention's reader reads 64 too: not an MLP width
    _mlp_widths(config, [("h.0.attn.o_proj", 64, 32)], 64)
    assert config.intermediate_size == 64
    config = types.SimpleNamespace(intermediate_size=128)  # widths differ between layers: the config keeps its own
    _mlp_widths(config, [("h.0.mlp.down_proj", 128, 64), ("h.1.mlp.down_proj", 128, 96)], 64)
    assert config.intermediate_size == 128
