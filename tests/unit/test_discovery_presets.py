"""On the families we have presets for, discovery agrees with the preset where it can see, and says why not
elsewhere: the MLP clusters are the same units (same members, slices and blocks); attention heads (a channel axis
reshaped into heads) are left out with that reason; the residual stream is left out (RMSNorm / LayerNorm over it,
and the LM head's vocabulary is the output)."""

from __future__ import annotations

import pytest

from lightning_pat import discover, presets, resolve_clusters
from tests.common.tiny_families import CASES, FamilyCase, token_ids

pytest.importorskip("transformers")  # a guard only: the test extra installs it, so these tests run in CI


def _units(rc) -> frozenset:
    return frozenset((m.name, m.dim, m.start, m.stop, m.block) for m in rc.members)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_discovery_agrees_with_the_preset_on_mlps_and_explains_heads(case: FamilyCase):
    model = case.build()
    found = discover(model, token_ids())
    discovered = {_units(rc) for rc in resolve_clusters(model, found.clusters)}
    preset = resolve_clusters(model, presets.get(case.preset)(model))
    mlps = {_units(rc) for rc in preset if rc.name.startswith("mlp")}
    heads = [rc for rc in preset if rc.name.startswith("heads")]
    assert len(mlps) == case.n_layer
    assert discovered == mlps
    assert heads
    assert all(_units(rc) not in discovered for rc in heads)
    reasons = {r for lo in found.left_out for r in lo.reasons}
    # Llama-style: q/k/v rows reshaped into heads; GPT-2: the packed c_attn split into q, k, v first
    assert any("split into several axes (e.g. attention heads)" in r or "`split`" in r for r in reasons)
    # every q_proj / c_attn row is accounted for in the report, never in a cluster
    left = {m.split("[")[0] for lo in found.left_out for m in lo.members}
    assert all(m.name in left for rc in heads for m in rc.members if m.role == "writer" and m.name.endswith("weight"))
