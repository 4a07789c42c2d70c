"""Size first, then train: declarations whose per-cluster ``target`` reaches a size, allocated by measured importance.

The callback's ``target_params`` is allocated by importance too (``target_allocation="auto"`` with a data-aware
score), but at the end of warmup, from the run's own statistics (see :func:`lightning_pat.training.per_step.allocate`).
:func:`size_clusters` solves the target one-shot, before training, from calibration data (the activation score's unit
costs, see :mod:`lightning_pat.sizing`) and returns ordinary declarations with their ``target`` set: pass them to
:class:`~lightning_pat.CoupledPruningCallback` (or :class:`~lightning_pat.OneShotPruningCallback`) as ``clusters``
when the widths must be fixed from the first step (or for the one-shot recipe); the training forwards then choose
*which* units go, while the sizes are those the calibration chose. Nothing is mutated.

Example::

    >>> import torch
    >>> from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
    >>> _ = torch.manual_seed(0)
    >>> net = TinyGPT(TinyGPTConfig(vocab_size=32, d_model=16, d_ff=32, n_layer=2, max_seq_len=8))
    >>> sized = size_clusters(net, "tiny_gpt", target_params=0.8, calibration=[torch.randint(0, 32, (2, 8))])
    >>> [(c.name, round(c.target, 3)) for c in sized.clusters], sized.size.achieved
    ([('mlp.{layer}', 0.344), ('heads.{layer}', 0.0)], 4144)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_pat import presets
from lightning_pat.core.checks import check_choice
from lightning_pat.core.choices import ALLOCATIONS, Allocation, Side
from lightning_pat.core.spec import Cluster, as_cluster, resolve_clusters
from lightning_pat.pruning.api import one_shot_calibration, plan_importance
from lightning_pat.pruning.options import SizeTarget, check_one_size
from lightning_pat.pruning.plan import make_plan
from lightning_pat.sizing.problem import SizeSolution

if TYPE_CHECKING:
    from lightning_pat.scoring.activation import ActivationStats


@dataclass(frozen=True)
class SizedClusters:
    """What :func:`size_clusters` solved.

    Attributes:
        clusters: The declarations, each with the ``target`` (fraction of its units dropped) that reaches the size.
        size: The solution (achieved count, neighbours, kept widths, the allocation rule).
    """

    clusters: list[Cluster]
    size: SizeSolution


def size_clusters(
    model: nn.Module,
    clusters: str | Cluster | Mapping[str, Any] | Sequence[str | Cluster | Mapping[str, Any]],
    target_params: int | float | str | None = None,
    *,
    target_flops: int | float | str | None = None,
    seq_len: int | None = None,
    target_side: Side = "below",
    target_layers: int | None = None,
    target_allocation: Allocation = "importance",
    calibration: Sequence[Any] | None = None,
    activations: ActivationStats | None = None,
) -> SizedClusters:
    """Solve a size target one-shot and return declarations with their per-cluster ``target`` (uniform widths).

    Args:
        model: The model (not changed).
        clusters: Declarations or preset names, as for :func:`~lightning_pat.prune_clusters`.
        target_params: The size: a count (``"100M"``) or a fraction of the model's parameters.
        target_flops: Instead: FLOPs per token for ``seq_len`` tokens.
        seq_len: The sequence length of ``target_flops``.
        target_side: ``"below"`` (the closest count not above the target) or ``"above"``.
        target_layers: With layer units: the layers to keep.
        target_allocation: ``"importance"`` (default; with ``calibration`` or ``activations`` the costs are the
            activation scores', else the weights' scaled per kind) or ``"fractions"``.
        calibration: Batches of inputs for the activation score (see :func:`~lightning_pat.prune_clusters`).
        activations: Calibrated statistics instead of ``calibration``.

    Returns:
        The declarations with their targets, and the solution.

    Raises:
        ValueError: As for :func:`~lightning_pat.prune_clusters` with ``target_params``; nothing is mutated.
    """
    check_one_size("size_clusters", target_params=target_params, target_flops=target_flops)
    target = SizeTarget(
        target_params=target_params, target_flops=target_flops, seq_len=seq_len, target_side=target_side,
        target_layers=target_layers, target_allocation=target_allocation,
    )  # fmt: skip
    check_choice("target_allocation", target_allocation, ALLOCATIONS)
    entries = [clusters] if isinstance(clusters, (str, Cluster, Mapping)) else list(clusters)
    decls = [c for e in entries for c in (presets.resolve_preset(e, model) if isinstance(e, str) else [as_cluster(e)])]
    score, activations, _ = one_shot_calibration(model, decls, "auto", activations, calibration)
    params = dict(model.named_parameters(remove_duplicate=False))
    plan = make_plan(model, decls, score=score)
    importance = None
    if target.target_allocation == "importance":
        importance = plan_importance(model, plan, decls, activations=activations)
    sized, size = plan.for_size(params, target, declarations=decls, model=model, importance=importance)
    targets = {rc.name: rc.target for rc in sized.clusters}
    out = []
    for decl in decls:
        found = {targets[rc.name] for rc in resolve_clusters(params, [decl])}
        if len(found) != 1:  # uniform widths give one target per declaration
            raise ValueError(f"size_clusters: declaration {decl.name!r} got several targets {sorted(found, key=str)}.")
        out.append(dataclasses.replace(decl, target=found.pop()))
    return SizedClusters(clusters=out, size=size)
