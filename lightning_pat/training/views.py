"""The read-only views of a pruning run: the callback's public attributes, read from its controller (no Lightning).

:class:`PruningViews` is a mixin for an object that holds ``options``, a ``controller`` and the logged ``metrics``
(the callback); each view reads them, or the controller's bound run (``controller.run``, a
:class:`~lightning_pat.training.bound.BoundRun`: ``None`` before fit start), and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from lightning_pat.core.schedule import Schedule
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.sizing.problem import SizeSolution
from lightning_pat.training.controller import PruningController
from lightning_pat.training.metrics import PruningMetrics


class PruningViews:
    """What a pruning run shows: its schedule, step, mask, resolved clusters, size, teacher and last metrics."""

    options: PruningOptions
    controller: PruningController
    metrics: PruningMetrics | None

    @property
    def schedule(self) -> Schedule:
        """The step schedule."""
        return self.options.schedule

    @property
    def target_sparsity(self) -> float:
        """Fraction of each cluster's units removed at the end of the ramp (clusters may override)."""
        sparsity = self.options.target_sparsity
        assert sparsity is not None  # PruningOptions sets it
        return sparsity

    @property
    def size(self) -> SizeSolution | None:
        """With ``target_params`` or ``target_flops``, after fit start: the solved widths and the achieved count.

        By importance (``target_allocation``), the solution of the first selection from then on; before it, the
        fit-start solution by fractions that checked the size (its ``rule`` says which).
        """
        run = self.controller.run
        return None if run is None else run.size

    @property
    def score(self) -> str:
        """The unit score in use (after fit start): ``options.score``, or what ``score="auto"`` resolved to."""
        run = self.controller.run
        return self.options.score if run is None or run.score is None else run.score.score

    @property
    def step(self) -> int:
        """Completed real optimizer steps seen by the schedule."""
        return self.controller.progress.step

    @property
    def dropped(self) -> dict[str, list[int]]:
        """Cluster name -> sorted dropped unit indices of the current mask."""
        return self.controller.dropped

    @property
    def resolved(self) -> list[ResolvedCluster]:
        """The resolved clusters (after fit start)."""
        return self.controller.resolved

    @property
    def pruner(self) -> Pruner | None:
        """The engine (after fit start; ``None`` once the model was shrunk)."""
        run = self.controller.run
        return None if run is None else run.pruner

    @property
    def teacher(self) -> nn.Module | None:
        """The distillation teacher (``None`` without distillation, or before pruning starts with a copied one)."""
        return self.controller.teacher

    def sparsity(self) -> dict[str, float]:
        """The latest logged values (unit, parameter and per-cluster sparsity)."""
        return {} if self.metrics is None else self.metrics.values()

    def latent_params(self) -> Mapping[str, Tensor]:
        """The latent copies held right now (empty in direct mode, during warmup and during healing)."""
        latents = None if self.controller.run is None else self.controller.run.latents
        return {} if latents is None else latents.state_dict()
