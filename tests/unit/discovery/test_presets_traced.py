"""On the families we have presets for, discovery finds the presets' units: the MLP clusters and the attention
head clusters are the same units (same members, slices and blocks; GQA: one unit per KV head and its query group),
and shrinking everything discovery found at 50% is exact. The differences, each explained and checked:

* MQA (one KV head): the preset declares a one-unit heads cluster (which no target below 1 may empty); discovery
  leaves those channels out (one unit; the KV head's channels sit on the within-head axis and flow into RoPE).
* The residual stream: the preset's opt-in ``residual`` cluster rescales RMSNorm on shrink; discovery leaves the
  stream out (RMSNorm / LayerNorm over it, and the LM head's vocabulary is the output).
"""

from __future__ import annotations

import pytest
import torch

from lightning_pat import discover, presets, prune_clusters, resolve_clusters, shrink
from tests.common.tiny_families import CASES, FamilyCase, logits, token_ids

pytest.importorskip("transformers")  # a guard only: the test extra installs it, so these tests run in CI


def _units(rc) -> frozenset:
    return frozenset((m.name, m.dim, m.start, m.stop, m.block) for m in rc.members)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_discovery_agrees_with_the_preset_on_mlps_and_heads(case: FamilyCase):
    model = case.build()
    found = discover(model, token_ids())
    discovered = {_units(rc) for rc in resolve_clusters(model, found.clusters)}
    preset = resolve_clusters(model, presets.get(case.preset)(model))
    mlps = {_units(rc) for rc in preset if rc.name.startswith("mlp")}
    heads = {_units(rc) for rc in preset if rc.name.startswith("heads")}
    assert len(mlps) == len(heads) == case.n_layer
    if case.n_kv > 1:
        assert discovered == mlps | heads
    else:  # MQA: a one-unit heads cluster in the preset, left out by discovery
        assert discovered == mlps
        assert all(min(stop - start for _, _, start, stop, _ in h) == case.head_dim for h in heads)  # one KV head
        left = {m.split("[")[0] for lo in found.left_out for m in lo.members}
        assert all(name in left for h in heads for name, *_ in h)
    reader = f"{case.layers}.0.{case.reads_residual[0]}.weight"  # reads the normed residual stream
    stream = [r for lo in found.left_out if reader in lo.members for r in lo.reasons]  # (MQA: q's rows too)
    assert any("normalises over this channel axis" in r or "`mean` reduces" in r for r in stream)  # RMS/LayerNorm


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_shrinking_what_discovery_found_is_exact(case: FamilyCase):
    model = case.fresh()
    ids = token_ids()
    found = discover(model, ids)
    result = prune_clusters(model, found.clusters, 0.5)
    masked = logits(model, ids)
    before = sum(p.numel() for p in model.parameters())
    small = shrink(model, result, inplace=False).eval()
    shrunk = logits(small, ids)
    assert float((shrunk - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in small.parameters()) < before
    if case.n_kv > 1:  # half of the KV heads (and their query groups) are gone
        attn = small.get_submodule(f"{case.layers}.0.{case.o.rsplit('.', 1)[0]}")
        o = small.get_submodule(f"{case.layers}.0.{case.o}")
        width = o.weight.shape[0] if type(o).__name__ == "Conv1D" else o.in_features
        assert width == case.n_head * case.head_dim // 2
        assert attn is not None
    assert torch.isfinite(shrunk).all()
