"""Per-layer configs and the zoo's last unbuilt classes through ``clusters="auto"``, one tiny model per cause (#37).

Each case builds the family's tiny random model (``tests/common/lm_zoo.py``), runs what a new user runs
(``prune_clusters(model, "auto", 0.5, calibration=...)``, ``shrink``, ``save_pretrained``, stock
``from_pretrained``, ``generate()``) and checks the shrunk model's logits against the masked model's (fp32,
relative error < 1e-4), the stock reload's logits against the same reference, the share cut and the sizes the stock
config was told.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from tests.common import lm_zoo

pytest.importorskip("transformers")


def _pruned(model_type: str) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor, float]:
    """(the masked model, the shrunk one, token ids, the masked logits, the share cut) of a tiny model."""
    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build(model_type)
    dense = lm_zoo.non_embedding_params(model)
    ids = lm_zoo.token_ids()
    with torch.no_grad():
        before = model(ids).logits.float()
    result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=s) for s in (2, 3)])
    with torch.no_grad():
        masked = model(ids).logits.float()
    assert float((masked - before).norm() / before.norm()) > 1e-3, f"{model_type}: the cut changed no logit"
    small = shrink(model, result, example_input=None)
    with torch.no_grad():
        rel = float((small(ids).logits.float() - masked).norm() / masked.norm())
    assert rel < lm_zoo.EXACT, f"{model_type}: the shrunk logits differ from the masked model's (rel {rel:.1e})"
    return model, small, ids, masked, 1 - lm_zoo.non_embedding_params(small) / dense


def _stock(small: nn.Module, ids: torch.Tensor, masked: torch.Tensor) -> nn.Module:
    """Stock ``from_pretrained`` of the shrunk model's export (its logits equal to the masked model's), generating."""
    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(small, tmp, overwrite=True, tokenizer=None)
        with open(f"{tmp}/config.json") as f:
            assert '"lightning_pat"' not in f.read()  # nothing only our loader reads
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    with torch.no_grad():
        rel = float((stock(ids).logits.float() - masked).norm() / masked.norm())
        stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert rel < lm_zoo.EXACT, f"stock reload logits differ from the masked model's (rel {rel:.1e})"
    return stock


def test_dots3_note_heads_per_layer_are_read_cut_and_written_per_layer():
    # Dots3-note's sliding layers hold their own head counts and latent ranks (per_layer_config): reading
    # `num_attention_heads` on the config raised, the MLA keys built by copy_ into a new tensor hid the heads from
    # discovery, and the shrink could write only one head count; now each layer's heads (4 and 2) are halved and
    # written per layer, so the stock class rebuilds both layers
    from lightning_pat.shrink.layer_config import layer_values

    _, small, ids, masked, cut = _pruned("dots3_note_text")
    assert cut >= 0.45, cut
    heads = [m.o_proj.in_features // m.v_head_dim for name, m in small.named_modules() if name.endswith("self_attn")]
    assert heads == [2, 1], heads
    stock = _stock(small, ids, masked)
    assert layer_values(stock.config, "num_attention_heads") == [2, 1]
    assert layer_values(stock.config, "num_key_value_heads") == [2, 1]
    assert layer_values(stock.config, "q_lora_rank") == [32, 16]  # the other per-layer sizes kept
    assert stock.config.shared_experts_intermediate_size == 16


def test_blt_untraceable_patcher_leaves_its_gated_mlps_cut_by_structure():
    # BLT's entropy patcher stops torch.export (a data-dependent patch count), and no preset covers its four stacks:
    # their gated MLPs, found by structure, are cut; each stack's sub-config tells its own width
    _, small, ids, masked, cut = _pruned("blt")
    assert cut >= 0.2, cut
    widths = {m.down_proj.in_features for name, m in small.named_modules() if name.endswith(".mlp")}
    assert widths == {lm_zoo.FF // 2}, widths
    stock = _stock(small, ids, masked)
    sub = ("patcher_config", "encoder_config", "decoder_config", "global_config")
    assert {getattr(stock.config, s).intermediate_size for s in sub} == {lm_zoo.FF // 2}


def test_kolibri1_1_dense_layers_tell_their_own_width():
    # Kolibri 1.1's dense layers (mlp_only_layers) read `mlp_only_intermediate_size`, which the stock probe refused
    # to change; its trace stops at the indexer (its heads are left whole), its experts and dense MLP are cut
    model, small, ids, masked, cut = _pruned("kolibri1_1")
    assert cut >= 0.2, cut
    stock = _stock(small, ids, masked)
    assert stock.config.mlp_only_intermediate_size == 96 // 2


def test_gemma4_assistant_builds_and_is_said_not_standalone():
    # its default text config does not validate for an assistant (per-layer inputs); the tiny one builds, and its
    # forward takes the target model's shared KV states, which the bench says instead of pruning it
    model = lm_zoo.build("gemma4_assistant")
    assert "shared_kv_states" in (lm_zoo.standalone_refusal(model) or "")
    with pytest.raises(ValueError, match="shared_kv_states"):
        model(lm_zoo.token_ids())
