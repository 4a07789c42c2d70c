"""Sparsity metrics as torchmetrics states (the only module that imports torchmetrics).

The callback feeds counts that are already global and identical on every rank (the engine reduced them exactly, in
one int64 collective where the model is sharded), so ``compute`` needs no synchronisation. The states stay
additive (``dist_reduce_fx="sum"``) so that metrics can be merged like any torchmetrics metric.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


class Sparsity(Metric):
    """Fraction of zero items: ``zeros / total``, from additive integer states.

    Example::

        >>> m = Sparsity()
        >>> m.update(3, 8)
        >>> float(m.compute())
        0.375
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    zeros: Tensor
    total: Tensor

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("sync_on_compute", False)
        super().__init__(**kwargs)
        self.add_state("zeros", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, zeros: int | Tensor, total: int | Tensor) -> None:
        """Add ``zeros`` zero items out of ``total``."""
        self.zeros += torch.as_tensor(zeros, dtype=torch.long, device=self.zeros.device)
        self.total += torch.as_tensor(total, dtype=torch.long, device=self.total.device)

    def compute(self) -> Tensor:
        """The sparsity ratio (0 when nothing was counted)."""
        if int(self.total) == 0:
            return torch.tensor(0.0)
        return self.zeros.double() / self.total.double()


class PruningMetrics:
    """The metric set of the callback: global unit sparsity, parameter sparsity, per-cluster unit sparsity.

    Each update is a snapshot: the metrics are reset and refilled, because sparsity is a state, not an average.

    Args:
        cluster_names: Names of the resolved clusters.
        prefix: Key prefix, ``"pruning"`` by default.
    """

    def __init__(self, cluster_names: list[str], *, prefix: str = "pruning") -> None:
        self.prefix = prefix
        self.unit = Sparsity()
        self.param = Sparsity()
        self.clusters = {name: Sparsity() for name in cluster_names}
        self._param_value: float | None = None

    def update_units(self, dropped: dict[str, int], num_units: dict[str, int]) -> None:
        """Snapshot unit sparsity from dropped counts per cluster."""
        self.unit.reset()
        for name, metric in self.clusters.items():
            metric.reset()
            metric.update(dropped.get(name, 0), num_units[name])
            self.unit.update(dropped.get(name, 0), num_units[name])

    def update_params(self, zeros: dict[str, int], numel: dict[str, int]) -> None:
        """Snapshot parameter sparsity from literal-zero counts per parameter (each parameter once)."""
        self.param.reset()
        self.param.update(sum(zeros.values()), sum(numel.values()))
        self._param_value = float(self.param.compute())

    def values(self) -> dict[str, float]:
        """Current values by log key (parameter sparsity only once it has been counted)."""
        out = {f"{self.prefix}/unit_sparsity": float(self.unit.compute())}
        if self._param_value is not None:
            out[f"{self.prefix}/param_sparsity"] = self._param_value
        for name, metric in self.clusters.items():
            out[f"{self.prefix}/{name}/unit_sparsity"] = float(metric.compute())
        return out
