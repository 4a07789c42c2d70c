"""The size solver by importance (``costs``): against brute force, against the engine's selection, and on a model.

References written here: the parameter count of independent two-layer blocks (``2 * d * h`` each), every width
configuration enumerated with ``itertools.product`` and its cost (the sum of the cheapest removed units' costs, per
block), the floored joint selection of the engine (:func:`bottom_k_floored`) for ranked widths, and the shrunk
model's ``sum(p.numel())``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, presets, prune_clusters, resolve_clusters, shrink
from lightning_pat.core.selection import bottom_k_floored
from lightning_pat.scoring.activation import calibrate
from lightning_pat.sizing.problem import Group
from lightning_pat.sizing.solver import count_params, elimination_order, solve
from lightning_pat.sizing.targets import unit_costs
from tests.common import tiny_families as fam

#: independent blocks: (name, in/out width d, hidden width h, multiple_of)
BLOCKS = (("a", 3, 6, 1), ("b", 5, 5, 2), ("c", 2, 7, 3))


def blocks_problem(seed: int):
    shapes, axes, groups, costs = {}, {}, [], {}
    gen = torch.Generator().manual_seed(seed)
    for name, d, h, mult in BLOCKS:
        shapes[f"{name}.up"], shapes[f"{name}.down"] = (h, d), (d, h)
        axes[(f"{name}.up", 0)] = [(name, 1, h)]
        axes[(f"{name}.down", 1)] = [(name, 1, h)]
        groups.append(Group(name, (name,), num_units=h, multiple_of=mult))
        costs[name] = (torch.rand(h, generator=gen, dtype=torch.float64) * (1 + 3 * gen.initial_seed() % 2)).tolist()
    return shapes, axes, groups, costs


def reachable(h: int, mult: int) -> list[int]:
    return [h] + [k for k in range(h - 1, 0, -1) if k % mult == 0]


def config_cost(costs: dict[str, list[float]], kept: dict[str, int]) -> float:
    return sum(sum(sorted(costs[name])[: len(costs[name]) - k]) for name, k in kept.items())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("side", ["below", "above"])
def test_importance_solver_against_brute_force(seed, side):
    """Separable blocks: every target's answer is on its side, its cost and count are those of its configuration, no
    granule fits into the slack, and the brute-force optimum bounds its cost from below."""
    shapes, axes, groups, costs = blocks_problem(seed)
    names = [b[0] for b in BLOCKS]
    configs = {}
    for widths in itertools.product(*(reachable(h, m) for _, _, h, m in BLOCKS)):
        kept = dict(zip(names, widths, strict=True))
        count = sum(2 * d * k for (_, d, _, _), k in zip(BLOCKS, widths, strict=True))
        assert count_params(shapes, axes, kept) == count  # the solver's count model, against the formula
        configs[widths] = (count, config_cost(costs, kept))
    total = count_params(shapes, axes, {})
    minimum = min(c for c, _ in configs.values())
    for target in range(minimum, total + 1):
        sol = solve(shapes, axes, groups, target=target, side=side, costs=costs)
        kept = tuple(sol.kept[n] for n in names)
        count, cost = configs[kept]
        assert sol.rule == "importance"
        assert sol.achieved == count
        assert math.isclose(sol.cost, cost, rel_tol=1e-9, abs_tol=1e-12)
        if side == "below":
            assert count <= target
            best = min(c for n, c in configs.values() if n <= target)
            # one granule of any group added back would not fit (the slack is filled)
            for g, (_, d, h, mult) in enumerate(BLOCKS):
                values = reachable(h, mult)
                i = values.index(kept[g])
                if i > 0:
                    assert count + 2 * d * (values[i - 1] - kept[g]) > target
        else:
            assert count >= target
            best = min(c for n, c in configs.values() if n >= target)
        assert cost >= best - 1e-12  # the brute-force optimum is a lower bound (reached on the path: next test)


def test_the_path_points_are_the_cheapest_configurations():
    """Granules in increasing cost per parameter (one unit granules, independent blocks): after every step of the path,
    no configuration with at most as many parameters costs less."""
    shapes, axes, _, costs = blocks_problem(7)
    groups = [Group(n, (n,), num_units=h, multiple_of=1) for n, _, h, _ in BLOCKS]
    names = [b[0] for b in BLOCKS]
    configs = {}
    for widths in itertools.product(*(range(1, h + 1) for _, _, h, _ in BLOCKS)):
        kept = dict(zip(names, widths, strict=True))
        configs[widths] = (count_params(shapes, axes, kept), config_cost(costs, kept))
    # the greedy path rebuilt here: every unit a granule, cheapest cost per parameter first
    steps = sorted((c / (2 * d), g, i) for g, (n, d, _, _) in enumerate(BLOCKS) for i, c in enumerate(sorted(costs[n])))
    kept = {n: h for n, _, h, _ in BLOCKS}
    for _, g, _ in steps:
        name = names[g]
        if kept[name] == 1:
            continue
        kept[name] -= 1
        count = count_params(shapes, axes, kept)
        sol = solve(shapes, axes, groups, target=count, costs=costs)
        assert sol.achieved == count
        best = min(c for n, c in configs.values() if n <= count)
        assert math.isclose(sol.cost, best, rel_tol=1e-9, abs_tol=1e-12)


def test_cheap_units_go_first_whatever_their_granule():
    """The kind whose units cost less per parameter loses its units first, the costly kind keeps all of them."""
    shapes, axes, groups, _ = blocks_problem(0)
    costs = {"a": [100.0] * 6, "b": [0.01] * 5, "c": [5.0] * 7}
    sol = solve(shapes, axes, groups, target=count_params(shapes, axes, {}) - 2 * 5 * 4, costs=costs)
    assert sol.kept == {"a": 6, "b": 2, "c": 3}  # b to its floor (multiple_of=2), then c; a keeps everything
    fractions = solve(shapes, axes, groups, target=count_params(shapes, axes, {}) - 2 * 5 * 4)
    assert fractions.rule == "fractions"
    assert fractions.kept != sol.kept


def test_ranked_granules_follow_the_engines_floored_selection():
    """A ranked family: the solver's cost is the cost of the units the engine's joint floored selection drops."""
    h, d, mult, floor = 6, 4, 2, 2
    shapes = {f"{n}.{p}": s for n in ("l0", "l1", "l2") for p, s in (("up", (h, d)), ("down", (d, h)))}
    axes = {(f"{n}.up", 0): [(n, 1, h)] for n in ("l0", "l1", "l2")}
    axes.update({(f"{n}.down", 1): [(n, 1, h)] for n in ("l0", "l1", "l2")})
    group = Group("mlp", ("l0", "l1", "l2"), num_units=h, multiple_of=mult, floor=floor, budget="ranked:mlp")
    gen = torch.Generator().manual_seed(3)
    scores = [torch.rand(h, generator=gen, dtype=torch.float64) * (c + 1) for c in range(3)]
    costs = {f"l{c}": (s**2).tolist() for c, s in enumerate(scores)}
    full = count_params(shapes, axes, {})
    for drop in range(0, 3 * (h - floor) + 1, mult):
        sol = solve(shapes, axes, [group], target=full - 2 * d * drop, costs=costs)
        picked = bottom_k_floored(scores, num_drop=drop, floors=[floor] * 3, multiples=[mult] * 3)
        want = sum(float(costs[f"l{c}"][u]) for c, sel in enumerate(picked) for u in sel.tolist())
        assert math.isclose(sol.cost, want, rel_tol=1e-9, abs_tol=1e-12), drop


def test_balanced_elimination_order_matches_the_engine():
    from lightning_pat.core.selection import elimination_order as torch_order

    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (12,), generator=gen).double()
    for groups in (1, 2, 3):
        assert elimination_order(scores.tolist(), groups) == torch_order(scores, groups=groups).tolist()


def test_missing_costs_are_refused():
    shapes, axes, groups, costs = blocks_problem(0)
    with pytest.raises(ValueError, match=r"no unit costs for clusters \['b'\]"):
        solve(shapes, axes, groups, target=50, costs={k: v for k, v in costs.items() if k != "b"})


# ---------------------------------------------------------------------------------------------------- unit costs
def test_unit_costs_compare_activation_scores_directly_and_scale_weight_scores_per_family():
    model = nn.ModuleDict({"a": nn.Linear(4, 6), "b": nn.Linear(6, 4), "c": nn.Linear(4, 3), "d": nn.Linear(3, 4)})
    clusters = resolve_clusters(
        model, [Cluster("h", ["a.weight", "a.bias"], ["b.weight"]), Cluster("g", ["c.weight", "c.bias"], ["d.weight"])]
    )
    scores = {"h": torch.arange(1.0, 7.0), "g": 10 * torch.arange(1.0, 4.0)}
    direct = unit_costs(scores, clusters, comparable=True)
    assert direct == {"h": [float(v) ** 2 for v in range(1, 7)], "g": [100.0 * v**2 for v in range(1, 4)]}
    scaled = unit_costs(scores, clusters, comparable=False)
    per_param = {
        n: sum(c) / (rc.num_units * rc.unit_numel) for n, c in scaled.items() for rc in clusters if rc.name == n
    }
    assert math.isclose(per_param["h"], per_param["g"])  # an average unit of each kind costs the same per parameter
    assert scaled["h"] == sorted(scaled["h"])
    assert scaled["g"] == sorted(scaled["g"])


# ---------------------------------------------------------------------------------------------------- on a model
def test_prune_clusters_allocates_by_measured_importance_and_counts_exactly():
    """MLP channels whose inputs are almost zero (a scaled-down up projection) cost little: the size comes from them,
    while the fraction rule cuts the heads too; both counts are exact after the shrink."""
    case = next(c for c in fam.CASES if c.id == "llama-h8kv2-bias")
    model = case.fresh()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(1e-3)
            layer.mlp.up_proj.bias.mul_(1e-3)
    batches = [fam.token_ids(seed=s) for s in range(3)]
    kept = {}
    for allocation in ("importance", "fractions"):
        m = case.fresh()
        m.load_state_dict(model.state_dict())
        decls = presets.llama(m, query_heads=True)
        stats = calibrate(m, decls, batches)
        result = prune_clusters(
            m, decls, target_params=0.85, score="activation", activations=stats, target_allocation=allocation
        )
        assert result.size.rule == allocation
        small = shrink(m, result)
        assert sum(p.numel() for p in small.parameters()) == result.size.achieved <= result.size.target
        kept[allocation] = (small.config.intermediate_size, small.config.num_attention_heads)
    assert kept["importance"][1] == case.n_head  # every query head kept: the MLP pays
    assert kept["fractions"][1] < case.n_head


def test_target_allocation_is_checked():
    model = fam.CASES[0].fresh()
    with pytest.raises(ValueError, match=r"target_allocation"):
        prune_clusters(model, "llama", target_params=0.8, target_allocation="greedy")
