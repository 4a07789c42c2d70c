"""The size problem: what a target means and what a configuration of kept units counts (pure, no torch).

The count model is exact for a shrunk model: every distinct parameter (a tied tensor once) keeps, on each dim, the
channels no cluster owns plus ``block * kept`` channels of every member slice on that dim, and its count is the
product of its dims. A GQA group thus counts its query heads' rows in ``q_proj`` and its KV rows in ``k/v``; a residual
channel counts its column in every ``q/k/v/gate/up`` of every layer, its row in ``o/down``, norms and the embedding.
A dropped layer (a layer unit, see :func:`lightning_pat.presets.layer_units`) removes every parameter it owns, so the
widths of its other clusters no longer count.

A target is parsed by :func:`parse_size` (a count, ``"90M"``, a fraction or a percentage); :func:`size_problem`
turns resolved clusters into the solver's groups and member axes. The search over configurations, and the count of
one (:func:`~lightning_pat.sizing.solver.count_params`, the model above), is :mod:`lightning_pat.sizing.solver`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

from lightning_pat.core.layers import LAYER_BUDGET, is_layer_cluster, layer_prefix
from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import ResolvedCluster

#: Size option -> (what it counts, what the full model is called), for messages (a table: the solver reads it too).
TARGET_UNITS: Mapping[str, tuple[str, str]] = {
    "target_params": ("parameters", "the model's size"),
    "target_flops": ("FLOPs per token", "the model's FLOPs per token"),
}
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

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (a checkpoint's state holds it); :meth:`from_dict` inverts it exactly."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SizeSolution:
        """The solution :meth:`to_dict` wrote (unknown keys are ignored; the caller checked the types).

        Example::

            >>> sol = SizeSolution({"mlp": 3}, {"mlp.0": 3}, 90, 100, 120, 90, 110, 40, fractions={"mlp.0": 0.25})
            >>> SizeSolution.from_dict(sol.to_dict()) == sol
            True
        """
        names = {f.name for f in dataclasses.fields(cls)}
        fields: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items() if k in names}
        return cls(**fields)

    def describe(self) -> str:
        """One line for logs: achieved, target, neighbours and kept widths."""
        widths = ", ".join(f"{g}={k}" for g, k in self.kept.items())
        return (
            f"{self.achieved:,} {self.unit} (target {self.target:,}, full {self.total:,}; nearest achievable "
            f"below {self.below if self.below is None else f'{self.below:,}'}, above "
            f"{self.above if self.above is None else f'{self.above:,}'}); kept: {widths}; allocated by {self.rule}"
        )


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
    unit, whole = TARGET_UNITS.get(name, TARGET_UNITS["target_params"])
    result = round(number * total) if kind == "fraction" else int(number)
    if result <= 0:
        raise ValueError(f"`{name}` = {value!r} is {result} {unit} of {total:,}; ask for a positive size.")
    if result > total:
        raise ValueError(
            f"`{name}` = {value!r} ({result:,} {unit}) is above {whole} ({total:,}); ask for at most {total:,} (or a "
            "fraction <= 1)."
        )
    return result


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
