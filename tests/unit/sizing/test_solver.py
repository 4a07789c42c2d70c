"""The size solver (:mod:`lightning_pat.sizing.solver`) against brute force, and ``target_params`` in
``prune_clusters``.

References written here: the parameter count of a chain of ``nn.Linear`` from its widths (``in * out + out``), every
configuration enumerated with ``itertools.product``, the water-filling path rebuilt as a greedy loop, and the
shrunk model's own ``sum(p.numel())``.
"""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, presets, prune_clusters, resolve_clusters, shrink
from lightning_pat.sizing.problem import Group, parse_size, size_problem
from lightning_pat.sizing.solver import count_params, solve
from lightning_pat.sizing.targets import declaration_labels, distinct_shapes
from tests.common import tiny_families as fam

# ------------------------------------------------------------------------------------------- a chain, brute force
WIDTHS = (5, 6, 4, 3)  # in, hidden 1, hidden 2, out


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTHS[0], WIDTHS[1]), nn.ReLU(), nn.Linear(WIDTHS[1], WIDTHS[2]), nn.ReLU(),
        nn.Linear(WIDTHS[2], WIDTHS[3]),
    )  # fmt: skip


def chain_count(h1: int, h2: int) -> int:
    """The independent reference: a Linear chain with hidden widths ``h1``, ``h2`` (weights and biases)."""
    dims = (WIDTHS[0], h1, h2, WIDTHS[3])
    return sum(dims[i] * dims[i + 1] + dims[i + 1] for i in range(3))


def chain_problem(mult1: int = 1, mult2: int = 1):
    model = chain()
    decls = [
        Cluster("h1", ["0.weight", "0.bias"], ["2.weight"], multiple_of=mult1),
        Cluster("h2", ["2.weight", "2.bias"], ["4.weight"], multiple_of=mult2),
    ]
    resolved = resolve_clusters(model, decls)
    shapes = distinct_shapes(dict(model.named_parameters()))
    axes, groups, owners = size_problem(shapes, resolved, declared={"h1": "h1", "h2": "h2"})
    return shapes, axes, groups, owners


def test_count_matches_the_chain_formula_everywhere():
    shapes, axes, _, _ = chain_problem()
    for h1, h2 in itertools.product(range(WIDTHS[1] + 1), range(WIDTHS[2] + 1)):
        assert count_params(shapes, axes, {"h1": h1, "h2": h2}) == chain_count(h1, h2)


def greedy_path(sizes: list[int], mults: list[int]) -> list[tuple[int, ...]]:
    """Reference path: repeatedly take one granule from the group with the highest kept fraction (first on ties)."""
    kept = list(sizes)
    out = [tuple(kept)]
    while True:
        best = None
        for g, (k, c, m) in enumerate(zip(kept, sizes, mults, strict=True)):
            nxt = (k - 1) // m * m
            if nxt >= m and (best is None or k / c > kept[best] / sizes[best]):
                best = g
        if best is None:
            return out
        kept[best] = (kept[best] - 1) // mults[best] * mults[best]
        out.append(tuple(kept))


def reachable(size: int, mult: int) -> list[int]:
    """Kept widths a cluster can have: all of it, or a positive multiple of ``mult`` below it."""
    return [size] + [k for k in range(size - 1, 0, -1) if k % mult == 0]


@pytest.mark.parametrize(("mult1", "mult2"), [(1, 1), (2, 1), (3, 2)])
@pytest.mark.parametrize("side", ["below", "above"])
def test_solver_against_brute_force(mult1, mult2, side):
    """Every target between the smallest and the full size, against all configurations enumerated here."""
    shapes, axes, groups, _ = chain_problem(mult1, mult2)
    path = greedy_path([WIDTHS[1], WIDTHS[2]], [mult1, mult2])
    counts = [chain_count(*cfg) for cfg in path]
    assert counts == sorted(counts, reverse=True)
    r1, r2 = reachable(WIDTHS[1], mult1), reachable(WIDTHS[2], mult2)
    configs = {(h1, h2): chain_count(h1, h2) for h1 in r1 for h2 in r2}
    total, minimum = chain_count(WIDTHS[1], WIDTHS[2]), min(configs.values())

    def neighbours(h1: int, h2: int, step: int) -> list[int]:
        out = []
        for values, pos, other in ((r1, 0, h2), (r2, 1, h1)):
            i = values.index((h1, h2)[pos]) - step
            if 0 <= i < len(values):
                out.append(configs[(values[i], other) if pos == 0 else (other, values[i])])
        return out

    for target in range(minimum, total + 1):
        sol = solve(shapes, axes, groups, target=target, side=side)
        kept = (sol.kept["h1"], sol.kept["h2"])
        assert sol.achieved == configs[kept]
        assert (sol.total, sol.minimum) == (total, minimum)
        ups, downs = neighbours(*kept, 1), neighbours(*kept, -1)
        if side == "below":
            on_path = next(c for c in counts if c <= target)
            best = max(c for c in configs.values() if c <= target)
            assert on_path <= sol.achieved <= target  # the path's choice, then the slack filled
            assert all(c > target for c in ups)  # no granule fits any more
            assert best - sol.achieved < min(ups, default=best + 1) - sol.achieved  # within one granule of the best
            assert sol.below == sol.achieved
            assert sol.above == min((c for c in ups if c > target), default=None)
        else:
            on_path = min(c for c in counts if c >= target)
            best = min(c for c in configs.values() if c >= target)
            assert target <= sol.achieved <= on_path
            assert all(c < target for c in downs)
            assert sol.achieved - best < sol.achieved - max(downs, default=best - 1)
            assert sol.above == sol.achieved or sol.achieved == target


def test_one_group_is_the_best_of_all_widths():
    """With one cluster, every kept width is on the path: the solution is the brute-force optimum."""
    model = nn.Sequential(nn.Linear(3, 10), nn.ReLU(), nn.Linear(10, 2))
    resolved = resolve_clusters(model, Cluster("h", ["0.weight", "0.bias"], ["2.weight"], multiple_of=3))
    shapes = distinct_shapes(dict(model.named_parameters()))
    axes, groups, _ = size_problem(shapes, resolved)

    def count(h):
        return 3 * h + h + h * 2 + 2

    reachable = [10, 9, 6, 3]  # full, then multiples of 3 (never zero)
    for target in range(count(3), count(10) + 1):
        best = max(h for h in reachable if count(h) <= target)
        assert solve(shapes, axes, groups, target=target).kept == {"h": best}


def test_refusals_name_the_numbers():
    shapes, axes, groups, _ = chain_problem(2, 2)
    minimum = chain_count(2, 2)
    with pytest.raises(ValueError, match=rf"below the smallest size .*\({minimum:,}.*multiple_of=2"):
        solve(shapes, axes, groups, target=minimum - 1)
    with pytest.raises(ValueError, match="above the model's size"):
        solve(shapes, axes, groups, target=chain_count(6, 4) + 1)
    with pytest.raises(ValueError, match="target_side"):
        solve(shapes, axes, groups, target=minimum, side="middle")  # type: ignore[arg-type]


def test_fixed_group_keeps_its_target():
    shapes, axes, _, _ = chain_problem()
    groups = [Group("h1", ("h1",), 6), Group("h2", ("h2",), 4, fixed=2)]
    sol = solve(shapes, axes, groups, target=chain_count(3, 2))
    assert sol.kept == {"h1": 3, "h2": 2}


# ------------------------------------------------------------------------- real models: count == shrunk model
CASES = [
    fam.llama_like("llama", n_head=4, n_kv=2, tied=True),
    fam.llama_like("qwen2", n_head=4, n_kv=2),
    fam.gpt2(n_head=4),
]


def _param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # distinct tensors: a tied embedding once


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.usefixtures("single_thread")
def test_count_model_matches_shrink(case, residual):
    """For a few kept widths, the solver's count equals the shrunk model's parameter count."""
    model = case.fresh()
    decls = presets.get(case.preset)(model, residual=residual)
    resolved = resolve_clusters(model, decls)
    params = dict(model.named_parameters(remove_duplicate=False))
    shapes = distinct_shapes(params)
    axes, groups, _ = size_problem(shapes, resolved, declared=declaration_labels(params, decls))
    assert sorted(g.name for g in groups) == sorted(_label(d.name) for d in decls)
    assert count_params(shapes, axes, {}) == _param_count(model)
    by_group = {g.name: g for g in groups}
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):
        kept = {g.name: int(torch.randint(1, g.num_units + 1, (), generator=rng)) for g in groups}
        per_cluster = {c: kept[g.name] for g in groups for c in g.clusters}
        declared = [Cluster(**{**d.__dict__, "target": 1 - kept[_label(d.name)] / by_group[_label(d.name)].num_units})
                    for d in decls]  # fmt: skip
        small = case.fresh()
        res = prune_clusters(small, declared, 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a GPT-2 residual (LayerNorm) shrink is not exact; the count is
            shrink(small, res)
        assert _param_count(small) == count_params(shapes, axes, per_cluster)


def _label(name: str) -> str:
    return re.sub(r"\.?\{layer\}", "", name)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.id)
@pytest.mark.parametrize("target", [0.6, "5k", 0.9])
def test_prune_clusters_target_params_then_shrink(case, target):
    model = case.fresh()
    total = _param_count(model)
    res = prune_clusters(model, presets.get(case.preset)(model, residual=True), target_params=target)
    assert res.size is not None
    asked = parse_size(target, total=total)
    assert (res.size.total, res.size.target) == (total, asked)
    assert res.size.achieved <= asked
    assert res.size.above is None or res.size.above > asked
    shrink(model, res)
    assert _param_count(model) == res.size.achieved


def test_prune_clusters_needs_exactly_one_size():
    model = chain()
    decl = Cluster("h1", ["0.weight", "0.bias"], ["2.weight"])
    with pytest.raises(ValueError, match="exactly one of them"):
        prune_clusters(model, decl)
    with pytest.raises(ValueError, match="below the smallest size"), pytest.warns(UserWarning, match="unused"):
        prune_clusters(model, decl, 0.5, target_params=10)  # the size target wins (as in the callback), and warns
    with pytest.raises(ValueError, match="below the smallest size"):
        prune_clusters(model, decl, target_params=10)
    assert all(bool(p.ne(0).any()) for p in model.parameters())  # nothing mutated


def test_a_shared_budget_is_refused_with_a_size_target():
    model = chain()
    decls = [
        Cluster("h1", ["0.weight", "0.bias"], ["2.weight"], budget="b"),
        Cluster("h2", ["2.weight", "2.bias"], ["4.weight"], budget="b"),
    ]
    with pytest.raises(ValueError, match=r"Cluster 'h1' shares budget 'b': uniform widths cannot follow a shared"):
        prune_clusters(model, decls, target_params=0.8)
    with pytest.raises(ValueError, match=r"clusters of 'b' .* differ in units or multiple_of \[\(4, 1\), \(6, 1\)\]"):
        prune_clusters(model, decls, target_params=0.8, target_widths="ranked")
