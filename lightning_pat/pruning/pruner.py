"""One pruning step over a plan's clusters, outside or inside a Trainer (no Lightning here).

:class:`Pruner` builds the executors of a :class:`~lightning_pat.pruning.plan.Plan` once, then on each step gathers
unit norms, turns them into scores, selects units (per cluster or per shared budget), and applies the selection. It
remembers the last selection so that it can be held (re-applied) between fresh selections and frozen during
healing. :class:`PruneResult` is what a step did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_pat.core.checks import check_choice
from lightning_pat.core.choices import METHODS, Method
from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.norms import SCORE_TYPES, WEIGHT_SCORES, ScoreType, group_count_correction, normalise
from lightning_pat.core.routing import route_around_dropped
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
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel.executors import Evidence, Executor, ExecutorKind, Reduced, UnitAction, build_executors
from lightning_pat.pruning.options import check_group_count_ref
from lightning_pat.pruning.plan import Plan, make_plan, named_tensors
from lightning_pat.sizing.problem import SizeSolution


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


class Pruner:
    """Coupled pruning over a fixed set of resolved clusters.

    Args:
        params: The model, or a mapping of parameter names to tensors, holding every member.
        clusters: Resolved clusters (see :func:`~lightning_pat.resolve_clusters`), or a
            :class:`~lightning_pat.pruning.plan.Plan` from :func:`~lightning_pat.pruning.plan.make_plan` (routed,
            its options checked where they entered; the options below are then taken from it).
        score: Score normalisation: ``"rms"``, ``"l2"`` or ``"param_cost"``; or ``"activation"``, whose unit scores
            are passed to :meth:`select` / :meth:`step` as ``scores`` (see :mod:`lightning_pat.scoring.activation`).
        executor: ``"auto"``, ``"materializing"`` or ``"sharded"`` (:func:`~lightning_pat.parallel.executors.route`).
        group_count_ref: If set, scores of clusters in a shared budget are multiplied by ``sqrt(C / ref)``.

    Raises:
        ValueError: If an option is unknown or out of range (checked here for resolved clusters, once), or an
            executor cannot serve a cluster.
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
        if isinstance(clusters, Plan):
            plan = clusters  # its options were checked where they entered (PruningOptions, StepOptions)
        else:
            check_choice("score", score, SCORE_TYPES)
            check_group_count_ref(group_count_ref)
            plan = make_plan(params, clusters, score=score, executor=executor, group_count_ref=group_count_ref)
        self.plan = plan
        self.score = plan.score
        self.group_count_ref = plan.group_count_ref
        self.clusters = list(plan.clusters)
        self.routes = dict(plan.routes)
        self.executors: list[Executor] = build_executors(
            self.clusters, named_tensors(params), self.routes, data_aware=self.score == "activation"
        )
        self.last: dict[str, UnitAction] = {}
        if isinstance(params, nn.Module):  # dropped experts are routed around in the masked model
            route_around_dropped(params, self.clusters)

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
                else normalise(q[rc.name], unit_numel=rc.unit_numel, score=fallback)
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
            ValueError: If ``scores`` lacks a cluster or has a wrong shape, the score type needs ``scores``, or
                ``method`` is unknown.
        """
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

    def reduced(
        self, scores: Mapping[str, Tensor] | None = None, evidence: Evidence | None = None
    ) -> tuple[dict[str, Tensor], Mapping[str, Tensor] | None]:
        """Every unit's squared norm ``Q`` and the unit scores, reduced as for a selection (no weight changes).

        Every rank gets the same values (under DTensors the partials are summed in the selection's collectives).

        Args:
            scores: Unit scores already computed (returned as they are, the evidence's added).
            evidence: Statistics whose per-rank partials are reduced with ``Q`` (e.g. the activation statistics).

        Returns:
            ``(Q, scores)``: cluster name -> squared unit norms, and the scores (``None`` when neither was given).
        """
        with torch.no_grad(), self._session():
            return self._reduce(scores, evidence)

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
        if method == "hard":
            return {rc.name: UnitAction(dropped[rc.name]) for rc in self.clusters}
        if method != "group_lasso":  # no silent "hard": the options were checked once, a direct call was not
            check_choice("method", method, METHODS)
        actions = {}
        for rc in self.clusters:
            factors = shrink_factors(q[rc.name].sqrt(), threshold=threshold * rc.unit_numel**0.5)
            factors[dropped[rc.name]] = 0.0
            actions[rc.name] = UnitAction(torch.nonzero(factors == 0).flatten(), factors)
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

    def retarget(self, plan: Plan) -> None:
        """Take ``plan``'s per-cluster targets: the same clusters, routes and options up to their ``target``.

        A size solved after the pruner was built (the callback's ``target_allocation="importance"``, solved at the
        first selection) changes only the targets; the executors (which never read a target) are kept, so the
        scorers bound to them (the Taylor sums) keep their state.

        Raises:
            ValueError: If ``plan`` differs from this pruner's plan in anything but the clusters' targets.
        """
        mine = [dataclasses.replace(rc, target=None) for rc in self.clusters]
        theirs = [dataclasses.replace(rc, target=None) for rc in plan.clusters]
        if mine != theirs or plan.routes != self.routes or (plan.score, plan.group_count_ref) != (
            self.score, self.group_count_ref
        ):  # fmt: skip
            raise ValueError("Pruner.retarget: the plan differs in more than the clusters' targets.")
        self.plan = plan
        self.clusters = list(plan.clusters)

    def rebind(self, params: Mapping[str, Tensor]) -> None:
        """Point the executors at new tensor objects with the same names, shapes and layouts (routes are kept).

        Used where parameters are only temporarily materialized, e.g. inside FSDP1's ``summon_full_params``.
        """
        self.executors = build_executors(self.clusters, params, self.routes, data_aware=self.score == "activation")
