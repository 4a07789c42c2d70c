"""Sparsity metrics as torchmetrics states (the only module that imports torchmetrics).

The callback feeds counts that are already global and identical on every rank (the engine reduced them exactly, in
one int64 collective where the model is sharded), so ``compute`` needs no synchronisation. The states stay
additive (``dist_reduce_fx="sum"``) so that metrics can be merged like any torchmetrics metric.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """The logged metric set: global unit sparsity, parameter sparsity and per-cluster unit sparsity.

    Sparsity is a per-step state, not an average over steps: every update goes through the metric's ``forward``,
    whose value (``_forward_cache``) is that step's ratio, and Lightning logs it with ``on_step=True,
    on_epoch=False`` and resets the metrics at the epoch end. The counts fed here are already global and identical
    on every rank (the engine reduced them exactly), so no rank syncs (``dist_sync_on_step=False``,
    ``sync_on_compute=False``): a sum over ranks would only multiply both states by the world size. The metrics
    are kept in a plain dict rather than a ``MetricCollection`` because cluster names may contain dots, which a
    module dict refuses as keys.

    Args:
        cluster_names: Names of the resolved clusters.
        prefix: Key prefix, ``"pruning"`` by default.

    Example::

        >>> m = PruningMetrics(["a", "b"])
        >>> m.update({"a": [0, 1], "b": []}, {"a": 4, "b": 4}, zeros={"w": 3}, numel={"w": 12})
        >>> sorted(m.values().items())  # doctest: +NORMALIZE_WHITESPACE
        [('pruning/a/unit_sparsity', 0.5), ('pruning/b/unit_sparsity', 0.0), ('pruning/param_sparsity', 0.25),
         ('pruning/unit_sparsity', 0.25)]
    """

    def __init__(self, cluster_names: list[str], *, prefix: str = "pruning") -> None:
        self.prefix = prefix
        self.main = f"{prefix}/unit_sparsity"
        self.metrics: dict[str, Sparsity] = {self.main: Sparsity(), f"{prefix}/param_sparsity": Sparsity()}
        self._clusters = {name: f"{prefix}/{name}/unit_sparsity" for name in cluster_names}
        self.metrics.update({key: Sparsity() for key in self._clusters.values()})
        self._last: dict[str, Tensor] = {}  # the last step's values (Lightning resets the metrics at epoch end)

    def update(
        self,
        dropped: dict[str, list[int]],
        num_units: dict[str, int],
        *,
        zeros: dict[str, int],
        numel: dict[str, int],
    ) -> None:
        """One step's snapshot: dropped units per cluster, literal zeros and numel per parameter (each once)."""
        self.metrics[self.main](sum(len(v) for v in dropped.values()), sum(num_units.values()))
        self.metrics[f"{self.prefix}/param_sparsity"](sum(zeros.values()), sum(numel.values()))
        for name, key in self._clusters.items():
            self.metrics[key](len(dropped.get(name, ())), num_units[name])
        self._last = {}
        for key, metric in self.metrics.items():
            if metric._forward_cache is not None:
                self._last[key] = metric._forward_cache

    def log(self, log: Callable[..., Any]) -> None:
        """Log each metric object through ``log`` (``LightningModule.log``) per step; the main one in the bar."""
        for key, metric in self.metrics.items():
            attribute = "_lightning_pat_" + key.replace("/", "_").replace(".", "_")
            log(key, metric, on_step=True, on_epoch=False, prog_bar=key == self.main, metric_attribute=attribute)

    def values(self) -> dict[str, float]:
        """The last step's values by log key (empty before the first update)."""
        return {k: float(v) for k, v in self._last.items()}
