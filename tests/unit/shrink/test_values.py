"""ValueCut: the values of a cut computed owner by owner equal the whole-model shrink's (slices and RMSNorm rescale)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_pat import presets, resolve_clusters
from lightning_pat.shrink.plan import build_plan
from lightning_pat.shrink.surgery import apply_plan
from lightning_pat.shrink.values import ValueCut
from tests.distributed.workers.sharded_shrink import DROPPED, tiny_llama


@pytest.mark.parametrize("tied", [True, False])
def test_values_owner_by_owner_equal_the_whole_model_shrink_bitwise(tied):
    model = tiny_llama(tied=tied)
    clusters = resolve_clusters(model, presets.llama(model, residual=True, query_heads=False))
    plan = build_plan(clusters, DROPPED)
    full = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if n in plan.keep}
    values = ValueCut(model, plan)
    whole = apply_plan(copy.deepcopy(model), plan, check_zeros=False)
    want = dict(whole.named_parameters(remove_duplicate=False))
    layer = {n: t for n, t in full.items() if n.startswith("model.layers.0.")}  # one group at a time
    got = {**values.cut(layer), **values.cut({n: t for n, t in full.items() if n not in layer})}
    assert sorted(got) == sorted(full)
    for name, value in got.items():
        assert torch.equal(value, want[name].detach()), name
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(got[norm], full[norm][plan.keep[norm][0]])  # rescaled by sqrt(48 / 43), not only sliced
    assert model.model.layers[0].mlp.gate_proj.out_features == 40  # the model itself is not touched


def test_a_name_outside_the_plan_is_refused():
    model = tiny_llama()
    clusters = resolve_clusters(model, presets.llama(model, query_heads=False))
    values = ValueCut(model, build_plan(clusters, {"mlp.0": [1]}))
    with pytest.raises(ValueError, match=r"\['lm_head.weight'\] are not parameters the plan cuts"):
        values.cut({"lm_head.weight": torch.zeros(64, 48)})
