"""The size solver: the kept units per group that meet a parameter target (pure, no torch).

The solver counts every configuration it visits itself (:func:`count_params`, the count model of
:mod:`lightning_pat.sizing.problem`, and :func:`cluster_kept`), so a solve never goes back to the problem module.

Search: clusters that must keep the same width (one declaration over the layers: ``mlp.0``, ``mlp.1``, ...) form a
*group* with one kept count ``k``. Starting from the full model, one *granule* (``multiple_of`` units in every
cluster of the group, or one layer) is removed at a time from the group whose kept fraction ``k / C`` is highest
(ties: the group declared first), down to each group's floor (``multiple_of`` units; one layer). Counts decrease
along this path; the first configuration whose count is not above the target (``side="below"``; ``"above"``: the
last one not below it) fixes the number of layers. The slack it leaves is then filled with width granules: while one
fits under the target, the group with the lowest kept fraction gets one back (``"above"``: while one can go without
falling under the target, the group with the highest kept fraction loses one). No single granule can then be added
(removed) without crossing the target, so the achieved count is within one granule of the target and of the best
configuration on its side. The nearest achievable counts one granule up and down are reported.

By importance (``costs`` given: each unit's cost of removal, e.g. its squared activation score, the expected squared
change of the residual stream it writes): a group's granules leave in its units' elimination order (lowest cost
first, balanced over ``unit_groups``), granule ``i`` costing the sum of the costs of the units it removes (a ranked
group: its ``i``-th chunk in the engine's joint order; a layer group: the ``i``-th cheapest layer, a layer costing
the sum of the costs of every unit of the width clusters it owns, its whole update under the same additive model).
The path takes granules in increasing cost per parameter removed (within a group in order, ratios made
non-decreasing by a running maximum; ties: the group declared first, then the granule), so each configuration on
the path is the cheapest of all with at most its parameters when the costs per parameter rise within every group (a
convex separable problem: the greedy is exact at the points it visits). The slack is then filled with the granules
that restore the most cost (``"above"``: the granules that cost least go), one at a time, as long as the target
allows.

Example::

    >>> groups = [Group("mlp", ("mlp",), num_units=8, multiple_of=1)]
    >>> # a 4x8 writer and an 8x4 reader: 8 units of 8 parameters each
    >>> sol = solve({"up": (8, 4), "down": (4, 8)}, {("up", 0): [("mlp", 1, 8)], ("down", 1): [("mlp", 1, 8)]},
    ...             groups, target=40)
    >>> sol.kept, sol.achieved, sol.above
    ({'mlp': 5}, 40, 48)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_pat.core.choices import SIDES, Side
from lightning_pat.sizing.problem import TARGET_UNITS, Axes, Group, SizeSolution


def count_params(
    shapes: Mapping[str, Sequence[int]],
    axes: Axes,
    kept: Mapping[str, int],
    *,
    owners: Mapping[str, str] | None = None,
) -> int:
    """Parameters left when each cluster keeps ``kept[name]`` units (clusters not listed keep all).

    Args:
        shapes: Distinct parameter name -> global shape (a tied tensor once).
        axes: The member slices per ``(parameter, dim)``.
        kept: Cluster name -> kept units.
        owners: Parameter name -> the layer cluster that owns it (absent if in no layer); a layer cluster with 0
            kept units removes the parameter.

    Returns:
        The count.
    """
    total = 0
    for name, shape in shapes.items():
        if owners is not None and name in owners and kept.get(owners[name], 1) == 0:
            continue
        numel = 1
        for dim, length in enumerate(shape):
            for cluster, block, span in axes.get((name, dim), ()):
                if cluster in kept:
                    length += block * kept[cluster] - span
            numel *= length
        total += numel
    return total


def cluster_kept(groups: Sequence[Group], kept: Mapping[str, int]) -> dict[str, int]:
    """Cluster name -> kept units, from a group configuration (a layer group keeps its first ``k`` layers)."""
    out: dict[str, int] = {}
    for group in groups:
        k = kept[group.name]
        if group.budget is not None:
            out.update(zip(group.clusters, group.spread(k), strict=True))
            continue
        for i, cluster in enumerate(group.clusters):
            out[cluster] = (1 if i < k else 0) if group.layers else k
    return out


def _path(groups: Sequence[Group], ratios: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Group index of each granule removal, in path order (ties by group, then granule).

    Without ``ratios``: the highest kept fraction first. With them (per group, the cost per parameter of each of its
    granules, non-decreasing): the lowest ratio first.
    """
    steps: list[tuple[float, int, int]] = []
    for g, group in enumerate(groups):
        values = group.kept_values()
        for i in range(1, len(values)):
            steps.append((-values[i - 1] / group.size if ratios is None else ratios[g][i - 1], g, i))
    steps.sort()
    return [g for _, g, _ in steps]


Costs = Mapping[str, Sequence[float]]


def elimination_order(costs: Sequence[float], unit_groups: int = 1) -> list[int]:
    """Units in the order they leave: lowest cost first (ties: lower index); balanced over ``unit_groups`` groups.

    The pure counterpart of :func:`lightning_pat.core.selection.elimination_order`: with groups, the cheapest unit of
    every group (groups in order), then the second cheapest of every group, and so on.

    Example::

        >>> elimination_order([3.0, 1.0, 2.0, 9.0, 8.0, 7.0], unit_groups=2)
        [1, 5, 2, 4, 0, 3]
    """
    per = len(costs) // unit_groups
    orders = [sorted(range(j * per, (j + 1) * per), key=lambda u: (costs[u], u)) for j in range(unit_groups)]
    return [orders[j][r] for r in range(per) for j in range(unit_groups)]


def _layer_costs(
    groups: Sequence[Group], axes: Axes, costs: Costs, owners: Mapping[str, str] | None
) -> dict[str, float]:
    """Layer cluster -> the summed cost of every unit of the width clusters whose parameters it owns."""
    width = {c for g in groups if not g.layers for c in g.clusters}
    out: dict[str, float] = {c: 0.0 for g in groups if g.layers for c in g.clusters}
    counted: set[str] = set()
    for (param, _), slices in axes.items():
        layer = (owners or {}).get(param)
        for cluster, _, _ in slices:
            if layer in out and cluster in width and cluster not in counted:
                counted.add(cluster)
                out[layer] += float(sum(costs[cluster]))
    for layer in out:
        if layer in costs:  # an explicit cost of the layer wins
            out[layer] = float(sum(costs[layer]))
    return out


def _granule_costs(group: Group, costs: Costs, layer_costs: Mapping[str, float]) -> list[float]:
    """The cost of each granule of ``group``, in the order they leave (see the module docs)."""
    values = group.kept_values()
    if group.fixed is not None:
        return []
    if group.layers:
        return sorted(layer_costs[c] for c in group.clusters)[: len(values) - 1]
    orders = {c: elimination_order(costs[c], group.unit_groups) for c in group.clusters}
    if group.budget is None:  # one width for every cluster: granule i removes the same positions of each order
        out = []
        for i in range(1, len(values)):
            lo, hi = group.num_units - values[i - 1], group.num_units - values[i]
            out.append(sum(float(costs[c][u]) for c in group.clusters for u in orders[c][lo:hi]))
        return out
    chunks: list[tuple[float, int, int, float]] = []  # (rank key: running max of the costs, cluster, chunk, cost)
    for ci, c in enumerate(group.clusters):
        order, peak = orders[c], float("-inf")
        for j, start in enumerate(range(0, group.num_units - group.floor, group.multiple_of)):
            unit_costs = [float(costs[c][u]) for u in order[start : start + group.multiple_of]]
            peak = max(peak, *unit_costs)
            chunks.append((peak, ci, j, sum(unit_costs)))
    chunks.sort()
    return [cost for *_, cost in chunks][: len(values) - 1]


def _importance_ratios(
    shapes: Mapping[str, Sequence[int]],
    axes: Axes,
    groups: Sequence[Group],
    costs: Costs,
    owners: Mapping[str, str] | None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per group, each granule's cost and its cost per parameter removed (made non-decreasing).

    A granule's parameters are counted with every other group full: exact without a residual cluster (the count is
    then additive over the groups), an approximation of the order otherwise (the counts along the path stay exact).
    """
    missing = [c for g in groups if not g.layers and g.fixed is None for c in g.clusters if c not in costs]
    if missing:
        raise ValueError(f"size solver: no unit costs for clusters {missing[:5]}; give a cost for every unit.")
    full = {g.name: g.size for g in groups}
    base = cluster_kept(groups, full)
    total = count_params(shapes, axes, base, owners=owners)
    layer_costs = _layer_costs(groups, axes, costs, owners)
    granule_costs, ratios = [], []
    for group in groups:
        values = group.kept_values()
        gc = _granule_costs(group, costs, layer_costs)
        if group.layers:
            per = total - count_params(shapes, axes, {**base, group.clusters[0]: 0}, owners=owners)
        else:
            fewer = {**base, group.clusters[0]: base[group.clusters[0]] - 1}
            if group.budget is None:
                fewer.update(dict.fromkeys(group.clusters, group.num_units - 1))
            per = total - count_params(shapes, axes, fewer, owners=owners)
        out, peak = [], float("-inf")
        for i, cost in enumerate(gc):
            size = 1 if group.layers else values[i] - values[i + 1]
            peak = max(peak, cost / max(per * size, 1))
            out.append(peak)
        granule_costs.append(gc)
        ratios.append(out)
    return granule_costs, ratios


def _indices(groups: Sequence[Group], path: Sequence[int], position: int) -> list[int]:
    """Granules removed from each group after ``position`` steps of the path."""
    removed = [0] * len(groups)
    for g in path[:position]:
        removed[g] += 1
    return removed


def _config(groups: Sequence[Group], path: Sequence[int], position: int) -> dict[str, int]:
    removed = _indices(groups, path, position)
    return {group.name: group.kept_values()[removed[g]] for g, group in enumerate(groups)}


def _neighbours(groups: Sequence[Group], index: Sequence[int], *, up: bool, widths_only: bool) -> list[list[int]]:
    """Configurations one granule of one group away (``up``: one granule kept more), in group order."""
    out = []
    for g, group in enumerate(groups):
        if widths_only and group.layers:
            continue
        i = index[g] + (-1 if up else 1)
        if 0 <= i < len(group.kept_values()):
            out.append([*index[:g], i, *index[g + 1 :]])
    return out


def _polish(
    groups: Sequence[Group],
    index: list[int],
    count_of: Callable[[Sequence[int]], int],
    target: int,
    *,
    up: bool,
    granule_costs: Sequence[Sequence[float]] | None = None,
) -> list[int]:
    """Fill the slack the path left with width granules (layers stay as the path chose them).

    ``up`` (side ``"below"``): while a width granule fits under the target, give it back to the group with the lowest
    kept fraction (by importance: the granule that restores the most cost); else (side ``"above"``) while one can go
    without falling under the target, take it from the group with the highest kept fraction (by importance: the
    granule that costs least). Ties: the group declared first.
    """
    while True:
        options = []
        for n in _neighbours(groups, index, up=up, widths_only=True):
            c = count_of(n)
            if (c <= target) if up else (c >= target):
                g = next(k for k in range(len(groups)) if n[k] != index[k])
                if granule_costs is None:
                    fraction = groups[g].kept_values()[index[g]] / groups[g].size
                    options.append((fraction if up else -fraction, g, n))
                else:  # the granule restored is the last one removed (index - 1), the one removed the next (index)
                    cost = granule_costs[g][index[g] - 1] if up else granule_costs[g][index[g]]
                    options.append((-cost if up else cost, g, n))
        if not options:
            return index
        index = min(options)[2]


def solve(
    shapes: Mapping[str, Sequence[int]],
    axes: Axes,
    groups: Sequence[Group],
    *,
    target: int,
    side: Side = "below",
    owners: Mapping[str, str] | None = None,
    name: str = "target_params",
    costs: Costs | None = None,
) -> SizeSolution:
    """Kept units per group meeting a parameter target (see the module docs for the search).

    Layer groups count the first ``k`` layers as kept; the layers must carry equal parameter counts (which ones
    are dropped is decided later by score, and does not change the count then).

    Args:
        shapes: Distinct parameter name -> global shape.
        axes: The member slices per ``(parameter, dim)``.
        groups: The groups, in declaration order (ties go to the earlier group).
        target: The parameter count asked for.
        side: ``"below"`` (default: the closest count not above the target) or ``"above"`` (not below it).
        owners: Parameter name -> owning layer cluster (for layer groups).
        name: The option the target came from (``"target_flops"``: ``shapes`` hold FLOP costs, see
            :mod:`lightning_pat.sizing.flops`), for messages.
        costs: Cluster name -> the removal cost of each unit (non-negative): allocate by importance (see the module
            docs); ``None``: by kept fractions. Layer clusters may be left out (their cost is derived).

    Returns:
        The solution.

    Raises:
        ValueError: If ``side`` is unknown, the target is above the full size or below the smallest reachable count
            (the message gives both numbers and the floors), the layers of a layer group differ in size, or ``costs``
            lacks a width cluster.
    """
    if side not in SIDES:
        raise ValueError(f"`target_side` must be one of {SIDES}, got {side!r}.")
    full = {g.name: g.size for g in groups}  # the unpruned model (fixed groups too)
    total = count_params(shapes, axes, cluster_kept(groups, full), owners=owners)
    _check_equal_layers(shapes, axes, groups, full, owners)
    _check_equal_units(shapes, axes, groups, owners)
    unit, whole = TARGET_UNITS.get(name, TARGET_UNITS["target_params"])
    if target > total:
        raise ValueError(f"`{name}` ({target:,}) is above {whole} ({total:,}); ask for at most that.")
    granule_costs, ratios = (None, None) if costs is None else _importance_ratios(shapes, axes, groups, costs, owners)
    path = _path(groups, ratios)

    def count_at(position: int) -> int:
        return count_params(shapes, axes, cluster_kept(groups, _config(groups, path, position)), owners=owners)

    maximum = count_at(0)  # every variable group full; fixed groups (target_layers, own targets) as fixed
    if target > maximum:
        fixed = [g for g in groups if g.fixed is not None]
        layers = next((g for g in fixed if g.layers), None)
        why = (
            f"`target_layers={layers.fixed}` keeps at most {maximum:,} {unit}"
            if layers is not None
            else f"the clusters with their own `target` ({', '.join(g.name for g in fixed)}) keep at most {maximum:,} "
            f"{unit}"
        )
        fix = "keep more layers" if layers is not None else "remove their `target`"
        raise ValueError(
            f"{why} (target {target:,}, full model {total:,}); `{name}` cannot be reached at that depth or those "
            f"widths. Ask for at most {maximum:,} or {fix}."
        )
    minimum = count_at(len(path))
    if target < minimum:
        floors = ", ".join(
            f"{g.name}: {g.kept_values()[-1]} of {g.size}"
            + (f" (multiple_of={g.multiple_of})" if g.multiple_of > 1 else "")
            for g in groups
        )
        raise ValueError(
            f"`{name}` ({target:,}) is below the smallest size the clusters can reach ({minimum:,}, with "
            f"{floors}; {total - minimum:,} of {total:,} {unit} are prunable). Ask for at least {minimum:,}, add "
            "clusters (e.g. preset_options={'residual': True}), or lower `multiple_of`."
        )
    lo, hi = 0, len(path)  # first position whose count <= target (counts do not increase along the path)
    while lo < hi:
        mid = (lo + hi) // 2
        if count_at(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    first_below = lo
    position = first_below
    if side == "above" and first_below > 0 and count_at(first_below) != target:
        position = first_below - 1
    index = _indices(groups, path, position)

    def count_of(idx: Sequence[int]) -> int:
        cfg = {g.name: g.kept_values()[i] for g, i in zip(groups, idx, strict=True)}
        return count_params(shapes, axes, cluster_kept(groups, cfg), owners=owners)

    index = _polish(groups, index, count_of, target, up=side == "below", granule_costs=granule_costs)
    achieved = count_of(index)
    ups = [count_of(n) for n in _neighbours(groups, index, up=True, widths_only=False)]
    downs = [count_of(n) for n in _neighbours(groups, index, up=False, widths_only=False)]
    below = achieved if achieved <= target else max((c for c in downs if c <= target), default=None)
    above = achieved if achieved > target else min((c for c in ups if c > target), default=None)
    kept = {g.name: g.kept_values()[i] for g, i in zip(groups, index, strict=True)}
    per_cluster = cluster_kept(groups, kept)
    fractions = {}
    for group in groups:
        if not group.layers:
            for c in group.clusters:
                fractions[c] = (group.size - kept[group.name]) / group.size  # a ranked group: of its budget
    return SizeSolution(
        kept=kept,
        cluster_kept=per_cluster,
        achieved=achieved,
        target=target,
        total=total,
        below=below,
        above=above,
        minimum=minimum,
        dropped_layers=sum(g.size - kept[g.name] for g in groups if g.layers),
        fractions=fractions,
        unit="FLOPs per token" if name == "target_flops" else "parameters",
        rule="fractions" if granule_costs is None else "importance",
        cost=None if granule_costs is None else sum(sum(gc[:i]) for gc, i in zip(granule_costs, index, strict=True)),
    )


def _check_equal_layers(
    shapes: Mapping[str, Sequence[int]],
    axes: Axes,
    groups: Sequence[Group],
    full: Mapping[str, int],
    owners: Mapping[str, str] | None,
) -> None:
    for group in groups:
        if not group.layers or owners is None:
            continue
        base = cluster_kept(groups, full)
        total = count_params(shapes, axes, base, owners=owners)
        sizes = {c: total - count_params(shapes, axes, {**base, c: 0}, owners=owners) for c in group.clusters}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"Layer group {group.name!r}: layers carry different parameter counts {sizes}; a size target with "
                "depth pruning needs equal layers. Drop `layers` from the preset options, or set `target_sparsity`."
            )


def _check_equal_units(
    shapes: Mapping[str, Sequence[int]], axes: Axes, groups: Sequence[Group], owners: Mapping[str, str] | None
) -> None:
    """A ranked group's count depends only on its total if a unit of each cluster carries the same parameters.

    Checked with every other group full and at its floor (the count is linear in each cluster's width, so a width
    of another group, such as the residual stream, scales the units' cost the same way in every cluster or not).
    """
    for group in groups:
        if group.budget is None:
            continue
        for level in (0, -1):
            base = cluster_kept(groups, {g.name: g.kept_values()[level] for g in groups})
            base.update(dict.fromkeys(group.clusters, group.num_units))
            total = count_params(shapes, axes, base, owners=owners)
            costs = {c: total - count_params(shapes, axes, {**base, c: group.num_units - 1}, owners=owners)
                     for c in group.clusters}  # fmt: skip
            if len(set(costs.values())) > 1:
                raise ValueError(
                    f"target_widths='ranked': the clusters of {group.name!r} carry different parameters per unit "
                    f"{costs}, so the size would depend on which layers keep the units. Rank only clusters of equal "
                    "shapes together (one declaration, or one `budget`), or use target_widths='uniform'."
                )
