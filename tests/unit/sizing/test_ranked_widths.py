"""Non-uniform widths under a size target (``target_widths="ranked"``): the floored joint selection and the solver.

References: a brute-force search over every dropped set (the floored selection), a loop that takes chunks one at a
time (multiple_of > 1), every per-cluster width combination of a stack of equal blocks counted by hand (the solver),
and ``numel`` of the shrunk model (the count).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, presets, prune_clusters, resolve_clusters, shrink
from lightning_pat.core.selection import bottom_k_floored, bottom_k_shared
from lightning_pat.sizing.problem import parse_size, size_problem
from lightning_pat.sizing.solver import solve
from lightning_pat.sizing.targets import declaration_labels, distinct_shapes
from tests.common import tiny_families as fam


# ------------------------------------------------------------------------------ the floored joint selection
def test_without_floor_it_is_the_joint_bottom_k():
    gen = torch.Generator().manual_seed(0)
    scores = [torch.randint(0, 4, (n,), generator=gen).double() for n in (5, 3, 6)]  # many ties
    for num in range(15):
        got = bottom_k_floored(scores, num_drop=num, floors=[0, 0, 0], multiples=[1, 1, 1])
        want = bottom_k_shared(scores, num_drop=num)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_floored_selection_is_the_cheapest_drop_set():
    """multiple_of=1: the dropped set has the lowest score sum of all sets of that size that respect the floors."""
    gen = torch.Generator().manual_seed(1)
    sizes, floors = (4, 3, 4), (1, 2, 3)
    scores = [torch.rand(n, generator=gen, dtype=torch.float64) for n in sizes]
    units = [(c, u) for c, n in enumerate(sizes) for u in range(n)]
    for num in range(sum(sizes) - sum(floors) + 1):
        best, best_sum = None, None
        for subset in itertools.combinations(units, num):
            dropped = [sum(1 for c, _ in subset if c == k) for k in range(3)]
            if any(n - d < f for n, d, f in zip(sizes, dropped, floors, strict=True)):
                continue
            total = sum(float(scores[c][u]) for c, u in subset)
            if best_sum is None or total < best_sum:
                best, best_sum = subset, total
        got = bottom_k_floored(scores, num_drop=num, floors=list(floors), multiples=[1, 1, 1])
        assert sorted((c, u) for c, sel in enumerate(got) for u in sel.tolist()) == sorted(best)


def _chunks_one_by_one(scores, num_drop, floors, multiples):
    """Reference: repeatedly drop the next chunk whose highest score is lowest (ties: first cluster)."""
    kept = [s.numel() for s in scores]
    orders = [sorted(range(s.numel()), key=lambda i, s=s: (float(s[i]), i)) for s in scores]
    dropped_total = 0
    while True:
        best = None
        for c, (s, f, m) in enumerate(zip(scores, floors, multiples, strict=True)):
            nxt = (kept[c] - 1) // m * m
            if nxt < max(f, 1) or dropped_total + kept[c] - nxt > num_drop:
                continue
            score = float(s[orders[c][s.numel() - nxt - 1]])
            if best is None or score < best[0]:
                best = (score, c, nxt)
        if best is None:
            return [sorted(o[: s.numel() - k]) for o, s, k in zip(orders, scores, kept, strict=True)]
        _, c, nxt = best
        dropped_total += kept[c] - nxt
        kept[c] = nxt


@pytest.mark.parametrize("seed", range(4))
def test_chunks_of_multiple_of_against_a_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.rand(8, generator=gen, dtype=torch.float64) for _ in range(3)]
    floors, mults = [2, 4, 2], [2, 2, 2]
    for num in range(0, 24, 2):
        got = bottom_k_floored(scores, num_drop=num, floors=floors, multiples=mults)
        want = _chunks_one_by_one(scores, num, floors, mults)
        assert [g.tolist() for g in got] == want
        kept = [8 - len(g) for g in got]
        assert all(k >= f and k % 2 == 0 for k, f in zip(kept, floors, strict=True))
        assert sum(len(g) for g in got) == min(num, 24 - sum(floors))


# ------------------------------------------------------------------------------------ the solver, brute force
D, H, L = 3, 6, 3  # blocks D -> H -> D, L of them


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(L)])


def stack_count(widths) -> int:
    """Hand count: per block ``D*h + h`` (first Linear) and ``h*D + D`` (second)."""
    return sum(D * h + h + h * D + D for h in widths)


def stack_decl(mult: int = 1) -> Cluster:
    return Cluster("h.{i}", [r"re:(?P<i>\d+)\.0\.(?:weight|bias)"], [r"re:(?P<i>\d+)\.2\.weight"], multiple_of=mult)


@pytest.mark.parametrize(("mult", "min_kept"), [(1, 0.25), (2, 0.5), (3, 0.1)])
@pytest.mark.parametrize("side", ["below", "above"])
def test_ranked_solver_against_every_width_combination(mult, min_kept, side):
    model = stack()
    decl = stack_decl(mult)
    params = dict(model.named_parameters())
    shapes = distinct_shapes(params)
    resolved = resolve_clusters(model, decl)
    axes, groups, owners = size_problem(
        shapes, resolved, declared=declaration_labels(params, [decl]), ranked=True, min_kept=min_kept
    )
    (group,) = groups
    floor = min(H, max(mult, math.ceil(min_kept * H / mult) * mult))
    assert group.floor == floor
    widths = [H] + [k for k in range(H - 1, 0, -1) if k % mult == 0 and k >= floor]
    counts = sorted({stack_count(c) for c in itertools.product(widths, repeat=L)})
    for target in range(counts[0], counts[-1] + 1):
        sol = solve(shapes, axes, groups, target=target, side=side, owners=owners)
        if side == "below":
            assert sol.achieved == max(c for c in counts if c <= target)
        else:
            assert sol.achieved == min(c for c in counts if c >= target)
        assert sol.achieved == L * D + (2 * D + 1) * sol.kept["h"]  # the total decides the count
    with pytest.raises(ValueError, match="below the smallest size"):
        solve(shapes, axes, groups, target=counts[0] - 1, owners=owners)


def test_ranked_prune_clusters_follows_the_scores_and_counts_exactly():
    """Block 0 has large weights: it keeps more units than the others; the shrunk model has the solved size."""
    model = stack()
    with torch.no_grad():
        for p in model[0].parameters():
            p.mul_(10)
    res = prune_clusters(model, stack_decl(), target_params=100, target_widths="ranked", min_kept=0.5)
    kept = {name: H - len(d) for name, d in res.dropped.items()}
    assert res.size.achieved == 100 == stack_count([6, 4, 3])  # 13 units kept, 3 each at least
    assert kept["h.0"] == H
    assert sorted([kept["h.1"], kept["h.2"]]) == [3, 4]
    assert sum(kept.values()) == res.size.kept["h"]
    shrink(model, res)
    assert sum(p.numel() for p in model.parameters()) == res.size.achieved == stack_count(kept.values())


def test_a_declared_budget_is_one_ranked_group():
    """Two declarations in one budget compete for one total; the count is exact."""
    model = stack()
    decls = [
        Cluster("a", ["0.0.weight", "0.0.bias"], ["0.2.weight"], budget="b"),
        Cluster("c", ["1.0.weight", "1.0.bias"], ["1.2.weight"], budget="b"),
    ]
    with torch.no_grad():
        model[1][2].weight.mul_(10)
    res = prune_clusters(model, decls, target_params=stack_count([6, 3, 6]), target_widths="ranked", min_kept=0.5)
    assert res.size.kept == {"b": 9}
    assert {k: H - len(v) for k, v in res.dropped.items()} == {"a": 3, "c": 6}
    shrink(model, res)
    assert sum(p.numel() for p in model.parameters()) == res.size.achieved == stack_count([6, 3, 6])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.usefixtures("single_thread")
def test_ranked_llama_counts_exactly(residual):
    case = fam.llama_like("llama", n_head=4, n_kv=2, tied=True, n_layer=3)
    model = case.fresh()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(5)  # layer 1's MLP units score higher
    total = sum(p.numel() for p in model.parameters())
    decls = presets.llama(model, residual=residual)
    res = prune_clusters(model, decls, target_params=0.7, target_widths="ranked")
    ff = case.ff
    mlp = [ff - len(res.dropped[f"mlp.{i}"]) for i in range(3)]
    assert len(set(mlp)) > 1
    assert mlp[1] == max(mlp)
    assert min(mlp) >= ff // 4
    assert res.size.achieved <= parse_size(0.7, total=total)
    shrink(model, res)
    assert sum(p.numel() for p in model.parameters()) == res.size.achieved


def test_ranked_clusters_must_carry_equal_units():
    """Same C, different parameters per unit (the second block reads into 4 outputs, not 3): refused."""
    model = nn.Sequential(
        nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)),
        nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D + 1)),
    )
    with pytest.raises(ValueError, match=r"clusters of 'h' carry different parameters per unit \{'h.0': 7, 'h.1': 8\}"):
        prune_clusters(model, stack_decl(), target_params=0.8, target_widths="ranked")


def test_ranked_refusals():
    model = stack()
    llama = fam.llama_like("llama", n_head=4, n_kv=2, n_layer=2).fresh()
    with pytest.raises(ValueError, match="a dropped layer takes its units with it"):
        prune_clusters(llama, presets.llama(llama, layers=True), target_params=0.6, target_widths="ranked")
    with pytest.raises(ValueError, match=r"`min_kept` .* must be in \(0, 1\]"):
        prune_clusters(model, stack_decl(), target_params=0.6, target_widths="ranked", min_kept=0.0)
    with pytest.raises(ValueError, match="set target_widths='ranked' too"):
        prune_clusters(model, stack_decl(), target_params=0.6, min_kept=0.5)
    with pytest.raises(ValueError, match="not a multiple of multiple_of=4"):
        prune_clusters(model, stack_decl(4), target_params=0.6, target_widths="ranked")
    with pytest.raises(ValueError, match="`target_widths` must be one of"):
        prune_clusters(model, stack_decl(), target_params=0.6, target_widths="mixed")
    assert all(bool(p.ne(0).any()) for p in model.parameters())  # nothing mutated


@pytest.mark.usefixtures("single_thread")
def test_ranked_tiny_gpt_module_format_round_trip(tmp_path):
    """A non-Hugging Face model: the module export (safetensors + sizes) keeps the per-layer widths."""
    from lightning_pat import load_pretrained, save_pretrained

    case = fam.tiny_gpt(n_head=4, n_kv=2, n_layer=3)
    model = case.fresh()
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(5)
    res = prune_clusters(model, presets.get(case.preset)(model), target_params=0.65, target_widths="ranked")
    ids = fam.token_ids()
    ref = fam.logits(model, ids)
    shrink(model, res)
    widths = [layer.mlp.down_proj.in_features for layer in model.layers]
    assert len(set(widths)) > 1
    assert sum(p.numel() for p in model.parameters()) == res.size.achieved
    save_pretrained(model, tmp_path)
    again = load_pretrained(tmp_path)
    assert [layer.mlp.down_proj.in_features for layer in again.layers] == widths
    out = fam.logits(again, ids)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
