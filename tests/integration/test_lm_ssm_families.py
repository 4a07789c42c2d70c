"""Mamba-style state-space mixers through ``clusters="auto"`` (issue 37): their inner channels or groups, exactly.

Tracing sees neither a mixer's scan nor its own ``A_log``/``D``; the mixers' units are found by structure
(``lightning_pat/presets/ssm.py``) and join the discovered clusters. One tiny model per cause: Mamba 1 (inner
channels, ``expand`` told), Mamba 2 (whole groups of heads: ``num_heads``, ``n_groups``, ``expand`` told), a hybrid
(Jamba: the mixer next to discovered attention and experts), a Mamba 2 mixer without a norm (Falcon-H1: heads, its
per-row multipliers rebuilt). The reference is independent of the library's masking:
the dropped channels zeroed by hand.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.common import lm_zoo

pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "jamba", "falcon_h1"])
def test_auto_prunes_the_mixers_shrinks_exactly_and_reloads_stock(model_type):
    out = lm_zoo.chain(lm_zoo.build(model_type))
    assert out.error == "", f"{model_type} failed at {out.stage}: {out.error}"
    assert out.ok, out  # exact shrink and stock reload (rel < 1e-4), >= 20% cut, generate()


def _zeroed(model, drop):
    """``model`` with the inner channels ``drop`` of every Mamba 1 mixer zeroed by hand (the reference)."""
    with torch.no_grad():
        for layer in model.backbone.layers:
            mixer = layer.mixer
            inner = mixer.D.shape[0]
            for row in (*drop, *(inner + d for d in drop)):
                mixer.in_proj.weight[row] = 0
            for t in (mixer.conv1d.weight, mixer.conv1d.bias, mixer.dt_proj.weight, mixer.dt_proj.bias, mixer.D):
                t[drop] = 0
            mixer.A_log[drop] = 0
            mixer.x_proj.weight[:, drop] = 0
            mixer.out_proj.weight[:, drop] = 0
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_mamba_inner_channels_cut_by_hand_equal_the_shrunk_model_and_its_stock_reload():
    from transformers import AutoModelForCausalLM

    from lightning_pat.core.spec import resolve_clusters
    from lightning_pat.presets.ssm import mixers
    from lightning_pat.shrink.plan import build_plan
    from lightning_pat.shrink.surgery import apply_plan

    model = lm_zoo.build("mamba")
    inner = model.config.intermediate_size
    drop = list(range(1, inner, 2))  # every other channel: the x and z halves are cut alike
    clusters = mixers(model)
    assert {c.multiple_of for c in clusters} == {model.config.hidden_size}  # an int `expand`: whole hiddens kept
    resolved = resolve_clusters(model, clusters)
    assert [rc.num_units for rc in resolved] == [inner] * model.config.num_hidden_layers
    ids = lm_zoo.token_ids()
    reference = _logits(_zeroed(model, drop), ids)
    apply_plan(model, build_plan(resolved, {rc.name: drop for rc in resolved}))
    assert model.backbone.layers[0].mixer.in_proj.out_features == inner  # 2 * inner / 2
    assert (model.config.expand, model.config.intermediate_size) == (1, inner // 2)
    shrunk = _logits(model, ids)
    assert float((shrunk - reference).norm() / reference.norm()) < 1e-5
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        stock = AutoModelForCausalLM.from_pretrained(tmp).eval()
        assert float((_logits(stock, ids) - reference).norm() / reference.norm()) < 1e-5
        with torch.no_grad():
            stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)


def test_mamba2_groups_are_cut_whole_with_their_heads_and_config_fields():
    from lightning_pat.core.spec import resolve_clusters
    from lightning_pat.presets.ssm import mixers
    from lightning_pat.shrink.plan import build_plan
    from lightning_pat.shrink.surgery import apply_plan

    model = lm_zoo.build("mamba2")
    groups, heads = model.config.n_groups, model.config.num_heads
    resolved = resolve_clusters(model, mixers(model))
    assert [rc.num_units for rc in resolved] == [groups] * model.config.num_hidden_layers
    apply_plan(model, build_plan(resolved, {rc.name: list(range(groups // 2)) for rc in resolved}), check_zeros=False)
    mixer = model.backbone.layers[0].mixer
    assert (mixer.num_heads, mixer.n_groups, mixer.intermediate_size) == (heads // 2, groups // 2, heads // 2 * 16)
    assert (model.config.num_heads, model.config.n_groups, model.config.expand) == (heads // 2, groups // 2, 1)
    assert mixer.norm.group_size == mixer.intermediate_size // mixer.n_groups  # no rescale: whole groups


def test_a_mamba2_mixer_with_one_group_has_no_exact_unit():
    from lightning_pat.presets.ssm import mixers

    assert mixers(lm_zoo.build("mamba2", n_groups=1)) == []  # the gated norm spans every head


def test_target_params_keeps_widths_the_config_can_hold():
    from transformers import AutoModelForCausalLM

    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build("mamba")
    target = sum(p.numel() for p in model.parameters()) - lm_zoo.non_embedding_params(model) // 3
    calibration = [lm_zoo.token_ids(seed=s) for s in (2, 3)]
    result = prune_clusters(model, "auto", target_params=target, calibration=calibration)
    ids = lm_zoo.token_ids()
    masked = _logits(model, ids)
    small = shrink(model, result, example_input=None)
    assert small.config.expand == 1  # 2/3 of the body asked: 64 of 128 channels, not 85
    assert small.config.expand * small.config.hidden_size == small.backbone.layers[0].mixer.D.shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        small.save_pretrained(tmp)
        stock = AutoModelForCausalLM.from_pretrained(tmp).eval()
        assert float((_logits(stock, ids) - masked).norm() / masked.norm()) < 1e-4
