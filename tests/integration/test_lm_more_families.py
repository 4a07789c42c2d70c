"""More Hugging Face decoder families through ``clusters="auto"``: one tiny model per library cause fixed (issue 37).

Each case builds the family's tiny random model (``tests/common/lm_zoo.py``), runs what a new user runs
(``prune_clusters(model, "auto", 0.5, calibration=...)``, ``shrink``, ``save_pretrained``, stock
``from_pretrained``) and checks the shrunk model's logits against the masked model's (fp32, relative error < 1e-4),
the stock reload's logits against the same reference, and the sizes the stock config was told.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from tests.common import lm_zoo

pytest.importorskip("transformers")


def _pruned(model_type: str, **overrides: object) -> tuple[nn.Module, torch.Tensor, torch.Tensor, float]:
    """(shrunk model, token ids, masked logits, share cut) of the family's tiny model (``overrides``: its config)."""
    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build(model_type, **overrides)
    dense = lm_zoo.non_embedding_params(model)
    ids = lm_zoo.token_ids()
    result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=s) for s in (2, 3)])
    with torch.no_grad():
        masked = model(ids).logits.float()
    small = shrink(model, result, example_input=None)
    with torch.no_grad():
        rel = float((small(ids).logits.float() - masked).norm() / masked.norm())
    assert rel < lm_zoo.EXACT, f"{model_type}: the shrunk logits differ from the masked model's (rel {rel:.1e})"
    return small, ids, masked, 1 - lm_zoo.non_embedding_params(small) / dense


def _stock(small: nn.Module, ids: torch.Tensor, masked: torch.Tensor) -> nn.Module:
    """Stock ``from_pretrained`` of the shrunk model's export, its logits equal to the masked model's."""
    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(small, tmp, overwrite=True, tokenizer=None)
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    with torch.no_grad():
        rel = float((stock(ids).logits.float() - masked).norm() / masked.norm())
    assert rel < lm_zoo.EXACT, f"stock reload logits differ from the masked model's (rel {rel:.1e})"
    return stock


def test_hrm_recurrent_cycles_without_grad_are_discovered_and_cut_at_one_width():
    # HRM runs its L-module's cycles under torch.no_grad(): the trace once hid them in a `wrap_with_set_grad_enabled`
    # subgraph, their MLPs were not found, and the H-module's cut alone could not be written to the shared
    # `intermediate_size` (here one H cycle of two L cycles, the first without grad); now both stacks' MLPs are cut
    # to one width, and the heads with them
    small, ids, masked, cut = _pruned("hrm_text", H_cycles=1, L_cycles=2, L_bp_cycles=[1])
    assert cut >= 0.45, cut
    widths = {m.down_proj.in_features for name, m in small.named_modules() if name.endswith(".mlp")}
    assert widths == {lm_zoo.FF // 2}, widths  # both stacks, one width
    stock = _stock(small, ids, masked)
    assert stock.config.intermediate_size == lm_zoo.FF // 2


def test_ergo_dense_first_layers_and_shared_experts_tell_their_own_config_fields():
    # Ergo's dense first layers read `first_dense_intermediate_size` and its shared experts
    # `shared_intermediate_size`: both follow the cut (its heads are hidden // heads: left out, said before pruning)
    model = lm_zoo.build("ergo")
    shared_before = model.config.shared_intermediate_size
    small, ids, masked, cut = _pruned("ergo")
    assert cut >= 0.15, cut
    stock = _stock(small, ids, masked)
    assert stock.config.first_dense_intermediate_size == lm_zoo.FF // 2
    assert stock.config.shared_intermediate_size == shared_before // 2


def test_gemma3n_per_layer_widths_and_laurel_rank_follow_the_cut():
    # Gemma 3n holds `intermediate_size` as one width per layer and its LAuReL blocks' width as `laurel_rank`: the
    # list (all layers at one width) and the rank follow the cut (its KV-sharing layers are in the tiny model)
    model = lm_zoo.build("gemma3n_text")
    rank = model.config.laurel_rank
    small, ids, masked, cut = _pruned("gemma3n_text")
    assert cut >= 0.2, cut
    stock = _stock(small, ids, masked)
    assert stock.config.intermediate_size == [lm_zoo.FF // 2] * stock.config.num_hidden_layers
    assert stock.config.laurel_rank == rank // 2


def test_xlstm_feed_forward_width_from_a_factor_is_told_as_a_factor():
    # xLSTM builds its feed-forward width as hidden * ffn_proj_factor rounded up to ffn_round_up_to_multiple_of: the
    # cut width is told as a new factor and a multiple that rebuilds it exactly
    model = lm_zoo.build("xlstm")
    width = model.backbone.blocks[0].ffn.up_proj_dim
    small, ids, masked, cut = _pruned("xlstm")
    assert cut >= 0.2, cut
    stock = _stock(small, ids, masked)
    assert stock.backbone.blocks[0].ffn.up_proj_dim == width // 2


def test_dory_traces_without_a_kv_cache():
    # Dory deep-copies its recurrent layers' KV cache in forward, which torch.export cannot trace; discovery now
    # traces a Hugging Face forward with use_cache=False (its clusters, per-channel scales included, are checked in
    # test_lm_mm_and_scales.py)
    from lightning_pat.discovery.trace import trace

    model = lm_zoo.build("dory")
    traced = trace(model, lm_zoo.token_ids())
    linears = [n for n in traced.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # every projection is read (the recurrent layers once per loop, so at least once each)
    assert len(linears) >= len(projections), (len(linears), len(projections))


def test_phi4_multimodal_encoders_are_cut_on_their_own_inputs_and_do_not_set_the_text_heads():
    # Phi-4-multimodal's vision encoder holds q/k/v attentions of its own config: the shrink once wrote their head
    # counts into the text config (all 4 of its heads as KV heads), and stock from_pretrained built another qkv_proj;
    # the text MLP's new width went into the vision config too. Its vision and audio encoders (84% of the tiny
    # model's non-embedding parameters) are never run by a text forward: they are traced on inputs made from their
    # configs (discovery/encoders.py), and the MLPs their configs can express are cut (their heads are sized
    # hidden // heads, and the audio convolutions' widths are tied to its hidden size: left whole)
    model = lm_zoo.build("phi4_multimodal")
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    vision, audio = model.config.vision_config, model.config.audio_config
    sizes = (vision.intermediate_size, vision.num_attention_heads, audio.intermediate_size, audio.num_attention_heads)
    small, ids, masked, cut = _pruned("phi4_multimodal")
    assert cut >= 0.2, cut  # the text decoder alone: 8%
    stock = _stock(small, ids, masked)
    assert (stock.config.num_attention_heads, stock.config.num_key_value_heads) == (heads // 2, kv // 2)
    assert stock.config.intermediate_size == lm_zoo.FF // 2
    # each encoder's MLP width is told to its own config; their head counts stay
    vision, audio = stock.config.vision_config, stock.config.audio_config
    got = (vision.intermediate_size, vision.num_attention_heads, audio.intermediate_size, audio.num_attention_heads)
    assert got == (sizes[0] // 2, sizes[1], sizes[2] // 2, sizes[3])
    encoders = stock.model.embed_tokens_extend
    assert encoders.image_embed.img_processor.head.mlp.fc1.out_features == sizes[0] // 2
    assert encoders.audio_embed.encoder.encoders[0].feed_forward_in.down_proj.in_features == sizes[2] // 2
