"""The score of a training run: :func:`resolve_score` settles ``score="auto"``; :func:`scored` builds what it needs.

:func:`resolve_score` is the one place where ``score="auto"`` is settled: ``"activation"`` wherever its statistics
can score the clusters, ``"rms"`` under FSDP1 and for clusters without an ``nn.Linear`` reader, and on a resume the
score the checkpoint was written with (when it runs here). Its :class:`ScoreChoice` carries the activation
statistics it built; :func:`scored` builds the pruner with that score and the run's data-aware scorers
(:class:`~lightning_pat.training.collectors.Collectors`). No Lightning here; errors are
:class:`~lightning_pat.training.errors.ConfigurationError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.plan import Plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats
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

    score: str
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
    score: str = options.score
    reason = ""
    if score == "auto":
        if saved in ("rms", "activation") and not (saved == "activation" and fsdp1):
            score, reason = saved, "the checkpoint's score"
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
    plan: Plan, params: Mapping[str, Tensor], choice: ScoreChoice, *, layers: LayerStats | None
) -> tuple[Pruner, Collectors]:
    """The pruner of ``plan`` with the chosen score, and the collectors that score needs (``layers`` kept).

    Raises:
        ConfigurationError: If ``score="taylor"`` finds a cluster whose members are all frozen.
    """
    if plan.score != choice.score:
        plan = dataclasses.replace(plan, score=choice.score)  # type: ignore[arg-type]
    pruner = Pruner(params, plan)
    collectors = Collectors()
    collectors.act, collectors.layers = choice.act, layers
    if choice.score == "taylor":
        with prefixed(f"{WHO}(score='taylor')"):
            collectors.taylor = TaylorScores(pruner.executors)
    return pruner, collectors
