"""One pruning step without a Trainer: :func:`prune_clusters` and its one-shot helpers (no Lightning here).

:func:`prune_clusters` checks its options once (:class:`~lightning_pat.pruning.options.StepOptions`), turns
``clusters`` into declarations (:func:`~lightning_pat.pruning.declarations.one_shot_declarations`), resolves the
score (:func:`one_shot_calibration`: ``"auto"``, calibration), builds the plan (sized by :func:`plan_importance` for
a size target) and runs one :meth:`~lightning_pat.pruning.pruner.Pruner.step`. It shares the checkers, the plan and
the pruner with the callback's controller, not the controller itself (see ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lightning_pat.core.choices import Allocation, ExecutorKind, ExpertScoreChoice, Method, Side, Widths
from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.norms import WEIGHT_SCORES, ScoreType, normalise
from lightning_pat.core.spec import Cluster, resolve_clusters
from lightning_pat.parallel.comm import dtensor
from lightning_pat.pruning.declarations import one_shot_declarations
from lightning_pat.pruning.options import StepOptions, check_preset_options
from lightning_pat.pruning.plan import Plan, make_plan, named_tensors
from lightning_pat.pruning.pruner import Pruner, PruneResult
from lightning_pat.sizing.targets import declaration_labels, unit_costs

if TYPE_CHECKING:
    from lightning_pat.scoring.activation import ActivationStats
    from lightning_pat.scoring.layers import LayerStats

log = logging.getLogger(__name__)


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
    expert_score: str = "reap_sum",
) -> tuple[ScoreType, ActivationStats | None, LayerStats | None]:
    """The one-shot score (``"auto"`` resolved) and the statistics, calibrated on ``calibration`` if given.

    With ``calibration``: activation statistics for the width clusters and, when the clusters hold layer units and
    no ``layer_stats`` are given, the layer cosines. With ``score="auto"``, clusters the activation score cannot
    measure (a reader that is not an ``nn.Linear``, e.g. GPT-2's ``Conv1D``) fall back to ``"rms"`` with a warning,
    as the callback does.

    Raises:
        ValueError: As for :func:`prune_clusters` (``calibration`` with ``activations`` or a weight score, or not a
            list of batches; an invalid declaration).
    """
    auto = score == "auto"
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
    try:
        stats = calibrate(model, resolved, calibration)
    except ValueError as err:
        if not auto:
            raise
        partial = _reached_only(model, resolved, calibration)
        if partial is not None:
            return "rms", partial, layer_stats
        from lightning_pat.scoring.experts import expert_modules

        by = "their weights" if expert_score == "weight" else "the calibration batches"
        if len(expert_modules(model, resolved)) == len(resolved):  # whole routed experts only: expert_score ranks them
            log.info("prune_clusters: the whole routed experts are ranked by expert_score=%r on %s.", expert_score,
                     by)  # fmt: skip
        else:
            log.warning("prune_clusters: score='auto' falls back to the weights ('rms') for the clusters that are not "
                        "whole routed experts (those are ranked by expert_score=%r on %s): the activation score "
                        "cannot score these clusters: %s", expert_score, by, err)  # fmt: skip
        return "rms", None, layer_stats
    if layer_stats is None and any(is_layer_cluster(rc) for rc in resolved):
        layer_stats = calibrate_layers(model, resolved, calibration)
    return score, stats, layer_stats


def _reached_only(model: nn.Module, resolved: Sequence[Any], calibration: Sequence[Any]) -> ActivationStats | None:
    """Statistics of the clusters the calibration reaches, where it misses only some of them; else ``None``.

    A multimodal LM calibrated on text never runs its vision or audio encoder: the clusters it reaches keep the
    activation score, the others are ranked by their weights (``"rms"``: the plan's score, which the pruner takes
    for the clusters the statistics do not score).
    """
    from lightning_pat.scoring.activation import calibrate, reached_clusters

    try:
        reached = reached_clusters(model, resolved, calibration)
    except ValueError:
        return None
    if not reached or len(reached) == len(resolved):
        return None
    names = {rc.name for rc in reached}
    missed = [rc.name for rc in resolved if rc.name not in names]
    log.warning("prune_clusters: no calibration batch reaches %d of the %d clusters (%s): they are ranked by their "
                "weights ('rms'), the others by the activation score", len(missed), len(resolved),
                ", ".join(missed[:4]) + (", ..." if len(missed) > 4 else ""))  # fmt: skip
    try:
        return calibrate(model, reached, calibration)
    except ValueError:
        return None


def plan_importance(
    model: nn.Module,
    plan: Plan,
    declarations: Sequence[Cluster | Mapping[str, Any]],
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
    sharded = any(dtensor.is_dtensor(t) for t in named_tensors(model).values())
    if activations is not None and not sharded:
        q, scores = pruner.reduced(activations.unit_scores(named_tensors(model)))
    else:
        q, scores = pruner.reduced(None, activations)
    declared = declaration_labels(named_tensors(model), declarations)
    return importance_costs(plan, q, scores if activations is not None else None, declared=declared,
                            comparable=activations is not None)  # fmt: skip


def importance_costs(
    plan: Plan,
    q: Mapping[str, torch.Tensor],
    scores: Mapping[str, torch.Tensor] | None,
    *,
    declared: Mapping[str, str],
    comparable: bool,
) -> dict[str, list[float]]:
    """Each unit's removal cost for the size solver, from reduced unit norms and scores (identical on every rank).

    The one rule of :func:`plan_importance` (one-shot) and of the callback's ``target_allocation="importance"``
    (solved at the first selection from the run's statistics).

    Args:
        plan: The plan whose clusters are costed.
        q: Cluster name -> squared unit norms (:meth:`~lightning_pat.pruning.pruner.Pruner.reduced`).
        scores: Cluster name -> data-aware unit scores; a cluster without one is costed by the plan's weight score
            (``"rms"`` when the plan's score is data-aware).
        declared: Cluster name -> declaration label (a family; see
            :func:`~lightning_pat.sizing.targets.declaration_labels`).
        comparable: Whether the scores are activation scores (see :func:`~lightning_pat.sizing.targets.unit_costs`).

    Returns:
        Cluster name -> unit costs (layer clusters left out: the solver derives theirs).
    """
    weight = plan.score if plan.score in WEIGHT_SCORES else "rms"
    given = scores or {}
    full = {
        rc.name: given[rc.name] if rc.name in given else normalise(q[rc.name], unit_numel=rc.unit_numel, score=weight)
        for rc in plan.clusters
    }
    return unit_costs(full, plan.clusters, declared=declared, comparable=comparable)


def prune_clusters(
    model: nn.Module,
    clusters: str | Cluster | Mapping[str, Any] | Sequence[str | Cluster | Mapping[str, Any]],
    sparsity: float | None = None,
    *,
    target_params: int | float | str | None = None,
    target_side: Side = "below",
    target_layers: int | None = None,
    target_widths: Widths = "uniform",
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
    expert_score: ExpertScoreChoice = "reap_sum",
    preset_options: Mapping[str, bool] | None = None,
) -> PruneResult:
    """Run one coupled projection on ``model`` outside any Trainer (plain tensors or DTensors).

    Clusters with their own ``target`` use it; the others use ``sparsity``.

    Args:
        model: The module to prune in place.
        clusters: Cluster declarations (see :class:`~lightning_pat.Cluster`), a :func:`~lightning_pat.discover`
            result, a preset name (``"llama"``, ``"linear_chain"``, ...) or a list mixing both, as for the callback.
            ``"auto"`` means what it means for the callback: the preset that covers the model, else discovery by
            tracing the model's ``example_input_array``, the first ``calibration`` batch, or (a Hugging Face model)
            a few token ids (without any, an error points at ``discover(model, x)``).
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
            :func:`~lightning_pat.scoring.layers.calibrate_layers`) run on them before anything is pruned; whole
            routed experts are ranked on them by ``expert_score``
            (:func:`~lightning_pat.scoring.experts.expert_scores`).
        expert_score: With ``calibration``, how whole routed experts are ranked on it (as the callback's
            ``expert_score``): ``"reap_sum"`` (default: the router weight times the expert's output norm, summed over
            the tokens routed to it), ``"reap"`` (REAP: its mean over them), ``"frequency"`` (their number) or
            ``"weight"`` (the weight score, as without ``calibration``). The default had the best mean held-out loss
            of the three data scores in BENCHMARKS.md's "Expert scores", with and without the router's balancing
            loss.
        preset_options: Options of the presets that ``clusters`` names (``"auto"`` included), as the callback's
            ``preset_options``: e.g. ``{"query_heads": True}`` cuts GQA query heads inside their KV groups (a
            model no preset covers is discovered by tracing, which reads ``query_heads`` only).

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
    opts = StepOptions(
        sparsity=sparsity, target_params=target_params, target_side=target_side, target_layers=target_layers,
        target_widths=target_widths, min_kept=min_kept, target_flops=target_flops, seq_len=seq_len,
        target_allocation=target_allocation, score=score, method=method, reg_lambda=reg_lambda, gamma=gamma,
        group_count_ref=group_count_ref, expert_score=expert_score,
    )  # fmt: skip
    resolved_score = _one_shot_score(opts.score, activations, calibration)
    if (resolved_score == "activation") != (activations is not None or calibration is not None):
        raise ValueError(
            "score='activation' and `activations` go together: pass "
            "`activations=lightning_pat.scoring.activation.calibrate(model, clusters, batches)` with "
            f"score='activation', or neither; got score={score!r} and activations={type(activations).__name__}."
        )
    check_preset_options(preset_options)
    declared = one_shot_declarations(model, clusters, calibration, preset_options)
    plan_score, activations, layer_stats = one_shot_calibration(
        model, declared, "auto" if opts.score == "auto" and calibration is not None else resolved_score, activations,
        calibration,
        layer_stats=layer_stats, expert_score=opts.expert_score,
    )  # fmt: skip
    plan = make_plan(
        model, declared, score=plan_score, executor=executor, group_count_ref=opts.group_count_ref,
        sparsity=opts.sparsity,
    )  # fmt: skip
    size = None
    if opts.sizing.value is not None:
        decls = [declared] if isinstance(declared, (Cluster, Mapping)) else list(declared)
        importance = None
        if opts.sizing.target_allocation == "importance":
            importance = plan_importance(model, plan, decls, activations=activations)
        plan, size = plan.for_size(
            named_tensors(model), opts.sizing, declarations=decls, model=model, importance=importance
        )
    pruner = Pruner(model, plan)
    # plain tensors: this process's own statistics, no collective; DTensors: the statistics travel in the sharded
    # path's one reduction (and are summed over the ranks of the mesh)
    sharded = any(dtensor.is_dtensor(t) for t in named_tensors(model).values())
    with torch.no_grad():
        scores = None if activations is None or sharded else activations.unit_scores(named_tensors(model))
        if layer_stats is not None:
            scores = {**(scores or {}), **(layer_stats.scores() or {})}
        if calibration is not None and not sharded and opts.expert_score != "weight":  # whole routed experts
            from lightning_pat.scoring.experts import expert_scores

            found = expert_scores(model, plan.clusters, calibration, kind=opts.expert_score)
            scores = {**(scores or {}), **found} if found else scores
        result = pruner.step(
            plan.targets(opts.sparsity or 0.0), method=opts.method, threshold=opts.reg_lambda * opts.gamma,
            count=True, scores=scores, evidence=activations if sharded else None,
        )  # fmt: skip
    return result if size is None else dataclasses.replace(result, size=size)
