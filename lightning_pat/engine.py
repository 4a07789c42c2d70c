"""One pruning step over resolved clusters, outside or inside a Trainer (no Lightning here).

:class:`Pruner` routes clusters to executors once, then on each step gathers unit norms, turns them into scores,
selects units (per cluster or per shared budget), and applies the selection. It remembers the last selection so
that it can be held (re-applied) between fresh selections and frozen during healing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_pat import presets
from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.scoring import SCORE_TYPES, WEIGHT_SCORES, ScoreType, group_count_correction, normalise
from lightning_pat.core.selection import (
    bottom_k,
    bottom_k_balanced,
    bottom_k_floored,
    bottom_k_rows,
    bottom_k_shared,
    check_finite,
    num_to_drop,
    round_kept,
    shrink_factors,
)
from lightning_pat.core.spec import Cluster, ResolvedCluster, found_clusters, resolve_clusters
from lightning_pat.options import METHODS, Method, auto_declarations, check_choice, check_number
from lightning_pat.parallel.comm import dtensor, ranks
from lightning_pat.parallel.executors import (
    Evidence,
    Executor,
    ExecutorKind,
    Reduced,
    UnitAction,
    build_executors,
    route,
)
from lightning_pat.sizing.flops import check_flops, flop_costs
from lightning_pat.sizing.problem import Side, SizeSolution
from lightning_pat.sizing.targets import check_target, declaration_labels, sized_clusters, unit_costs

if TYPE_CHECKING:
    from lightning_pat.scoring.activation import ActivationStats
    from lightning_pat.scoring.layers import LayerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PruneResult:
    """What one pruning step did.

    Attributes:
        dropped: Cluster name -> sorted dropped unit indices.
        num_units: Cluster name -> ``C``.
        zeros: Parameter name -> literal zeros after the step (only when counted).
        numel: Parameter name -> number of elements (only when counted).
        routes: Cluster name -> executor kind that served it.
        clusters: The resolved clusters the result refers to (what :func:`~lightning_pat.shrink` needs).
        size: With ``target_params``: the solved widths, the achieved count and its neighbours.
    """

    dropped: dict[str, list[int]]
    num_units: dict[str, int]
    zeros: dict[str, int] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)
    clusters: tuple[ResolvedCluster, ...] = ()
    size: SizeSolution | None = None

    @property
    def unit_sparsity(self) -> float:
        """Dropped units over all units of all clusters."""
        total = sum(self.num_units.values())
        return sum(len(v) for v in self.dropped.values()) / total if total else 0.0

    @property
    def param_sparsity(self) -> float | None:
        """Literal zeros over elements of the clustered parameters (each counted once), if counted."""
        total = sum(self.numel.values())
        return sum(self.zeros.values()) / total if total else None


@dataclass(frozen=True)
class Plan:
    """Declarations resolved against a model and routed to executors (global metadata only, no communication).

    Built by :func:`make_plan`; shared by :func:`prune_clusters`, the callback and :class:`Pruner`, so that options
    are validated and per-cluster targets are applied in one place.

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
        declarations: Sequence[Cluster | Mapping] = (),
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

    def targets(self, sparsity: float, *, fraction: float = 1.0) -> dict[str, float]:
        """Per cluster, ``fraction`` of its final target (its own ``target``, else ``sparsity``)."""
        return {rc.name: fraction * (sparsity if rc.target is None else rc.target) for rc in self.clusters}


def _named(params: nn.Module | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    return dict(params.named_parameters(remove_duplicate=False)) if isinstance(params, nn.Module) else params


def make_plan(
    params: nn.Module | Mapping[str, Tensor],
    clusters: Sequence[ResolvedCluster] | Cluster | Mapping | Sequence[Cluster | Mapping],
    *,
    score: ScoreType = "rms",
    executor: ExecutorKind = "auto",
    group_count_ref: int | None = None,
    sparsity: float | None = None,
) -> Plan:
    """Validate options, resolve declarations (unless already resolved) and route every cluster; mutates nothing.

    Args:
        params: The model, or a mapping of parameter names to tensors, holding every member.
        clusters: Declarations, or already resolved clusters.
        score: Score normalisation.
        executor: ``"auto"``, ``"materializing"`` or ``"sharded"``.
        group_count_ref: Opt-in score correction for shared budgets.
        sparsity: The final target of clusters without their own ``target``; when given, a target below 1 that
            would drop every unit of a cluster is refused (see :func:`check_not_emptied`).

    Raises:
        ValueError: If an option is unknown or out of range, a declaration is invalid (see
            :func:`~lightning_pat.resolve_clusters`), no executor can serve a cluster correctly, or a target below
            1 would empty a cluster.
    """
    check_choice("score", score, SCORE_TYPES)
    if group_count_ref is not None:
        check_number("group_count_ref", group_count_ref, low=1, integer=True)
    named = _named(params)
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


class Pruner:
    """Coupled pruning over a fixed set of resolved clusters.

    Args:
        params: The model, or a mapping of parameter names to tensors, holding every member.
        clusters: Resolved clusters (see :func:`~lightning_pat.resolve_clusters`), or a :class:`Plan` from
            :func:`make_plan` (already validated and routed; the options below are then taken from it).
        score: Score normalisation: ``"rms"``, ``"l2"`` or ``"param_cost"``; or ``"activation"``, whose unit scores
            are passed to :meth:`select` / :meth:`step` as ``scores`` (see :mod:`lightning_pat.scoring.activation`).
        executor: ``"auto"``, ``"materializing"`` or ``"sharded"`` (:func:`~lightning_pat.parallel.executors.route`).
        group_count_ref: If set, scores of clusters in a shared budget are multiplied by ``sqrt(C / ref)``.

    Raises:
        ValueError: If an option is unknown or an executor cannot serve a cluster.
    """

    def __init__(
        self,
        params: nn.Module | Mapping[str, Tensor],
        clusters: Sequence[ResolvedCluster] | Plan,
        *,
        score: ScoreType = "rms",
        executor: ExecutorKind = "auto",
        group_count_ref: int | None = None,
    ) -> None:
        plan = clusters if isinstance(clusters, Plan) else make_plan(
            params, clusters, score=score, executor=executor, group_count_ref=group_count_ref
        )  # fmt: skip
        self.plan = plan
        self.score = plan.score
        self.group_count_ref = plan.group_count_ref
        self.clusters = list(plan.clusters)
        self.routes = dict(plan.routes)
        self.executors: list[Executor] = build_executors(
            self.clusters, _named(params), self.routes, data_aware=self.score == "activation"
        )
        self.last: dict[str, UnitAction] = {}

    @contextmanager
    def _session(self) -> Iterator[None]:
        with ExitStack() as stack:
            for ex in self.executors:
                stack.enter_context(ex.session())
            yield

    # ------------------------------------------------------------------ selection
    def _scores(self, q: Mapping[str, Tensor], given: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
        """Unit scores: ``given`` (activation-aware or layer scores) where passed, else the weight score of ``q``.

        With a weight score, ``given`` may name only some clusters (e.g. layer units scored by ``1 - cos``); with
        ``score="activation"`` it must name every cluster except layer units, which fall back to ``"rms"``.
        """
        if given is not None:
            weight = self.score in WEIGHT_SCORES
            missing = [rc.name for rc in self.clusters if rc.name not in given and not (weight or is_layer_cluster(rc))]
            wrong = [rc.name for rc in self.clusters if rc.name in given and given[rc.name].shape != (rc.num_units,)]
            if missing or wrong:
                raise ValueError(
                    f"`scores` must hold one [C] tensor per cluster; missing {missing[:5]}, wrong shape {wrong[:5]}."
                )
            fallback = self.score if weight else "rms"
            return {
                rc.name: given[rc.name]
                if rc.name in given
                else normalise(q[rc.name], unit_numel=rc.unit_numel, score=fallback)  # type: ignore[arg-type]
                for rc in self.clusters
            }
        if self.score not in WEIGHT_SCORES:
            raise ValueError(
                f"score={self.score!r} needs precomputed unit scores: pass `scores=` (see "
                "lightning_pat.scoring.activation.ActivationStats.unit_scores), or use a weight score "
                f"{WEIGHT_SCORES}."
            )
        return {rc.name: normalise(q[rc.name], unit_numel=rc.unit_numel, score=self.score) for rc in self.clusters}

    def select(
        self,
        targets: Mapping[str, float],
        *,
        method: Method = "hard",
        threshold: float = 0.0,
        scores: Mapping[str, Tensor] | None = None,
        evidence: Evidence | None = None,
    ) -> dict[str, UnitAction]:
        """Score every cluster and decide what to drop (no mutation).

        Args:
            targets: Cluster name -> fraction of units to drop (a floor for ``group_lasso``).
            method: ``"hard"`` or ``"group_lasso"``.
            threshold: ``lambda * gamma`` for ``group_lasso``.
            scores: Cluster name -> ``[C]`` unit scores that replace the weight score for ranking (the group-lasso
                shrinkage still acts on the weights' unit norms). Required when the pruner's score is
                ``"activation"`` (unless ``evidence`` is given); identical on every rank, or ranks select differently.
            evidence: A data-aware score (activation statistics, gradient sums) whose rank-local partials travel in
                the executors' one reduction with the weight partials; it gives the scores of the clusters that
                ``scores`` does not name (``scores`` wins where both do: layer units scored by ``1 - cos``).

        Returns:
            Cluster name -> action.

        Raises:
            ValueError: If ``scores`` lacks a cluster or has a wrong shape, or the score type needs ``scores``.
        """
        check_choice("method", method, METHODS)
        with self._session():  # dense copies (if any) do not outlive the call
            q, scores = self._reduce(scores, evidence, weights=self._weights_read(method, scores, evidence))
        return self._decide(q, targets, method=method, threshold=threshold, scores=scores)

    def _weights_read(
        self, method: Method, scores: Mapping[str, Tensor] | None, evidence: Evidence | None
    ) -> set[str] | None:
        """The clusters whose ``Q`` a selection reads (``None``: every cluster), the same on every rank.

        A data-aware score (``evidence``) ranks every cluster but the layer units, so ``Q`` is read only for the
        layer units that ``scores`` does not rank (their ``"rms"`` fallback); a weight score and the group lasso's
        shrinkage read every cluster's. Skipping the rest saves a pass over every clustered weight per selection.
        """
        if evidence is None or method == "group_lasso" or self.score in WEIGHT_SCORES:
            return None
        given = scores or {}
        return {rc.name for rc in self.clusters if is_layer_cluster(rc) and rc.name not in given}

    def _reduce(
        self,
        scores: Mapping[str, Tensor] | None,
        evidence: Evidence | None,
        *,
        weights: set[str] | None = None,
    ) -> tuple[dict[str, Tensor], Mapping[str, Tensor] | None]:
        """``Q`` from every executor (of ``weights`` only, if given), and the scores (``evidence``'s, if given).

        The evidence's partials are reduced in the same collectives as ``Q``.
        """
        if evidence is None:
            q: dict[str, Tensor] = {}
            for ex in self.executors:
                q.update(ex.unit_sq_norms(weights))
            return q, scores
        shard, data = evidence.shard_riders(), evidence.data_riders()
        total = Reduced({})
        for ex in self.executors:
            part = ex.reduce(shard_riders=shard, data_riders=data, columns=evidence.columns, weights=weights)
            total.q.update(part.q)
            total.shard.update(part.shard)
            total.data.update(part.data)
            total.columns.update(part.columns)
        found = evidence.finish(total)
        return total.q, found if scores is None else {**found, **scores}  # given scores (layer units) take precedence

    def _decide(
        self,
        q: Mapping[str, Tensor],
        targets: Mapping[str, float],
        *,
        method: Method,
        threshold: float,
        scores: Mapping[str, Tensor] | None = None,
    ) -> dict[str, UnitAction]:
        scores = self._scores(q, scores)
        dropped = self._hard_floor(scores, targets)
        actions = {}
        for rc in self.clusters:
            if method == "group_lasso":
                factors = shrink_factors(q[rc.name].sqrt(), threshold=threshold * rc.unit_numel**0.5)
                factors[dropped[rc.name]] = 0.0
                actions[rc.name] = UnitAction(torch.nonzero(factors == 0).flatten(), factors)
            else:
                actions[rc.name] = UnitAction(dropped[rc.name])
        return actions

    def _hard_floor(self, scores: Mapping[str, Tensor], targets: Mapping[str, float]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        budgets: dict[str, list[ResolvedCluster]] = {}
        same: dict[tuple[int, int, int, torch.dtype, torch.device], list[ResolvedCluster]] = {}
        for rc in self.clusters:
            if rc.budget is not None:
                budgets.setdefault(rc.budget, []).append(rc)
                continue
            num = num_to_drop(targets[rc.name], rc.num_units, multiple_of=rc.multiple_of)
            s = scores[rc.name]
            same.setdefault((rc.num_units, num, rc.unit_groups, s.dtype, s.device), []).append(rc)
        for (_, num, unit_groups, _, _), group in same.items():  # one finite check and one sort per equal-sized group
            if unit_groups > 1:  # GQA query heads: the same count from every KV group
                for rc in group:
                    check_finite(scores[rc.name], f"Cluster {rc.name!r}")
                stacked_KC = torch.stack([scores[rc.name] for rc in group])
                for rc, row in zip(group, bottom_k_balanced(stacked_KC, num_drop=num, groups=unit_groups),
                                   strict=True):  # fmt: skip
                    out[rc.name] = row
                continue
            if len(group) == 1:
                rc = group[0]
                out[rc.name] = bottom_k(scores[rc.name], num_drop=num, what=f"Cluster {rc.name!r}")
                continue
            stacked_KC = torch.stack([scores[rc.name] for rc in group])
            if not bool(torch.isfinite(stacked_KC).all()):
                for rc in group:  # name the first cluster with a non-finite score
                    check_finite(scores[rc.name], f"Cluster {rc.name!r}")
            picked_KN = bottom_k_rows(stacked_KC, num_drop=num)
            for rc, row in zip(group, picked_KN, strict=True):
                out[rc.name] = row
        for budget, group in budgets.items():
            for rc in group:  # name the cluster, not only the budget (joint indices would mislead)
                check_finite(scores[rc.name], f"Cluster {rc.name!r} (budget {budget!r})")
            corrected = [group_count_correction(scores[rc.name], reference=self.group_count_ref) for rc in group]
            total = sum(rc.num_units for rc in group)
            num = num_to_drop(targets[group[0].name], total)
            if any(rc.min_kept or rc.unit_groups > 1 for rc in group):  # chunks of multiple_of, ranked jointly
                floors, mults = [rc.min_kept for rc in group], [rc.multiple_of for rc in group]
                picked = bottom_k_floored(
                    corrected, num_drop=num, floors=floors, multiples=mults, groups=[rc.unit_groups for rc in group]
                )
                for rc, sel in zip(group, picked, strict=True):
                    out[rc.name] = sel
                continue
            picked = bottom_k_shared(corrected, num_drop=num, what=f"Budget {budget!r}")
            for rc, sel in zip(group, picked, strict=True):
                out[rc.name] = round_kept(sel, scores[rc.name], multiple_of=rc.multiple_of)
        return out

    # ------------------------------------------------------------------ mutation
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """Apply actions to the weights (or gradients) of every executor's clusters."""
        for ex in self.executors:
            if not ex.in_session and not grads:
                with ex.session():
                    ex.apply(actions, grads=grads)
            else:
                ex.apply(actions, grads=grads)

    def step(
        self,
        targets: Mapping[str, float],
        *,
        method: Method = "hard",
        threshold: float = 0.0,
        count: bool = False,
        scores: Mapping[str, Tensor] | None = None,
        evidence: Evidence | None = None,
    ) -> PruneResult:
        """Select and apply a fresh projection; remember it as the current mask.

        ``scores`` and ``evidence``: see :meth:`select`.
        """
        check_choice("method", method, METHODS)
        with self._session():  # one dense copy per parameter for the whole step, none afterwards
            q, scores = self._reduce(scores, evidence, weights=self._weights_read(method, scores, evidence))
            actions = self._decide(q, targets, method=method, threshold=threshold, scores=scores)
            self.apply(actions)
            self.last = actions
            return self.result(count=count)

    def hold(self, *, rescale: bool = False) -> None:
        """Re-apply the current mask (zero the dropped units; with ``rescale``, also the group-lasso factors)."""
        if not self.last:
            return
        actions = self.last if rescale else {k: UnitAction(a.dropped) for k, a in self.last.items()}
        self.apply(actions)

    def zero_grads(self) -> None:
        """Zero the gradients of the dropped units (healing)."""
        if self.last:
            self.apply({k: UnitAction(a.dropped) for k, a in self.last.items()}, grads=True)

    def unit_sq_norms(self) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` squared norm of every unit over all members (float64; a collective when sharded).

        Identical on every participating rank (the executors' one reduction), so a decision taken from it is too.
        """
        with self._session():
            q, _ = self._reduce(None, None)
        return q

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Literal zeros and numel per clustered parameter (global, identical on every participating rank)."""
        zeros, numel = {}, {}
        for ex in self.executors:
            for name, (z, n) in ex.zero_counts().items():
                zeros[name], numel[name] = z, n
        return zeros, numel

    def result(self, *, count: bool = False) -> PruneResult:
        """The current mask as a :class:`PruneResult` (with literal-zero counts if ``count``)."""
        zeros, numel = self.counts() if count else ({}, {})
        return PruneResult(
            dropped=self._dropped_lists(),
            num_units={rc.name: rc.num_units for rc in self.clusters},
            zeros=zeros,
            numel=numel,
            routes={name: kind for name, (kind, _) in self.routes.items()},
            clusters=tuple(self.clusters),
        )

    # ------------------------------------------------------------------ state
    def _dropped_lists(self) -> dict[str, list[int]]:
        """Every cluster's dropped indices as lists, with one device-to-host copy for all of them."""
        held = [self.last[rc.name].dropped if rc.name in self.last else None for rc in self.clusters]
        present = [d for d in held if d is not None]
        if len({d.device for d in present}) > 1:
            present = [d.cpu() for d in present]
        flat = torch.cat(present).tolist() if present else []
        out, start = {}, 0
        for rc, d in zip(self.clusters, held, strict=True):
            n = 0 if d is None else d.numel()
            out[rc.name] = flat[start : start + n]
            start += n
        return out

    def dropped(self, name: str) -> list[int]:
        """Sorted dropped unit indices of cluster ``name`` in the current mask."""
        action = self.last.get(name)
        return [] if action is None else action.dropped.tolist()

    def factors(self) -> dict[str, Tensor]:
        """Cluster name -> group-lasso factors of the current mask (only clusters that have them)."""
        return {k: a.factors for k, a in self.last.items() if a.factors is not None}

    def load_dropped(self, dropped: Mapping[str, Sequence[int]], factors: Mapping[str, Tensor] | None = None) -> None:
        """Set the current mask from index lists (and group-lasso factors), e.g. on resume; nothing is applied."""
        by_name = {rc.name: rc for rc in self.clusters}
        factors = factors or {}
        self.last = {}
        for name, idx in dropped.items():
            if name in by_name:
                f = factors.get(name)
                self.last[name] = UnitAction(
                    torch.tensor(sorted(idx), dtype=torch.long), None if f is None else torch.as_tensor(f).clone()
                )

    def rebind(self, params: Mapping[str, Tensor]) -> None:
        """Point the executors at new tensor objects with the same names, shapes and layouts (routes are kept).

        Used where parameters are only temporarily materialized, e.g. inside FSDP1's ``summon_full_params``.
        """
        self.executors = build_executors(self.clusters, params, self.routes, data_aware=self.score == "activation")


def _one_shot_score(score: str, activations: object, calibration: object) -> ScoreType:
    """``prune_clusters``' score: ``"auto"`` resolved (activation with data, else rms and a warning in the log).

    Raises:
        ValueError: If both ``activations`` and ``calibration`` are given, or ``calibration`` with a weight score.
    """
    if activations is not None and calibration is not None:
        raise ValueError(
            "prune_clusters: give `calibration` (batches: calibrated here) or `activations` (statistics calibrated "
            "already), not both."
        )
    if calibration is not None and score not in ("auto", "activation"):
        raise ValueError(
            f"prune_clusters: `calibration` feeds the activation score, but score={score!r}; use score='auto' (or "
            "'activation'), or drop `calibration`."
        )
    if score != "auto":
        return score  # type: ignore[return-value]
    if activations is not None or calibration is not None:
        return "activation"
    log.warning(
        "prune_clusters: score='auto' without calibration data scores units by their weights ('rms'), which can "
        "wreck a pretrained model; pass `calibration=[batch, ...]` (a few batches of inputs) for the activation score."
    )
    return "rms"


def one_shot_calibration(
    model: nn.Module,
    clusters: object,
    score: str,
    activations: ActivationStats | None,
    calibration: Sequence[Any] | None,
    *,
    layer_stats: LayerStats | None = None,
) -> tuple[ScoreType, ActivationStats | None, LayerStats | None]:
    """The one-shot score (``"auto"`` resolved) and the statistics, calibrated on ``calibration`` if given.

    With ``calibration``: activation statistics for the width clusters and, when the clusters hold layer units and
    no ``layer_stats`` are given, the layer cosines.

    Raises:
        ValueError: As for :func:`prune_clusters` (``calibration`` with ``activations`` or a weight score, or not a
            list of batches; an invalid declaration).
    """
    score = _one_shot_score(score, activations, calibration)
    if calibration is None:
        return score, activations, layer_stats
    from lightning_pat.scoring.activation import calibrate
    from lightning_pat.scoring.layers import calibrate_layers

    if isinstance(calibration, (str, bytes, Mapping)) or not isinstance(calibration, Sequence):
        raise ValueError(
            "prune_clusters: `calibration` must be a list of batches (each passed as `model(batch)`), got "
            f"{type(calibration).__name__}; e.g. calibration=[ids[i : i + 4] for i in range(0, 32, 4)]."
        )
    resolved = resolve_clusters(model, clusters)  # type: ignore[arg-type]
    stats = calibrate(model, resolved, calibration)
    if layer_stats is None and any(is_layer_cluster(rc) for rc in resolved):
        layer_stats = calibrate_layers(model, resolved, calibration)
    return score, stats, layer_stats


#: ``target_allocation``: by unit costs per parameter removed, or by kept fractions (see :mod:`lightning_pat.sizing`).
ALLOCATIONS: tuple[str, ...] = ("importance", "fractions")
Allocation = Literal["importance", "fractions"]


def plan_importance(
    model: nn.Module,
    plan: Plan,
    declarations: Sequence[Cluster | Mapping],
    *,
    activations: ActivationStats | None = None,
) -> dict[str, list[float]]:
    """Each unit's removal cost for the size solver: from ``activations`` if given, else from the plan's weight score.

    Unit norms (and the statistics, for DTensors) are reduced as for a selection, so every rank gets the same costs.

    Args:
        model: The model the plan was made for.
        plan: The unsized plan.
        declarations: The declarations (their families: see :func:`~lightning_pat.sizing.targets.unit_costs`).
        activations: Calibrated statistics (``score="activation"``).

    Returns:
        Cluster name -> unit costs (layer clusters left out: the solver derives theirs).
    """
    pruner = Pruner(model, plan)
    sharded = any(dtensor.is_dtensor(t) for t in _named(model).values())
    with torch.no_grad(), pruner._session():  # noqa: SLF001 - the pruner's own reduction, as for a selection
        if activations is not None and not sharded:
            q, scores = pruner._reduce(activations.unit_scores(_named(model)), None)  # noqa: SLF001
        else:
            q, scores = pruner._reduce(None, activations)  # noqa: SLF001
    if activations is None:
        weight = plan.score if plan.score in WEIGHT_SCORES else "rms"
        scores = {rc.name: normalise(q[rc.name], unit_numel=rc.unit_numel, score=weight) for rc in plan.clusters}  # type: ignore[arg-type]
    assert scores is not None
    declared = declaration_labels(_named(model), declarations)
    return unit_costs(scores, plan.clusters, declared=declared, comparable=activations is not None)


def prune_clusters(
    model: nn.Module,
    clusters: str | Cluster | Mapping | Sequence[str | Cluster | Mapping],
    sparsity: float | None = None,
    *,
    target_params: int | float | str | None = None,
    target_side: Side = "below",
    target_layers: int | None = None,
    target_widths: str = "uniform",
    min_kept: float | None = None,
    target_flops: int | float | str | None = None,
    seq_len: int | None = None,
    target_allocation: Allocation = "importance",
    score: ScoreType | Literal["auto"] = "auto",
    executor: ExecutorKind = "auto",
    method: Method = "hard",
    reg_lambda: float = 0.0,
    gamma: float = 1.0,
    group_count_ref: int | None = None,
    activations: ActivationStats | None = None,
    layer_stats: LayerStats | None = None,
    calibration: Sequence[Any] | None = None,
) -> PruneResult:
    """Run one coupled projection on ``model`` outside any Trainer (plain tensors or DTensors).

    Clusters with their own ``target`` use it; the others use ``sparsity``.

    Args:
        model: The module to prune in place.
        clusters: Cluster declarations (see :class:`~lightning_pat.Cluster`), a :func:`~lightning_pat.discover`
            result, a preset name (``"llama"``, ``"linear_chain"``, ...) or a list mixing both, as for the callback.
            ``"auto"`` means what it means for the callback: the preset that fits, else discovery by tracing the
            model's ``example_input_array`` (without one, an error points at ``discover(model, x)``).
        sparsity: Fraction of each cluster's units to drop (``hard``), or the floor for ``group_lasso``. Give it or
            a size target: with ``target_params`` or ``target_flops`` it is unused and warns (as the callback's
            ``target_sparsity`` does).
        target_params: A size to reach instead: an absolute count (``4e9``, ``"4B"``, ``"350M"``) or a fraction of
            the model's parameters. The per-cluster widths are solved (uniform per declaration, counting every
            parameter a unit carries; see :mod:`lightning_pat.sizing.solver`); ``result.size`` reports the achieved
            count and the nearest achievable ones on either side.
        target_side: ``"below"`` (default): the closest achievable count not above ``target_params``; ``"above"``.
        target_layers: With layer units and ``target_params``: the number of layers to keep; the widths make up the
            rest. By default the solver balances depth and widths (the same kept fraction).
        target_widths: ``"uniform"`` (default: one width per declaration, what a stock config loads) or
            ``"ranked"``: the units of a declaration's clusters (e.g. every layer's MLP) are ranked jointly by score,
            so the widths differ between layers; the solver fixes their total (export: ``save_pretrained`` /
            ``load_pretrained``).
        min_kept: With ``target_widths="ranked"``: the fraction of each cluster's units it keeps at least (default
            0.25, rounded up to ``multiple_of``).
        target_flops: Instead of ``target_params``: forward FLOPs per token for sequences of ``seq_len`` tokens
            (``"2M"``, or a fraction of the model's): matmul weights cost ``2 * out * in``, attention scores and
            values ``4 * S`` per query channel, lookups nothing (see :mod:`lightning_pat.sizing.flops`).
        seq_len: The sequence length ``S`` of ``target_flops``.
        target_allocation: How a size target is spread over the kinds (MLP channels, heads, layers, the residual):
            ``"importance"`` (default): granules leave in increasing cost per parameter removed, a unit's cost being
            its squared score (with ``activations``: the expected squared change of the residual stream, comparable
            across kinds; weight scores are scaled per kind, see :mod:`lightning_pat.sizing`); ``"fractions"``: the
            kind with the highest kept fraction loses a granule first.
        score: ``"auto"`` (default): ``"activation"`` when ``calibration`` or ``activations`` is given, else
            ``"rms"`` with a warning in the log (weight scores can wreck a pretrained model: SmolLM2 at 77M
            parameters, 13.7 nats/token with ``"rms"`` vs 5.9 with ``"activation"``); ``"rms"``, ``"l2"``,
            ``"param_cost"``; or ``"activation"`` (needs ``calibration`` or ``activations``).
        executor: ``"auto"``, ``"materializing"`` or ``"sharded"``.
        method: ``"hard"`` (drop the lowest units) or ``"group_lasso"`` (block soft-threshold).
        reg_lambda: Group-lasso strength ``lambda``.
        gamma: Group-lasso step size ``gamma``: the units are scaled by ``max(0, 1 - lambda * gamma * sqrt(G) /
            ||u||)`` (the callback uses the sum of learning rates since warmup in latent mode, since the previous
            selection in direct mode).
        group_count_ref: Opt-in score correction for shared budgets.
        activations: Statistics from :func:`lightning_pat.scoring.activation.calibrate` for ``score="activation"``.
        layer_stats: Layer scores from :func:`lightning_pat.scoring.layers.calibrate_layers`: layer units are ranked by
            ``1 - cos(input, output)`` instead of the RMS of their output projections.
        calibration: Batches of inputs (a list: each is passed as ``model(batch)``, e.g. token ids ``[B, T]``) for
            the activation score: :func:`lightning_pat.scoring.activation.calibrate` (and, with layer units,
            :func:`~lightning_pat.scoring.layers.calibrate_layers`) run on them before anything is pruned.

    Returns:
        The dropped units per cluster and literal-zero counts per parameter.

    Raises:
        ValueError: On an invalid declaration, preset name or option, a target below 1 that would remove every unit
            of a cluster, ``score="activation"`` without ``activations`` or ``calibration`` (or with statistics of
            other clusters), both ``activations`` and ``calibration``, none of ``sparsity``, ``target_params`` and
            ``target_flops``, both size targets (or ``target_flops`` without
            ``seq_len``), ranked widths the solver cannot count exactly, or a size target above the model or below
            what the clusters can reach (or, with ``target_layers``, above what that depth can hold); nothing is
            mutated then.

    Example::

        >>> import torch.nn as nn
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> res = prune_clusters(mlp, Cluster(name="h", writers=["0.weight", "0.bias"], readers=["2.weight"]), 0.5)
        >>> len(res.dropped["h"]), int((mlp[0].weight == 0).all(dim=1).sum())
        (4, 4)
    """
    if sparsity is not None and (target_params is not None or target_flops is not None):  # as the callback does
        which = "target_params" if target_flops is None else "target_flops"
        ranks.rank_zero_warn(
            f"prune_clusters: `sparsity={sparsity}` is unused: `{which}` sets the widths "
            f"({which}={target_params if target_flops is None else target_flops!r}); pass one of them."
        )
        sparsity = None
    if sum(x is not None for x in (sparsity, target_params, target_flops)) != 1:
        raise ValueError(
            "prune_clusters needs `sparsity` (a fraction of each cluster's units), `target_params` (a size such as "
            "'350M' or 0.5 of the model) or `target_flops` (FLOPs per token), exactly one of them; got "
            f"sparsity={sparsity!r}, target_params={target_params!r}, target_flops={target_flops!r}."
        )
    check_flops(target_flops, seq_len)
    check_target(
        target_params if target_flops is None else target_flops, target_side, target_layers, target_widths, min_kept,
        name="target_params" if target_flops is None else "target_flops",
    )  # fmt: skip
    if sparsity is not None:
        check_number("sparsity", sparsity, low=0.0, high=1.0)
    check_choice("score", score, ("auto", *SCORE_TYPES))
    check_choice("target_allocation", target_allocation, ALLOCATIONS)
    check_choice("method", method, METHODS)
    check_number("reg_lambda", reg_lambda, low=0.0)
    check_number("gamma", gamma, low=0.0)
    if score == "taylor":
        raise ValueError(
            "score='taylor' sums |w * g| over training steps, so it exists only during training: use it with "
            "CoupledPruningCallback (or lightning_pat.scoring.taylor.TaylorScores with a Pruner in your own loop); for "
            "prune_clusters use a weight score ('rms') or score='activation' with calibrate()."
        )
    resolved_score = _one_shot_score(score, activations, calibration)
    if (resolved_score == "activation") != (activations is not None or calibration is not None):
        raise ValueError(
            "score='activation' and `activations` go together: pass "
            "`activations=lightning_pat.scoring.activation.calibrate(model, clusters, batches)` with "
            f"score='activation', or neither; got score={score!r} and activations={type(activations).__name__}."
        )
    clusters = auto_declarations(model, found_clusters(clusters))  # a Discovery; "auto" as the callback means it
    if isinstance(clusters, str) or (
        isinstance(clusters, Sequence)
        and not isinstance(clusters, Mapping)
        and any(isinstance(c, str) for c in clusters)
    ):  # preset names (e.g. "linear_chain", "auto"), as the callback accepts them
        clusters = presets.resolve_preset(clusters, model)
    score, activations, layer_stats = one_shot_calibration(
        model, clusters, resolved_score, activations, calibration, layer_stats=layer_stats
    )
    plan = make_plan(
        model, clusters, score=score, executor=executor, group_count_ref=group_count_ref,
        sparsity=None if sparsity is None else float(sparsity),
    )  # fmt: skip
    size = None
    if target_params is not None or target_flops is not None:
        decls = [clusters] if isinstance(clusters, (Cluster, Mapping)) else list(clusters)
        importance = None
        if target_allocation == "importance":
            importance = plan_importance(model, plan, decls, activations=activations)
        plan, size = plan.sized(
            _named(model), target_params if target_flops is None else target_flops, side=target_side,
            declarations=decls, keep_layers=target_layers, widths=target_widths, min_kept=min_kept,
            flops=None if target_flops is None else (model, int(seq_len or 0)), importance=importance,
        )  # fmt: skip
    pruner = Pruner(model, plan)
    # plain tensors: this process's own statistics, no collective; DTensors: the statistics travel in the sharded
    # path's one reduction (and are summed over the ranks of the mesh)
    sharded = any(dtensor.is_dtensor(t) for t in _named(model).values())
    with torch.no_grad():
        scores = None if activations is None or sharded else activations.unit_scores(_named(model))
        if layer_stats is not None:
            scores = {**(scores or {}), **(layer_stats.scores() or {})}
        result = pruner.step(
            plan.targets(float(sparsity or 0.0)), method=method, threshold=reg_lambda * gamma, count=True,
            scores=scores, evidence=activations if sharded else None,
        )  # fmt: skip
    return result if size is None else dataclasses.replace(result, size=size)
