"""GQA query heads inside their KV groups (``unit_groups``): the balanced selection, the presets, the shrink, discovery.

References: brute force over every balanced dropped set (the cheapest), a chunk-by-chunk loop (the floored joint
selection with groups), the dead o_proj input columns of a forward (what is pruned), the masked model's logits (the
shrink and the stock ``from_pretrained`` reload) and ``numel`` of the shrunk model (the size solver's count).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, discover, presets, prune_clusters, resolve_clusters, save_pretrained, shrink
from lightning_pat.core.masking import zero_units_
from lightning_pat.core.selection import bottom_k_balanced, bottom_k_floored, elimination_order
from lightning_pat.core.spec import ResolvedCluster
from tests.common import tiny_families as fam

GQA = [c for c in fam.CASES if c.preset != "gpt2" and c.preset != "tiny_gpt" and 1 < c.n_kv < c.n_head]
MHA = [c for c in fam.CASES if c.preset in ("llama", "mistral") and c.n_kv == c.n_head]


# ---------------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("seed", range(3))
def test_balanced_selection_is_the_cheapest_balanced_set(seed):
    """In every group the same count goes; the set has the lowest score sum of all such sets (ties: lower index)."""
    gen = torch.Generator().manual_seed(seed)
    groups, per = 3, 3
    scores = torch.randint(0, 3, (groups * per,), generator=gen).double()  # many ties
    for k in range(per + 1):
        subsets = [
            sum(combo, ())
            for combo in itertools.product(
                *(itertools.combinations(range(g * per, (g + 1) * per), k) for g in range(groups))
            )
        ]
        best = min(subsets, key=lambda s: (sum(float(scores[i]) for i in s), sorted(s)))
        got = bottom_k_balanced(scores, num_drop=k * groups, groups=groups)
        assert got.tolist() == sorted(best)
    stacked = torch.stack([scores, scores.flip(0)])
    rows = bottom_k_balanced(stacked, num_drop=3, groups=groups)
    assert rows.tolist() == [bottom_k_balanced(s, num_drop=3, groups=groups).tolist() for s in stacked]


def test_balanced_selection_refuses_an_unbalanced_count():
    with pytest.raises(ValueError, match=r"3 groups must divide the 9 units and the 2 dropped"):
        bottom_k_balanced(torch.zeros(9), num_drop=2, groups=3)


def test_elimination_order_prefixes_are_the_balanced_selections():
    gen = torch.Generator().manual_seed(4)
    scores = torch.rand(12, generator=gen, dtype=torch.float64)
    order = elimination_order(scores, groups=3)
    assert sorted(order.tolist()) == list(range(12))
    for k in range(0, 13, 3):
        assert sorted(order[:k].tolist()) == bottom_k_balanced(scores, num_drop=k, groups=3).tolist()
    assert torch.equal(elimination_order(scores), torch.sort(scores, stable=True).indices)


def _balanced_chunks_one_by_one(scores, num_drop, floors, multiples, groups):
    """Reference: repeatedly drop the next chunk (its units: the next lowest of every group, ``multiple_of / groups``
    rounds) whose highest score is lowest (ties: first cluster), until that chunk would exceed ``num_drop``."""
    kept = [s.numel() for s in scores]
    rounds = []  # per cluster, the units of each round: the r-th lowest of every group
    for s, g in zip(scores, groups, strict=True):
        per = s.numel() // g
        orders = [sorted(range(j * per, (j + 1) * per), key=lambda i, s=s: (float(s[i]), i)) for j in range(g)]
        rounds.append([[o[r] for o in orders] for r in range(per)])
    dropped_total = 0
    while True:
        best = None
        for c, (s, f, m, g) in enumerate(zip(scores, floors, multiples, groups, strict=True)):
            nxt = (kept[c] - 1) // m * m
            if nxt < max(f, 1):
                continue
            done = (s.numel() - kept[c]) // g
            units = [u for r in rounds[c][done : done + (kept[c] - nxt) // g] for u in r]
            score = max(float(s[u]) for u in units)
            if best is None or score < best[0]:
                best = (score, c, nxt)
        if best is None or dropped_total + kept[best[1]] - best[2] > num_drop:
            return [
                sorted(u for r in rd[: (s.numel() - k) // g] for u in r)
                for rd, s, k, g in zip(rounds, scores, kept, groups, strict=True)
            ]
        _, c, nxt = best
        dropped_total += kept[c] - nxt
        kept[c] = nxt


@pytest.mark.parametrize("seed", range(4))
def test_floored_joint_selection_with_groups_against_a_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.rand(9, generator=gen, dtype=torch.float64) for _ in range(2)] + [
        torch.rand(8, generator=gen, dtype=torch.float64)
    ]
    floors, mults, groups = [3, 3, 2], [3, 3, 1], [3, 3, 1]
    for num in range(0, 20):
        got = bottom_k_floored(scores, num_drop=num, floors=floors, multiples=mults, groups=groups)
        want = _balanced_chunks_one_by_one(scores, num, floors, mults, groups)
        assert [g.tolist() for g in got] == want, num
        for sel, g, s in zip(got[:2], groups[:2], scores[:2], strict=True):  # balanced: the same count in every group
            per = s.numel() // g
            assert len({sum(1 for u in sel.tolist() if u // per == j) for j in range(g)}) == 1


# ---------------------------------------------------------------------------------------------------- declarations
def test_unit_groups_is_checked_and_round_trips():
    model = nn.Sequential(nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 4))
    decl = Cluster("h", ["0.weight", "0.bias"], ["2.weight"], num_units=6, unit_groups=3)
    [rc] = resolve_clusters(model, decl)
    assert (rc.unit_groups, rc.multiple_of) == (3, 3)
    assert ResolvedCluster.from_dict(rc.to_dict()) == rc
    plain = resolve_clusters(model, dataclasses.replace(decl, unit_groups=1))[0]
    assert "unit_groups" not in plain.to_dict()
    assert plain.fingerprint() != rc.fingerprint()
    assert resolve_clusters(model, dataclasses.replace(decl, multiple_of=2))[0].multiple_of == 6  # lcm
    with pytest.raises(ValueError, match=r"Cluster 'h': `unit_groups=4` does not divide its 6 units"):
        resolve_clusters(model, dataclasses.replace(decl, unit_groups=4))
    for bad in (0, 1.5, None, True):
        with pytest.raises(ValueError, match=r"Cluster 'h': `unit_groups` must be a positive int"):
            resolve_clusters(model, dataclasses.replace(decl, unit_groups=bad))


def test_prune_clusters_drops_the_same_count_per_group():
    model = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 4))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(1.0, 10.0)[:, None].expand(9, 4))  # row norms rise with the index
    result = prune_clusters(model, Cluster("h", ["0.weight"], ["2.weight"], unit_groups=3), 0.3, score="rms")
    assert result.dropped["h"] == [0, 3, 6]  # one per group (ceil(2.7) = 3 is already a multiple of 3)
    with pytest.raises(ValueError, match=r"every unit of 1 cluster"):
        prune_clusters(model, Cluster("h", ["0.weight"], ["2.weight"], unit_groups=9), 0.5, score="rms")


# ---------------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("case", GQA, ids=lambda c: c.id)
def test_query_head_units_resolve_prune_dead_and_shrink_to_a_stock_model(case, tmp_path):
    import transformers

    model = case.fresh()
    decls = presets.get(case.preset)(model, query_heads=True)
    by_name = {rc.name: rc for rc in resolve_clusters(model, decls)}
    heads = by_name["heads.0"]
    assert (heads.num_units, heads.unit_groups) == (case.n_head, case.n_kv)
    assert {m.name.rsplit(".", 2)[-2] for m in heads.members} == {"q_proj", "o_proj"}  # k/v in no cluster
    assert {m.block for m in heads.members} == {case.head_dim}
    ids = fam.token_ids()
    kv_before = {n: p.clone() for n, p in model.named_parameters() if ".k_proj." in n or ".v_proj." in n}
    result = prune_clusters(model, decls, 0.5, score="rms")
    rep = case.n_head // case.n_kv
    kept_per_group = rep - -(-rep // 2)  # ceil(rep / 2) dropped per group
    for i in range(case.n_layer):
        dropped = result.dropped[f"heads.{i}"]
        assert [sum(1 for h in dropped if h // rep == g) for g in range(case.n_kv)] == [
            rep - kept_per_group
        ] * case.n_kv
        attn = model.get_submodule(f"{case.layers}.{i}.{case.o}".rsplit(".", 1)[0])
        channels = torch.zeros(case.n_head * case.head_dim, dtype=torch.bool)
        for h in dropped:
            channels[h * case.head_dim : (h + 1) * case.head_dim] = True
        # a dropped query head still returns the mean of its values; its zero o_proj columns make it dead
        assert bool((attn.o_proj.weight[:, channels] == 0).all())
        assert bool((attn.q_proj.weight[channels] == 0).all())
        assert bool((attn.o_proj.weight[:, ~channels] != 0).all())
        if attn.q_proj.bias is not None:
            assert bool((attn.q_proj.bias[channels] == 0).all())
    assert all(torch.equal(p, kv_before[n]) for n, p in model.named_parameters() if n in kv_before)
    masked = fam.logits(model, ids)
    small = shrink(model, result)
    assert torch.allclose(fam.logits(small, ids), masked, rtol=1e-5, atol=1e-6)
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (
        case.n_kv * kept_per_group,
        case.n_kv,
    )
    save_pretrained(small, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.allclose(fam.logits(reloaded, ids), masked, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", MHA, ids=lambda c: c.id)
def test_without_gqa_query_heads_are_the_head_units(case):
    model = case.fresh()
    assert presets.get(case.preset)(model, query_heads=True) == presets.get(case.preset)(model, query_heads=False)


def test_an_unbalanced_selection_is_refused_by_the_shrink_before_anything_changes():
    case = GQA[0]
    model = case.fresh()
    [heads] = [c for c in presets.llama(model, query_heads=True) if c.name.startswith("heads")]
    unbalanced = dataclasses.replace(heads, unit_groups=1)  # the plain bottom-k can take two heads of one group
    rc = resolve_clusters(model, unbalanced)
    dropped = {r.name: [0, 1] for r in rc}  # both query heads of KV group 0
    with torch.no_grad():  # the mask in the weights, as a checkpoint of the run holds it
        for r in rc:
            for m in r.members:
                zero_units_(model.get_parameter(m.name), m, torch.tensor(dropped[r.name]), num_units=r.num_units)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"keep \[0, 2\] heads of the 2 KV groups .* the same number in every group"):
        shrink(model, {"clusters": [r.to_dict() for r in rc], "dropped": dropped})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("widths", ["uniform", "ranked"])
def test_target_params_counts_query_heads_exactly(widths):
    case = next(c for c in GQA if c.n_layer == 3)
    model = case.fresh()
    result = prune_clusters(model, presets.llama(model, query_heads=True), target_params=0.8, target_widths=widths)
    heads = [len(v) for k, v in result.dropped.items() if k.startswith("heads")]
    assert all(d % case.n_kv == 0 for d in heads)
    small = shrink(model, result)
    assert sum(p.numel() for p in small.parameters()) == result.size.achieved <= result.size.target


# ---------------------------------------------------------------------------------------------------- discovery
@pytest.mark.slow
def test_discovery_cuts_transformers_gqa_by_query_heads_and_custom_attention_by_groups():
    case = GQA[0]
    model = case.fresh()
    ids = fam.token_ids()
    found = discover(model, {"input_ids": ids}, query_heads=True)
    attn = [c for c in found.clusters if c.name.endswith("q_proj")]
    assert len(attn) == case.n_layer
    assert all(c.num_units == case.n_head and c.unit_groups == case.n_kv for c in attn)
    assert all(not any(".k_proj." in w or ".v_proj." in w for w in c.writers) for c in attn)
    groups = [c for c in discover(model, {"input_ids": ids}, query_heads=False).clusters if c.name.endswith("q_proj")]
    assert all(c.num_units == case.n_kv and c.unit_groups == 1 for c in groups)
    masked_result = prune_clusters(model, found.clusters, 0.5, score="rms")
    masked = fam.logits(model, ids)
    small = shrink(model, masked_result)
    assert torch.allclose(fam.logits(small, ids), masked, rtol=1e-5, atol=1e-6)


class _CustomGQA(nn.Module):
    """Llama-named projections and GQA, but the repeat count is hard-coded: not a transformers attention."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim, self.num_key_value_groups = 3, 2
        self.q_proj, self.k_proj = nn.Linear(8, 12), nn.Linear(8, 6)
        self.v_proj, self.o_proj = nn.Linear(8, 6), nn.Linear(12, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, 3).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def test_discovery_keeps_whole_query_groups_of_a_custom_attention():
    [cluster] = discover(_CustomGQA(), torch.zeros(2, 3, 8), query_heads=True).clusters
    assert (cluster.num_units, cluster.unit_groups) == (2, 1)
    assert "k_proj.weight" in cluster.writers


def test_query_heads_refuse_layers_with_different_kv_head_counts():
    case = next(c for c in GQA if c.n_layer == 3)
    model = case.fresh()
    result = prune_clusters(model, presets.llama(model), target_params=0.7, target_widths="ranked", min_kept=0.5)
    small = shrink(model, result)
    counts = {layer.self_attn.k_proj.out_features // case.head_dim for layer in small.model.layers}
    assert len(counts) > 1  # the ranked KV groups differ between layers
    with pytest.raises(ValueError, match=r"query_heads=True\): the layers have different KV head counts"):
        presets.llama(small, query_heads=True)
    assert presets.llama(small, query_heads=False)  # whole groups still work
