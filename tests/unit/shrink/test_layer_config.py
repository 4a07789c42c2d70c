"""Per-layer config fields read and written (lightning_pat.shrink.layer_config) on transformers' own configs."""

from __future__ import annotations

import json
import tempfile

import pytest

transformers = pytest.importorskip("transformers")

from lightning_pat.shrink.layer_config import (  # noqa: E402 - after the importorskip
    config_value,
    has_field,
    is_heterogeneous,
    layer_values,
    per_layer_fields,
    write_per_layer,
)


def _dots3(**kwargs: object) -> object:
    """Dots3-note's text config: 2 layers, the second a sliding layer of 2 heads (the first: 4)."""
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
             "head_dim": 8, "index_head_dim": 16, "n_routed_experts": 4, "n_group": 1, "vocab_size": 128,
             "layer_types": ["indexed_attention", "sliding_attention"], "swa_num_attention_heads": 2,
             "swa_num_key_value_heads": 2, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16, "swa_head_dim": 24,
             "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16}  # fmt: skip
    return transformers.AutoConfig.for_model("dots3_note_text", **{**sizes, **kwargs})


def test_reads_per_layer_fields_where_the_global_read_raises():
    config = _dots3()
    assert is_heterogeneous(config)
    assert {"num_attention_heads", "q_lora_rank"} <= per_layer_fields(config)
    with pytest.raises(Exception, match="per-layer attribute"):
        _ = config.num_attention_heads  # transformers refuses the global read
    assert layer_values(config, "num_attention_heads") == [4, 2]
    assert layer_values(config, "hidden_size") == [64]  # a global field: its one value
    assert layer_values(config, "no_such_field") is None
    assert config_value(config, "num_attention_heads", "differs") == "differs"
    assert config_value(config, "v_head_dim") == 16  # per layer in the overrides given, equal in every layer
    assert has_field(config, "num_attention_heads")
    assert not has_field(config, "no_such_field")


def test_homogeneous_config():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert not is_heterogeneous(config)
    assert per_layer_fields(config) == frozenset()
    assert layer_values(config, "num_key_value_heads") == [2]
    assert config_value(config, "num_attention_heads") == 4
    with pytest.raises(ValueError, match="needs one value per layer"):
        write_per_layer(config, {"num_attention_heads": [2]})


def test_writes_per_layer_values_that_survive_a_save():
    config = _dots3()
    write_per_layer(config, {"num_attention_heads": [2, 1], "num_key_value_heads": [2, 1]})
    assert layer_values(config, "num_attention_heads") == [2, 1]
    assert layer_values(config, "q_lora_rank") == [32, 16]  # the other overrides kept
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        with open(f"{tmp}/config.json") as f:
            saved = json.load(f)["per_layer_config"]
        again = transformers.AutoConfig.from_pretrained(tmp)
    assert {int(k): v["num_attention_heads"] for k, v in saved.items() if "num_attention_heads" in v} == {0: 2, 1: 1}
    assert layer_values(again, "num_attention_heads") == [2, 1]
    assert layer_values(again, "num_key_value_heads") == [2, 1]
    write_per_layer(config, {"num_attention_heads": [2, 2], "num_key_value_heads": [2, 2]})  # equal: global again
    assert "num_attention_heads" not in per_layer_fields(config)
    assert config.num_attention_heads == 2
