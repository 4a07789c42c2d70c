"""The score of a training run: :func:`resolve_score` settles ``score="auto"``; :func:`scored` builds what it needs.

:func:`resolve_score` is the one place where ``score="auto"`` is settled, once, at fit start (``resume.start``, where
a restored state is known under every strategy): ``"activation"`` wherever its statistics can score the clusters,
``"rms"`` under FSDP1 and for clusters without an ``nn.Linear`` reader, and on a resume the score the checkpoint was
written with (when it runs here). Its :class:`ScoreChoice` carries the activation statistics it built; :func:`scored`
builds the pruner with that score and the run's data-aware scorers
(:class:`~lightning_pat.training.collectors.Collectors`). :func:`check_scores` is bind's dry run of both, so that what
no checkpoint can change is still refused before any step. No Lightning here; errors are
:class:`~lightning_pat.training.errors.ConfigurationError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_pat.core.norms import ScoreType
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel.executors.routing import build_executors
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.plan import Plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.experts import ExpertStats
from lightning_pat.scoring.layers import LayerStats, layer_clusters
from lightning_pat.scoring.taylor import TaylorScores
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.errors import WHO, prefixed


@dataclass(frozen=True)
class ScoreChoice:
    """The score a run uses, why (for the log of ``score="auto"``), and the activation statistics it built.

    Attributes:
        score: ``options.score``, or what ``"auto"`` settled on.
        reason: Why ``"auto"`` settled on it (empty for an explicit score).
        act: ``score="activation"``: the readers' input statistics (``None`` with only layer units).
    """

    score: ScoreType
    reason: str = ""
    act: ActivationStats | None = None


def resolve_score(
    options: PruningOptions,
    *,
    module: nn.Module,
    clusters: Sequence[ResolvedCluster],
    fsdp1: bool,
    saved: str | None = None,
) -> ScoreChoice:
    """The score of a run (the one place ``score="auto"`` is settled; see the module docstring).

    Args:
        options: The run's options.
        module: The model (the activation statistics hook its reader modules).
        clusters: The resolved clusters.
        fsdp1: Whether the model runs under FSDP1 (no activation statistics there).
        saved: On a resume, the score the checkpoint was written with: ``"auto"`` continues it where it runs.

    Returns:
        The choice, with the activation statistics built when the score is ``"activation"``.

    Raises:
        ConfigurationError: If an explicit ``score="activation"`` cannot score the clusters (no ``nn.Linear`` reader).
    """
    score: ScoreType
    reason = ""
    if options.score != "auto":
        score = options.score
    else:
        if saved == "rms" or (saved == "activation" and not fsdp1):
            score, reason = ("rms" if saved == "rms" else "activation"), "the checkpoint's score"
        elif fsdp1:
            score, reason = "rms", "the activation score does not run under FSDPStrategy (FSDP1)"
        else:
            score = "activation"
            reason = "the readers' input statistics, collected in training forwards; pass score='rms' for the weights"
    act = None
    if score == "activation" and len(layer_clusters(clusters)) < len(clusters):  # layer units are scored apart
        try:
            with prefixed(f"{WHO}(score='activation')"):
                act = ActivationStats(module, clusters)
        except ValueError as err:
            if options.score != "auto":
                raise
            score, reason = "rms", f"the activation score cannot score these clusters: {err}"
    return ScoreChoice(score, reason, act)


def scored(
    plan: Plan,
    params: Mapping[str, Tensor],
    choice: ScoreChoice,
    *,
    module: nn.Module,
    layer_score: str,
    expert_score: str = "weight",
) -> tuple[Pruner, Collectors]:
    """The pruner of ``plan`` with the chosen score, and the collectors that score, the layers and experts need.

    Args:
        plan: The bound plan (its score is replaced by ``choice``'s).
        params: The parameters the engine works on.
        choice: The run's score (:func:`resolve_score`), with its activation statistics.
        module: The model (the layer cosines hook the layers' modules).
        layer_score: ``options.layer_score``: ``"cosine"`` collects the layer units' cosines.
        expert_score: ``options.expert_score``: a data score collects the whole routed experts' statistics (where
            the clusters hold some); ``"weight"`` collects nothing.

    Raises:
        ConfigurationError: If the layer units share no module (``layer_score="cosine"``), or ``score="taylor"``
            finds a cluster whose members are all frozen.
    """
    pruner = Pruner(params, dataclasses.replace(plan, score=choice.score))
    layers = _layer_stats(module, plan.clusters, layer_score)
    taylor = None
    if choice.score == "taylor":
        with prefixed(f"{WHO}(score='taylor')"):
            taylor = TaylorScores(pruner.executors)
    return pruner, Collectors(choice.act, taylor, layers, _expert_stats(module, plan.clusters, expert_score))


def check_scores(
    options: PruningOptions, *, module: nn.Module, plan: Plan, params: Mapping[str, Tensor], fsdp1: bool
) -> None:
    """Refuse at bind (every rank, before any step) what :func:`scored` would refuse whatever a checkpoint says.

    A dry run for the options no checkpoint changes: an explicit ``score="activation"`` without ``nn.Linear``
    readers, layer units without a common module (``layer_score="cosine"``), an explicit ``score="taylor"`` on
    clusters whose members are all frozen. What it builds to check is dropped (nothing is hooked); the score itself
    is settled at fit start, once a restored state is known.

    Raises:
        ConfigurationError: As :func:`resolve_score` and :func:`scored` would.
    """
    if options.score == "activation":
        resolve_score(options, module=module, clusters=plan.clusters, fsdp1=fsdp1)
    _layer_stats(module, plan.clusters, options.layer_score)
    if options.score == "taylor":
        with prefixed(f"{WHO}(score='taylor')"):
            TaylorScores(build_executors(plan.clusters, params, plan.routes))


def _layer_stats(module: nn.Module, clusters: Sequence[ResolvedCluster], layer_score: str) -> LayerStats | None:
    """The layer units' cosine collector (``layer_score="cosine"`` with layer units), else ``None``."""
    units = layer_clusters(clusters)
    if not units or layer_score != "cosine":
        return None
    with prefixed(f"{WHO}(layer_score='cosine')"):
        return LayerStats(module, units)


def _expert_stats(module: nn.Module, clusters: Sequence[ResolvedCluster], expert_score: str) -> ExpertStats | None:
    """The whole routed experts' collector (a data ``expert_score`` and clusters of fused experts), else ``None``."""
    if expert_score == "weight":
        return None
    with prefixed(f"{WHO}(expert_score={expert_score!r})"):
        stats = ExpertStats(module, clusters, kind=expert_score)  # type: ignore[arg-type]  # checked by the options
    return stats if stats.modules else None
