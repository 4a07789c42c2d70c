"""Dense Hugging Face decoder families that once failed the zoo bench, one per cause (issue 37).

Each case is a tiny random model of ``tests/common/lm_zoo.py``: ``prune_clusters(model, "auto", 0.5, calibration=)``,
``shrink``, the shrunk logits against the masked model's (the independent reference: the unshrunk model with the
dropped units zeroed), ``save_pretrained``, stock ``AutoModelForCausalLM.from_pretrained`` (its logits against the
masked model's) and ``generate()``, at least 20% of the non-embedding parameters cut.
"""

from __future__ import annotations

import pytest

from tests.common import lm_zoo

pytest.importorskip("transformers")


def _chain(model_type: str) -> tuple[object, lm_zoo.Outcome]:
    model = lm_zoo.build(model_type)
    out = lm_zoo.chain(model)
    assert out.error == "", f"{model_type} failed at {out.stage}: {out.error}"
    assert out.ok, out  # exact shrink and stock reload (rel < 1e-4), >= 20% cut, generate()
    return model, out


def test_a_derived_mlp_width_is_expressed_by_turning_its_auto_adjust_flag_off():
    # LFM2 builds int(2 * intermediate_size / 3) rounded up to block_multiple_of (256 here from 128) while
    # block_auto_adjust_ff_dim is set: the stock config expresses the cut width with the flag off
    dense = lm_zoo.build("lfm2")
    assert dense.model.layers[0].feed_forward.w2.in_features == 256 != dense.config.intermediate_size
    model, out = _chain("lfm2")  # shrunk in place
    assert out.cut > 0.4  # the MLPs cut (the heads alone: 10%)
    width = model.model.layers[0].feed_forward.w2.in_features
    assert width == 128 == model.config.intermediate_size
    assert model.config.block_auto_adjust_ff_dim is False


def test_a_gated_query_projection_keeps_the_head_count_when_the_mlp_is_cut():
    # Qwen3.5's full-attention q_proj holds a query and a gate row block per head (2 * heads * head_dim rows): the
    # head count is o_proj's input over head_dim, not q_proj's rows over head_dim (the MLPs and, since discovery
    # reads its norms' `type_as`, the heads are cut: whole query groups, a query and a gate row block each); the
    # tiny model holds a linear-attention and a full-attention layer
    model, _ = _chain("qwen3_5_text")  # shrunk in place
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.out_features == 2 * attn.o_proj.in_features
    assert model.config.num_attention_heads == attn.o_proj.in_features // attn.head_dim < lm_zoo.HEADS


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        "hunyuan_v1_dense",  # head_dim None in the default config: the tiny config sets it
        "bamba",  # a hybrid: mamba mixers left whole, attention and MLPs cut
    ],
)
def test_families_whose_tiny_config_once_did_not_build_pass(model_type):
    _chain(model_type)


def test_a_width_derived_over_a_factor_is_told_and_a_head_count_other_blocks_read_is_left_out():
    # RecurrentGemma builds its MLP as intermediate_size // 2, and its config's head count also sizes the LRU blocks
    # of the recurrent layers (lru_width // heads): the MLP cut is expressed (intermediate_size twice the width),
    # the attention heads are left out before pruning (a stock config with fewer heads builds other LRU blocks)
    heads = lm_zoo.tiny_config("recurrent_gemma").num_attention_heads
    model, _ = _chain("recurrent_gemma")  # shrunk in place
    mlp = model.model.layers[0].mlp_block
    assert mlp.down_proj.in_features == lm_zoo.FF // 4  # half of intermediate_size // 2
    assert model.config.intermediate_size == 2 * mlp.down_proj.in_features
    assert model.config.num_attention_heads == heads


def test_a_width_held_in_multiples_of_the_hidden_size_is_told_the_new_multiple():
    # GPT-NeoX-Japanese builds hidden_size * intermediate_multiple_size (an int): half of 4 * hidden is 2 * hidden
    model, _ = _chain("gpt_neox_japanese")  # shrunk in place
    assert model.config.intermediate_multiple_size == 2


def test_a_per_layer_head_dim_the_config_will_not_read_globally_is_left_as_it_is():
    # Gemma 4's config raises on `config.head_dim` (a per-layer attribute: the full-attention layers have their own)
    # where other configs return a value or raise AttributeError: the shrink treats it as a field it does not set
    _chain("gemma4_text")


def test_a_family_whose_config_expresses_no_cut_is_refused_with_the_reason_of_each():
    # OpenAI GPT: the MLP is 4 * n_embd, and its attention has no head_dim (the head size is n_embd // n_head)
    from lightning_pat import prune_clusters

    model = lm_zoo.build("openai-gpt")
    with pytest.raises(ValueError, match=r"can express none") as err:
        prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    assert "c_fc.weight as [64, 256], not [64, 128]" in str(err.value)
    assert "holds no `head_dim`" in str(err.value)
