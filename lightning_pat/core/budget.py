"""Size targets: from "keep 4B parameters" to the number of units each cluster keeps (pure, no torch).

The count model is exact for a shrunk model: every distinct parameter (a tied tensor once) keeps, on each dim, the
channels no cluster owns plus ``block * kept`` channels of every member slice on that dim, and its count is the
product of its dims. A GQA group thus counts its query heads' rows in ``q_proj`` and its KV rows in ``k/v``; a residual
channel counts its column in every ``q/k/v/gate/up`` of every layer, its row in ``o/down``, norms and the embedding.
A dropped layer (a layer unit, see :func:`lightning_pat.presets.layer_units`) removes every parameter it owns, so the
widths of its other clusters no longer count.

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

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import ResolvedCluster

Side = Literal["below", "above"]
SIDES: tuple[str, ...] = ("below", "above")
#: (parameter name, dim) -> [(cluster name, block, slice length)]: the member slices on that axis.
Axes = Mapping[tuple[str, int], Sequence[tuple[str, int, int]]]

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?\s*(?P<unit>[kKmMbBgGtT%]?)\s*$")


@dataclass(frozen=True)
class Group:
    """Clusters that keep one common unit count.

    Attributes:
        name: Label (for messages).
        clusters: Names of the member clusters.
        num_units: ``C`` of each cluster (one for a layer group: see ``layers``).
        multiple_of: The kept count is a multiple of this (once anything is dropped).
        layers: Whether this is a layer group: its clusters are 1-unit layer clusters; ``k`` counts kept layers and
            a granule is one layer.
        fixed: If set, the group's kept count is fixed (a cluster's own ``target``) and does not take part.
        floor: A ranked group (``budget`` set): the units each cluster keeps at least (a multiple of
            ``multiple_of``).
        budget: A ranked group: the shared budget in which its clusters' units are ranked jointly by score, so the
            widths differ between layers; ``k`` counts the units kept over all its clusters (every cluster's units
            carry the same parameters, see :func:`solve`), a granule is ``multiple_of`` units.
        unit_groups: The clusters' ``unit_groups`` (balanced selection; the elimination order of the costs).
    """

    name: str
    clusters: tuple[str, ...]
    num_units: int
    multiple_of: int = 1
    layers: bool = False
    fixed: int | None = None
    floor: int = 0
    budget: str | None = None
    unit_groups: int = 1

    @property
    def size(self) -> int:
        """Units the group's variable counts: layers for a layer group, all units for a ranked group, else ``C``."""
        if self.layers:
            return len(self.clusters)
        return self.num_units * len(self.clusters) if self.budget is not None else self.num_units

    def kept_values(self) -> list[int]:
        """The kept counts reachable, from the full size down to the floor (never zero)."""
        if self.fixed is not None:
            return [self.fixed]
        full, step = self.size, (1 if self.layers else self.multiple_of)
        lowest = self.floor * len(self.clusters) if self.budget is not None else step
        below = (full - 1) // step * step
        return [full] + list(range(below, lowest - 1, -step)) if below >= lowest else [full]

    def spread(self, kept: int) -> list[int]:
        """A ranked group's ``kept`` units over its clusters (the floor each, the rest in granules, first first)."""
        out = [self.floor] * len(self.clusters)
        rest, i = kept - self.floor * len(self.clusters), 0
        while rest > 0:
            add = min(rest, self.num_units - out[i])
            out[i] += add
            rest -= add
            i += 1
        return out


@dataclass(frozen=True)
class SizeSolution:
    """Kept units per cluster for a parameter target.

    Attributes:
        kept: Group name -> kept count (units per cluster, or layers for a layer group).
        cluster_kept: Cluster name -> kept units (a layer cluster: 1 kept, 0 dropped).
        achieved: Parameters of the model after the shrink.
        target: The target asked for.
        total: Parameters of the full model.
        below: The achieved count if it is not above the target, else the nearest count one granule down.
        above: The achieved count if it is above the target, else the nearest count one granule up (``None`` if
            nothing can be added).
        minimum: The smallest count the groups can reach.
        dropped_layers: Number of dropped layers (layer groups).
        fractions: Width cluster name -> fraction of its units dropped (its ``target``).
        unit: What is counted: ``"parameters"``, or ``"FLOPs per token"`` for ``target_flops``.
        rule: How the granules were ordered: ``"importance"`` (unit costs per parameter removed) or ``"fractions"``
            (the highest kept fraction first).
        cost: With ``"importance"``: the summed cost of the removed units (of the solution's configuration).
    """

    kept: dict[str, int]
    cluster_kept: dict[str, int]
    achieved: int
    target: int
    total: int
    below: int | None
    above: int | None
    minimum: int
    dropped_layers: int = 0
    fractions: dict[str, float] = field(default_factory=dict)
    unit: str = "parameters"
    rule: str = "fractions"
    cost: float | None = None

    def describe(self) -> str:
        """One line for logs: achieved, target, neighbours and kept widths."""
        widths = ", ".join(f"{g}={k}" for g, k in self.kept.items())
        return (
            f"{self.achieved:,} {self.unit} (target {self.target:,}, full {self.total:,}; nearest achievable "
            f"below {self.below if self.below is None else f'{self.below:,}'}, above "
            f"{self.above if self.above is None else f'{self.above:,}'}); kept: {widths}; allocated by {self.rule}"
        )


def _units(name: str) -> tuple[str, str]:
    """(what is counted, what the full model is called) for the option ``name``."""
    if name == "target_flops":
        return "FLOPs per token", "the model's FLOPs per token"
    return "parameters", "the model's size"


def size_value(value: object, *, name: str = "target_params") -> tuple[str, Fraction]:
    """Read a size target without the model: ``("count", n)`` or ``("fraction", f)`` (one rule for every form).

    The rule: an ``int`` is always a count (``1`` is one parameter); a ``float`` in ``(0, 1]`` is a fraction of the
    model and a float above 1 a count (``4e9``), which must be whole; a string is read like the number it spells
    (``"2000"`` a count, ``"0.5"`` a fraction, ``"1.5e9"`` a count), or with a suffix as a count (``k``, ``M``,
    ``B``/``G``, ``T``: ``"1.5k"`` is 1,500) or a percentage (``"50%"``, at most 100%). Counts must be whole.

    Raises:
        ValueError: If ``value`` is not a number or size string, not finite, not positive, a percentage above 100%,
            or a count that is not whole (the message names ``name``, the value and what it was read as).

    Example::

        >>> [(kind, int(n) if kind == "count" else float(n)) for kind, n in map(size_value, (1, 1.0, "50%", "1.5k"))]
        [('count', 1), ('fraction', 1.0), ('fraction', 0.5), ('count', 1500)]
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"`{name}` must be a count, a fraction or a size string like '4B', got {value!r}.")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ValueError(f"`{name}` must look like '4B', '350M', '1.5e9', '120k' or '50%', got {value!r}.")
        exp = int(match["exp"] or 0)
        if exp > 400 or exp < -400:
            raise ValueError(f"`{name}` = {value!r} is not a finite size; ask for a count such as '4B' or a fraction.")
        number = Fraction(Decimal(match["num"])) * Fraction(10) ** exp
        unit = match["unit"].lower()
        if number <= 0:
            raise ValueError(f"`{name}` must be positive, got {value!r}.")
        if unit == "%":
            if number > 100:
                raise ValueError(f"`{name}` = {value!r} is above 100%; ask for a percentage in (0, 100].")
            return "fraction", number / 100
        if unit:
            return _whole(number * _SUFFIX[unit], value, name)
        looks_int = "." not in match["num"] and not match["exp"]
        if not looks_int and number <= 1:
            return "fraction", number
        return _whole(number, value, name)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite count or fraction, got {value!r}.")
    if value <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}.")
    if isinstance(value, float) and value <= 1:
        return "fraction", Fraction(value)
    return _whole(Fraction(value), value, name)


def _whole(count: Fraction, value: object, name: str) -> tuple[str, Fraction]:
    if count.denominator != 1:
        raise ValueError(
            f"`{name}` = {value!r} is a count (above 1) but not a whole number of parameters; give a whole count "
            "('1500', '1.5k'), or a fraction of the model as a value <= 1 (0.5) or a percentage ('50%')."
        )
    return "count", count


def parse_size(value: object, *, total: int, name: str = "target_params") -> int:
    """An absolute count from ``4e9``, ``"4B"``, ``"350M"``, ``"50%"``, a fraction ``0 < x <= 1`` or an int count.

    See :func:`size_value` for the rule (an int is a count, a float <= 1 a fraction); a fraction is rounded to the
    nearest count of ``total``.

    Raises:
        ValueError: As for :func:`size_value`; if the count is above ``total``, or a fraction rounds to 0.

    Example::

        >>> parse_size("350M", total=10**9), parse_size(0.25, total=1000), parse_size("50%", total=1000)
        (350000000, 250, 500)
    """
    kind, number = size_value(value, name=name)
    unit, whole = _units(name)
    result = round(number * total) if kind == "fraction" else int(number)
    if result <= 0:
        raise ValueError(f"`{name}` = {value!r} is {result} {unit} of {total:,}; ask for a positive size.")
    if result > total:
        raise ValueError(
            f"`{name}` = {value!r} ({result:,} {unit}) is above {whole} ({total:,}); ask for at most {total:,} (or a "
            "fraction <= 1)."
        )
    return result


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
            :mod:`lightning_pat.flops`), for messages.
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
    unit, whole = _units(name)
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


#: With ``target_widths="ranked"``: the fraction of each cluster's units it keeps at least.
DEFAULT_MIN_KEPT = 0.25


def _ranked_group(label: str, members: Sequence[ResolvedCluster], min_kept: float) -> Group:
    """One ranked group over ``members`` (equal ``C`` and ``multiple_of``; ``C`` a multiple of ``multiple_of``).

    Raises:
        ValueError: Naming the clusters, if they differ in ``C`` or ``multiple_of``, or ``C`` is not a multiple.
    """
    sizes = {(rc.num_units, rc.multiple_of) for rc in members}
    grouped = {(rc.num_units, rc.multiple_of, rc.unit_groups) for rc in members}
    names = [rc.name for rc in members]
    if len(grouped) > 1:
        what, shown = ("units or multiple_of", sizes) if len(sizes) > 1 else ("unit_groups", grouped)
        raise ValueError(
            f"target_widths='ranked': the clusters of {label!r} ({names[:4]}{'...' if len(names) > 4 else ''}) "
            f"differ in {what} "
            f"{sorted(shown)}; rank only equal clusters together (one declaration, or one `budget`)."
        )
    num_units, mult, unit_groups = grouped.pop()
    if num_units % mult:
        raise ValueError(
            f"target_widths='ranked': {label!r} has {num_units} units per cluster, not a multiple of multiple_of="
            f"{mult}; choose a multiple_of that divides {num_units}, or use target_widths='uniform'."
        )
    floor = min(num_units, max(mult, math.ceil(min_kept * num_units / mult) * mult))
    budget = members[0].budget or f"ranked:{label}"
    return Group(label, tuple(names), num_units, mult, floor=floor, budget=budget, unit_groups=unit_groups)


#: The ``budget`` name that marks 1-unit layer clusters (see :mod:`lightning_pat.shrink.depth`).
LAYER_BUDGET = "layers"


def is_layer_cluster(rc: ResolvedCluster) -> bool:
    """Whether ``rc`` is a layer unit: a 1-unit cluster in the :data:`LAYER_BUDGET` budget."""
    return rc.budget == LAYER_BUDGET and rc.num_units == 1


def layer_prefix(rc: ResolvedCluster) -> str:
    """The module path a layer cluster removes: the longest common dotted prefix of its members' modules."""
    paths = [m.name.split(".")[:-1] for m in rc.members]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def size_problem(
    shapes: Mapping[str, Sequence[int]],
    clusters: Sequence[ResolvedCluster],
    *,
    declared: Mapping[str, str] | None = None,
    keep_layers: int | None = None,
    ranked: bool = False,
    min_kept: float = DEFAULT_MIN_KEPT,
) -> tuple[dict[tuple[str, int], list[tuple[str, int, int]]], list[Group], dict[str, str]]:
    """The solver's inputs from resolved clusters: member axes, groups and layer ownership.

    Clusters of one declaration (``declared`` maps each cluster to its declaration's label, e.g. ``mlp.0`` and
    ``mlp.1`` to ``"mlp"``) that have the same ``C``, ``multiple_of`` and ``target`` form one group: one width over
    the layers, what a stock config can express. A cluster not in ``declared`` is its own group. A cluster with its
    own ``target`` keeps it (fixed). Layer clusters form one layer group.

    Args:
        shapes: Distinct parameter name -> global shape.
        clusters: The resolved clusters.
        declared: Cluster name -> label of the declaration it was expanded from.
        keep_layers: If set, the number of layers kept (the widths make up the rest of the target); else the solver
            balances layers and widths.
        ranked: Non-uniform widths: the clusters of one declaration (or of one ``budget``) form a ranked group, one
            shared budget in which units are ranked jointly by score, each cluster keeping at least ``min_kept`` of
            its units (rounded up to ``multiple_of``).
        min_kept: With ``ranked``: the fraction of each cluster's units it keeps at least, in ``(0, 1]``.

    Returns:
        ``(axes, groups, owners)`` for :func:`solve`.

    Raises:
        ValueError: If a cluster shares a budget (other than layer units) and ``ranked`` is off: a shared budget
            decides widths by score; with ``ranked``: layer units, a budget with its own ``target``, or a ranked
            group whose clusters differ in ``C`` or ``multiple_of`` or whose ``C`` is not a multiple of
            ``multiple_of``; if ``keep_layers`` is given without layer units or outside ``[1, layers]``.
    """
    axes: dict[tuple[str, int], list[tuple[str, int, int]]] = {}
    owners: dict[str, str] = {}
    grouped: dict[tuple[Any, ...], list[ResolvedCluster]] = {}
    layers: list[ResolvedCluster] = []
    for rc in clusters:
        if is_layer_cluster(rc):
            layers.append(rc)
            prefix = layer_prefix(rc) + "."
            for name in shapes:
                if name.startswith(prefix):
                    owners[name] = rc.name
            continue
        if rc.budget is not None and not ranked:
            raise ValueError(
                f"Cluster {rc.name!r} shares budget {rc.budget!r}: uniform widths cannot follow a shared budget; "
                "set target_widths='ranked' (the budget's units are ranked by score, with a floor per cluster), "
                "remove `budget` from the declaration, or use `target_sparsity`."
            )
        if rc.budget is not None and rc.target is not None:
            raise ValueError(
                f"Cluster {rc.name!r}: budget {rc.budget!r} has its own target {rc.target:g}, so its widths are not "
                "the size solver's; remove `target` from the declarations of that budget, or `budget`."
            )
        for m in rc.members:
            axes.setdefault((m.name, m.dim), []).append((rc.name, m.block, m.stop - m.start))
        label = (declared or {}).get(rc.name, rc.name)
        if ranked and rc.target is None:
            grouped.setdefault(("ranked", rc.budget or label), []).append(rc)
        else:
            grouped.setdefault((label, rc.num_units, rc.multiple_of, rc.target, rc.unit_groups), []).append(rc)
    if ranked and layers:
        raise ValueError(
            "target_widths='ranked' with layer units: a dropped layer takes its units with it, so the size would "
            "depend on which layers keep how many units. Use target_widths='uniform' with layers, or drop `layers` "
            "from the preset options."
        )
    groups = []
    for key, members in grouped.items():
        label, rc = key[1] if key[0] == "ranked" else key[0], members[0]
        if key[0] == "ranked" and len(members) > 1:
            groups.append(_ranked_group(label, members, min_kept))
            continue
        fixed = None
        if rc.target is not None:
            fixed = rc.num_units - num_to_drop(rc.target, rc.num_units, multiple_of=rc.multiple_of)
        if any(g.name == label for g in groups):
            label = f"{label}({rc.name})"
        groups.append(
            Group(
                label,
                tuple(r.name for r in members),
                rc.num_units,
                rc.multiple_of,
                fixed=fixed,
                unit_groups=rc.unit_groups,
            )  # fmt: skip
        )
    if keep_layers is not None and not 1 <= keep_layers <= len(layers):
        raise ValueError(
            f"`target_layers` = {keep_layers} layers to keep, but the clusters hold {len(layers)} layer units; "
            + ("add them with preset_options={'layers': True}." if not layers else f"ask for 1 to {len(layers)}.")
        )
    if layers:
        groups.append(Group(LAYER_BUDGET, tuple(rc.name for rc in layers), 1, layers=True, fixed=keep_layers))
    return axes, groups, owners
