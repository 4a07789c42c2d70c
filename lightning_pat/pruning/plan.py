"""The plan of a pruning run: declarations resolved against a model and routed, sized, checked for feasibility.

:func:`make_plan` is the one plan builder of :func:`~lightning_pat.prune_clusters`, the callback's controller and
:class:`~lightning_pat.pruning.pruner.Pruner`; :meth:`Plan.sized` applies a size target as per-cluster targets
(:meth:`Plan.for_size` from the options' :class:`~lightning_pat.pruning.options.SizeTarget` group);
:func:`check_not_emptied` refuses a target below 1 that would remove every unit of a cluster. Global metadata only:
nothing here communicates or mutates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_pat.core.choices import Side
from lightning_pat.core.norms import ScoreType
from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import Cluster, ResolvedCluster, resolve_clusters
from lightning_pat.parallel.comm import dtensor
from lightning_pat.parallel.executors import ExecutorKind, route
from lightning_pat.sizing.flops import flop_costs
from lightning_pat.sizing.problem import SizeSolution
from lightning_pat.sizing.targets import declaration_labels, sized_clusters

if TYPE_CHECKING:
    from lightning_pat.pruning.options import SizeTarget


@dataclass(frozen=True)
class Plan:
    """Declarations resolved against a model and routed to executors (global metadata only, no communication).

    Built by :func:`make_plan`; shared by :func:`~lightning_pat.prune_clusters`, the callback and
    :class:`~lightning_pat.pruning.pruner.Pruner`, so that per-cluster targets are applied in one place.

    Attributes:
        clusters: The resolved clusters this rank takes part in (all, except ranks outside a sub-mesh).
        routes: Cluster name -> ``(executor kind, reason)``.
        score: Score normalisation.
        group_count_ref: Opt-in score correction for shared budgets.
    """

    clusters: tuple[ResolvedCluster, ...]
    routes: dict[str, tuple[str, str]]
    score: ScoreType = "rms"
    group_count_ref: int | None = None

    def sized(
        self,
        params: Mapping[str, Tensor],
        target_params: object,
        *,
        side: Side = "below",
        declarations: Sequence[Cluster | Mapping[str, Any]] = (),
        keep_layers: int | None = None,
        widths: str = "uniform",
        min_kept: float | None = None,
        flops: tuple[nn.Module, int] | None = None,
        importance: Mapping[str, Sequence[float]] | None = None,
    ) -> tuple[Plan, SizeSolution]:
        """This plan with the per-cluster targets that reach ``target_params`` (see :mod:`lightning_pat.sizing`).

        The clusters of one of ``declarations`` keep one width (uniform over the layers); ``keep_layers`` fixes the
        number of layers kept (layer units); ``widths="ranked"`` ranks the units of a declaration's clusters jointly
        instead, each keeping at least ``min_kept`` of its units. ``flops=(model, seq_len)``: ``target_params`` is
        a count of FLOPs per token instead (see :mod:`lightning_pat.sizing.flops`). ``importance``: each unit's removal
        cost (:func:`~lightning_pat.sizing.targets.unit_costs`), so that the widths are allocated by importance.

        Raises:
            ValueError: If the target is malformed, above the model's size or below what the clusters can reach.
        """
        declared = declaration_labels(params, declarations)
        clusters, solution = sized_clusters(
            params, self.clusters, target_params, side=side, declared=declared, keep_layers=keep_layers,
            widths=widths, min_kept=min_kept, name="target_params" if flops is None else "target_flops",
            costs=None if flops is None else flop_costs(flops[0], self.clusters, seq_len=flops[1]),
            importance=importance,
        )  # fmt: skip
        check_not_emptied(clusters, 0.0)  # the solver keeps a unit of every cluster; refuse loudly if not
        routes = {rc.name: self.routes[rc.name] for rc in clusters}
        return dataclasses.replace(self, clusters=tuple(clusters), routes=routes), solution

    def for_size(
        self,
        params: Mapping[str, Tensor],
        target: SizeTarget,
        *,
        declarations: Sequence[Cluster | Mapping[str, Any]] = (),
        model: nn.Module | None = None,
        importance: Mapping[str, Sequence[float]] | None = None,
    ) -> tuple[Plan, SizeSolution]:
        """:meth:`sized` for a size-target group: its options are read here, once, for every entry point.

        ``model`` is the module whose FLOPs a ``target_flops`` counts (needed then).

        Raises:
            ValueError: As :meth:`sized`.
        """
        flops = None
        if target.target_flops is not None:
            assert model is not None, "target_flops counts the FLOPs of `model`: pass it"
            flops = (model, int(target.seq_len or 0))
        return self.sized(
            params, target.value, side=target.target_side, declarations=declarations, keep_layers=target.target_layers,
            widths=target.target_widths, min_kept=target.min_kept, flops=flops, importance=importance,
        )  # fmt: skip

    def targets(self, sparsity: float, *, fraction: float = 1.0) -> dict[str, float]:
        """Per cluster, ``fraction`` of its final target (its own ``target``, else ``sparsity``)."""
        return {rc.name: fraction * (sparsity if rc.target is None else rc.target) for rc in self.clusters}


def named_tensors(params: nn.Module | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``params`` as a mapping of names to tensors (a module's parameters, tied ones under every name)."""
    return dict(params.named_parameters(remove_duplicate=False)) if isinstance(params, nn.Module) else params


def make_plan(
    params: nn.Module | Mapping[str, Tensor],
    clusters: Sequence[ResolvedCluster] | Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]],
    *,
    score: ScoreType = "rms",
    executor: ExecutorKind = "auto",
    group_count_ref: int | None = None,
    sparsity: float | None = None,
) -> Plan:
    """Resolve declarations (unless already resolved) and route every cluster; mutates nothing.

    The options are taken as they are: each entry point checked them once (``PruningOptions``, ``StepOptions``, a
    :class:`~lightning_pat.pruning.pruner.Pruner` given resolved clusters); ``executor`` is checked by the routing.

    Args:
        params: The model, or a mapping of parameter names to tensors, holding every member.
        clusters: Declarations, or already resolved clusters.
        score: Score normalisation.
        executor: ``"auto"``, ``"materializing"`` or ``"sharded"``.
        group_count_ref: Opt-in score correction for shared budgets.
        sparsity: The final target of clusters without their own ``target``; when given, a target below 1 that
            would drop every unit of a cluster is refused (see :func:`check_not_emptied`).

    Raises:
        ValueError: If ``executor`` is unknown, a declaration is invalid (see :func:`~lightning_pat.resolve_clusters`),
            no executor can serve a cluster correctly, or a target below 1 would empty a cluster.
    """
    named = named_tensors(params)
    items = [clusters] if isinstance(clusters, (Cluster, Mapping)) else list(clusters)
    if all(isinstance(c, ResolvedCluster) for c in items):
        resolved: list[ResolvedCluster] = list(items)  # type: ignore[arg-type]
    else:
        resolved = resolve_clusters(named, items)  # type: ignore[arg-type]
    if sparsity is not None:  # every cluster, not only this rank's: every rank raises the same error
        check_not_emptied(resolved, sparsity)
    mine = tuple(rc for rc in resolved if dtensor.participates(named[rc.members[0].name]))
    return Plan(mine, route(mine, named, executor=executor), score, group_count_ref)


def _emptied(target: float, num_units: int, multiple_of: int) -> str | None:
    """Why ``target`` (below 1) would drop every one of ``num_units`` units, or ``None`` if it keeps some."""
    if target <= 0.0 or target >= 1.0 or num_units == 0:
        return None
    if multiple_of > num_units:
        return f"`multiple_of={multiple_of}` is larger than its {num_units} unit(s), so any drop keeps none"
    if num_to_drop(target, num_units, multiple_of=multiple_of) < num_units:
        return None
    raw = min(num_units, math.ceil(round(target * num_units, 9)))
    why = f"ceil({target:g} * {num_units}) = {raw} of its {num_units} unit(s) are dropped"
    return why + (f", and rounding the kept count to `multiple_of={multiple_of}` keeps none" if raw < num_units else "")


def check_not_emptied(clusters: Sequence[ResolvedCluster], sparsity: float) -> None:
    """Refuse a target below 1 that would drop every unit of a cluster (DESIGN invariant 11).

    The number of dropped units is ``ceil(target * C)``, so a 1-unit cluster (e.g. the heads of a model with one KV
    head), a tiny cluster at a high target, or a ``multiple_of`` larger than what would be kept empties the cluster
    although the target is below 1. A shared budget is checked on its total and on each member's ``multiple_of``.
    Only the final target is checked: the ramp's targets are smaller.

    Args:
        clusters: The resolved clusters (all of them, on every rank).
        sparsity: The final target of clusters without their own ``target``.

    Raises:
        ValueError: Naming every such cluster, its units, target and ``multiple_of``, and how to exclude it.
    """
    bad: list[str] = []
    budgets: dict[str, list[ResolvedCluster]] = {}
    for rc in clusters:
        target = sparsity if rc.target is None else rc.target
        if rc.budget is not None:
            budgets.setdefault(rc.budget, []).append(rc)
            why = _emptied(target, rc.num_units, rc.multiple_of) if rc.multiple_of > rc.num_units else None
        else:
            why = _emptied(target, rc.num_units, rc.multiple_of)
        if why is not None:
            bad.append(f"{rc.name!r} (target {target:g}: {why})")
    for budget, group in budgets.items():
        target = sparsity if group[0].target is None else group[0].target
        why = _emptied(target, sum(rc.num_units for rc in group), 1)
        if why is not None:
            bad.append(f"budget {budget!r} (target {target:g}: {why})")
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"A target below 1 would remove every unit of {len(bad)} cluster(s): {shown}. Nothing was pruned. "
            "Exclude such a cluster: give its declaration `target=0.0` (or a target that keeps a unit), leave it out "
            "of `clusters`, lower `multiple_of`, or for a preset turn its kind off (e.g. for a model with one KV "
            "head: `preset_options={'heads': False}` in the callback, `presets.resolve_preset(name, model, "
            "heads=False)` for prune_clusters); use target 1.0 only if removing everything is intended."
        )
