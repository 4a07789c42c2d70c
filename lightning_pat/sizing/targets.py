"""Size targets on a model: resolved clusters -> the targets that reach a parameter count (no Lightning here).

:func:`sized_clusters` counts the model's distinct parameters (a tied tensor once), runs the pure solver of
:mod:`lightning_pat.sizing.solver` and returns the clusters with the per-cluster ``target`` that keeps the solved
number of units (layer units share the ``layers`` budget's target: the number of dropped layers over the layers).
The schedule then ramps every cluster towards its own target, so that the widths are met at the final step.

With unit scores (``importance``), the solver allocates by importance: :func:`unit_costs` turns each unit's score
into its cost of removal, comparable across cluster kinds. An activation score of a cluster with one reader (an MLP's
``down_proj``, a head's ``o_proj``) is the RMS of what the unit adds to that reader's output, the residual stream, so
its square is the expected squared change of the residual stream when the unit goes: MLP channels, query heads and
KV groups of every layer are then costed in the same quantity, unscaled. A family whose scores are not in that
quantity (a weight score, or a cluster with several readers, such as the residual stream read by every projection)
is scaled so that its mean cost per parameter equals that of the comparable families (1 if there are none): without
evidence across kinds, an average unit of every kind costs the same per parameter, and the family's own scores decide
which of its units go first.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_pat.core.choices import SIDES, WIDTHS, Side
from lightning_pat.core.layers import LAYER_BUDGET, is_layer_cluster
from lightning_pat.core.spec import Cluster, ResolvedCluster, as_cluster, resolve_clusters
from lightning_pat.sizing.problem import (
    DEFAULT_MIN_KEPT,
    SizeSolution,
    parse_size,
    size_problem,
    size_value,
)
from lightning_pat.sizing.solver import solve

log = logging.getLogger(__name__)


def distinct_shapes(params: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """First name -> global shape of every distinct tensor (tied tensors once; DTensors report global shapes)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in params.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tuple(tensor.shape)
    return out


def check_target(
    target_params: object,
    side: object,
    target_layers: object = None,
    target_widths: object = "uniform",
    min_kept: object = None,
    *,
    name: str = "target_params",
) -> None:
    """Static checks of ``target_params``, ``target_side``, ``target_layers``, ``target_widths`` and ``min_kept``.

    ``name`` is the option the target came from (``"target_flops"`` for a FLOPs target), for messages. The size's
    form is checked by :func:`~lightning_pat.sizing.problem.size_value` (the model's size is not known yet).

    Raises:
        ValueError: If the target is not a positive count, fraction or size string, the side or widths are unknown,
            ``target_layers`` is not a positive int or is given without ``target_params``, or ``min_kept`` is not in
            ``(0, 1]`` or is given without ``target_widths="ranked"``.
    """
    if target_widths not in WIDTHS:
        raise ValueError(f"`target_widths` must be one of {WIDTHS}, got {target_widths!r}.")
    if min_kept is not None:
        if isinstance(min_kept, bool) or not isinstance(min_kept, (int, float)) or not 0 < min_kept <= 1:
            raise ValueError(
                f"`min_kept` (the fraction of each cluster's units kept at least) must be in (0, 1], got {min_kept!r}."
            )
        if target_widths != "ranked":
            raise ValueError(
                "`min_kept` is the floor of each cluster under target_widths='ranked'; set target_widths='ranked' "
                "too, or remove `min_kept`."
            )
    if target_widths == "ranked" and target_params is None:
        raise ValueError("`target_widths='ranked'` shapes a size target; set `target_params` too.")
    if target_params is not None:
        size_value(target_params, name=name)
    if target_layers is not None:
        if isinstance(target_layers, bool) or not isinstance(target_layers, int) or target_layers < 1:
            raise ValueError(f"`target_layers` (layers to keep) must be an int >= 1, got {target_layers!r}.")
        if target_params is None:
            raise ValueError("`target_layers` splits a size target between depth and widths; set `target_params` too.")
    if side not in SIDES:
        raise ValueError(f"`target_side` must be one of {SIDES}, got {side!r}.")


def declaration_labels(
    params: Mapping[str, Tensor], declarations: Sequence[Cluster | Mapping[str, Any]]
) -> dict[str, str]:
    """Cluster name -> the label of the declaration it expands from (``"mlp.{layer}"`` -> ``"mlp"``).

    Each declaration is expanded on its own (validation happens in :func:`~lightning_pat.resolve_clusters`).
    """
    out: dict[str, str] = {}
    for decl in declarations:
        cluster = as_cluster(decl)
        label = re.sub(r"[._-]?\{[^}]*\}", "", cluster.name) or cluster.name
        for rc in resolve_clusters(params, [cluster]):
            out[rc.name] = label
    return out


def sized_clusters(
    params: Mapping[str, Tensor],
    clusters: Sequence[ResolvedCluster],
    target_params: object,
    *,
    side: Side = "below",
    declared: Mapping[str, str] | None = None,
    keep_layers: int | None = None,
    widths: str = "uniform",
    min_kept: float | None = None,
    costs: tuple[Mapping[str, Sequence[int]], Mapping[tuple[str, int], Sequence[tuple[str, int, int]]]] | None = None,
    name: str = "target_params",
    importance: Mapping[str, Sequence[float]] | None = None,
) -> tuple[list[ResolvedCluster], SizeSolution]:
    """The clusters with the targets that reach ``target_params``, and the solution.

    Args:
        params: Parameter name -> tensor (every name, tied tensors under each of theirs).
        clusters: The resolved clusters.
        target_params: An absolute count (``4e9``, ``"4B"``, ``"350M"``) or a fraction of the model's parameters.
        side: ``"below"``: the closest achievable count not above the target; ``"above"``: not below it.
        declared: Cluster name -> declaration label (:func:`declaration_labels`): the clusters of one declaration
            keep one width. Without it every cluster is solved on its own.
        keep_layers: Layers to keep (layer units); by default the solver balances depth and widths.
        widths: ``"uniform"`` (one width per declaration) or ``"ranked"``: the units of a declaration's clusters (or
            of a declared ``budget``) are ranked jointly by score at each selection, each cluster keeping at least
            ``min_kept`` of its units; the solver fixes their total.
        min_kept: With ``"ranked"``: the fraction of each cluster's units it keeps at least (default
            :data:`~lightning_pat.sizing.problem.DEFAULT_MIN_KEPT`).
        costs: Instead of the parameters, what to count: ``(shapes, extra axes)`` from
            :func:`lightning_pat.sizing.flops.flop_costs` (``target_flops``).
        name: The option the target came from, for messages.
        importance: Cluster name -> each unit's removal cost (:func:`unit_costs`): the widths are allocated by
            importance; ``None``: by kept fractions (see :mod:`lightning_pat.sizing.solver`).

    Returns:
        ``(clusters, solution)``.

    Raises:
        ValueError: If the target is malformed, above the model's size or below what the clusters can reach, a
            cluster shares a budget, or layer units differ in size.
    """
    shapes = distinct_shapes(params) if costs is None else dict(costs[0])
    total = sum(_numel(s) for s in shapes.values())
    target = parse_size(target_params, total=total, name=name)
    axes, groups, owners = size_problem(
        shapes, clusters, declared=declared, keep_layers=keep_layers, ranked=widths == "ranked",
        min_kept=DEFAULT_MIN_KEPT if min_kept is None else min_kept,
    )  # fmt: skip
    if costs is not None:
        axes.update({k: list(v) for k, v in costs[1].items()})
    solution = solve(shapes, axes, groups, target=target, side=side, owners=owners, name=name, costs=importance)
    num_layers = sum(1 for rc in clusters if is_layer_cluster(rc))
    ranked = {c: g for g in groups if g.budget is not None for c in g.clusters}
    out = []
    for rc in clusters:
        if rc.name in ranked:  # one shared budget with a floor per cluster: the engine ranks the units jointly
            group = ranked[rc.name]
            fraction = solution.fractions[rc.name]
            out.append(dataclasses.replace(rc, target=fraction, budget=group.budget, min_kept=group.floor))
            continue
        if is_layer_cluster(rc):
            target_fraction = solution.dropped_layers / num_layers
        elif rc.target is not None:
            target_fraction = rc.target
        else:
            target_fraction = solution.fractions[rc.name]
        out.append(dataclasses.replace(rc, target=target_fraction))
    log.info("%s: %s", name, solution.describe())
    return out, solution


def unit_costs(
    scores: Mapping[str, Tensor],
    clusters: Sequence[ResolvedCluster],
    *,
    declared: Mapping[str, str] | None = None,
    comparable: bool,
) -> dict[str, list[float]]:
    """Cluster name -> the removal cost of each unit, from unit scores (see the module docs).

    Args:
        scores: Cluster name -> ``[C]`` unit scores (layer clusters are ignored: their cost is derived by the solver).
        clusters: The resolved clusters.
        declared: Cluster name -> declaration label (a family); a cluster not in it is its own family.
        comparable: Whether the scores of single-reader clusters are activation scores (the residual stream's RMS
            change); ``False`` for weight scores.

    Returns:
        The costs of every width cluster that has a score.
    """
    families: dict[str, list[ResolvedCluster]] = {}
    for rc in clusters:
        if not is_layer_cluster(rc) and rc.name in scores:
            families.setdefault((declared or {}).get(rc.name, rc.name), []).append(rc)
    raw = {rc.name: [float(v) ** 2 for v in scores[rc.name].detach().double().cpu().tolist()] for f in families.values()
           for rc in f}  # fmt: skip

    def per_param(members: Sequence[ResolvedCluster]) -> float:
        cost = sum(sum(raw[rc.name]) for rc in members)
        return cost / max(sum(rc.num_units * rc.unit_numel for rc in members), 1)

    direct = {f: m for f, m in families.items() if comparable and all(_readers(rc) == 1 for rc in m)}
    reference = per_param([rc for m in direct.values() for rc in m]) if direct else 1.0
    out: dict[str, list[float]] = {}
    for family, members in families.items():
        scale = 1.0 if family in direct else reference / (per_param(members) or 1.0)
        for rc in members:
            out[rc.name] = [c * scale for c in raw[rc.name]]
    return out


def _readers(rc: ResolvedCluster) -> int:
    return sum(1 for m in rc.members if m.role == "reader")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = [
    "LAYER_BUDGET", "WIDTHS", "check_target", "declaration_labels", "distinct_shapes", "sized_clusters", "unit_costs",
]  # fmt: skip
