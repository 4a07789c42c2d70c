"""The executor interface and the unit action it applies.

An executor owns a fixed list of resolved clusters and the parameters they name. It answers three questions for
the engine: the squared norm of every unit (identical on every participating rank), how to apply a selection to the
weights (or gradients) in place, and how many literal zeros each parameter holds. It never sees a Trainer.

Executors are stateless between calls: dense copies (materializing path) live only inside one :meth:`session`
(one pruning step: score, select, apply), so a later call can never write stale values back over newer weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lightning_pat.core.masking import zero_channels_
from lightning_pat.core.norms import ACCUMULATION_DTYPE, channel_sq_sums, member_unit_abs_prod_sums
from lightning_pat.core.spec import Member, ResolvedCluster
from lightning_pat.core.units import unit_channels
from lightning_pat.parallel.comm import dtensor, ranks, reduce


@dataclass(frozen=True)
class UnitAction:
    """What to do to one cluster's units.

    Attributes:
        dropped: Sorted indices of units set to exactly zero.
        factors: Optional per-unit scale (group lasso) applied before zeroing; ``None`` for a hard mask.
    """

    dropped: Tensor
    factors: Tensor | None = None


@dataclass
class Reduced:
    """What one selection's reduction brought to this rank, identical on every rank that takes part.

    Attributes:
        q: Cluster name -> ``Q``: the squared norm of every unit over all members (``[C]``).
        shard: Cluster name -> the sum of the cluster's *shard rider* over its pieces (a per-unit partial computed
            from the local pieces, like ``Q``; e.g. the ``|w * g|`` sums of ``score="taylor"``).
        data: Cluster name -> the sum over every rank of the cluster's *data rider* (each rank's own statistics,
            e.g. the readers' input statistics of ``score="activation"``).
        columns: Reader member name -> the squared norm of each column (``[in_features]``), when asked for.
    """

    q: dict[str, Tensor]
    shard: dict[str, Tensor] = field(default_factory=dict)
    data: dict[str, Tensor] = field(default_factory=dict)
    columns: dict[str, Tensor] = field(default_factory=dict)


class Evidence(Protocol):
    """A data-aware score: rank-local partials that travel with the weight partials, and the scores made of them.

    ``shard_riders`` are per-cluster float64 partials of pieces (summed over the pieces once, like ``Q``);
    ``data_riders`` are per-cluster float64 statistics of this rank's own data (summed over every rank, so a cluster
    that carries one is reduced over its whole mesh). Every rank's rider of a cluster has the same length.
    """

    columns: bool  # whether the readers' column norms are needed

    def shard_riders(self) -> Mapping[str, Tensor]:
        """Cluster name -> this rank's partial (only clusters that have one)."""
        ...

    def data_riders(self) -> Mapping[str, Tensor]:
        """Cluster name -> this rank's statistics (only clusters that have them)."""
        ...

    def finish(self, reduced: Reduced) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` unit scores from the reduced values (identical on every rank)."""
        ...


class Executor(ABC):
    """Computes unit norms and applies unit actions for a fixed list of clusters.

    Args:
        clusters: The clusters this executor handles.
        params: Parameter name -> tensor (plain or DTensor), covering every member of ``clusters``.
    """

    kind: str = "base"

    def __init__(self, clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor]) -> None:
        self.clusters = list(clusters)
        self.params = {n: params[n] for rc in self.clusters for n in rc.param_names}
        self._channels: dict[tuple[str, int, int, int, int, int, torch.device], tuple[Tensor, Tensor]] = {}
        self._cache: dict[str, Tensor] | None = None  # dense copies, only inside a session

    @property
    def in_session(self) -> bool:
        """Whether a :meth:`session` is open."""
        return self._cache is not None

    @contextmanager
    def session(self) -> Iterator[None]:
        """Share dense copies between the calls of one step (score, then apply); all are dropped on exit."""
        self._cache = {}
        try:
            yield
        finally:
            self._cache = None

    def _zero_units(
        self, tensor: Tensor, rc: ResolvedCluster, m: Member, dropped: Tensor, *, offset: int = 0, length: int = -1
    ) -> None:
        """Zero ``dropped`` units of member ``m`` on a (local) tensor; the channel indices are cached per mask.

        A held mask (``Pruner.hold``, healing) passes the same ``dropped`` tensor every step, so after the first
        step this is a single zeroing per member; members of a cluster laid out alike (an MLP's rows and columns)
        share their indices within a step too.
        """
        length = tensor.shape[m.dim] if length < 0 else length
        key = (rc.name, m.start, m.stop, m.block, offset, length, tensor.device)  # what unit_channels reads of m
        hit = self._channels.get(key)
        if hit is None or hit[0] is not dropped:
            channels = unit_channels(
                m, dropped, num_units=rc.num_units, offset=offset, length=length, device=tensor.device
            )
            self._channels[key] = hit = (dropped, channels)
        zero_channels_(tensor, m, hit[1])

    @abstractmethod
    def unit_sq_norms(self, names: Collection[str] | None = None) -> dict[str, Tensor]:
        """Per cluster, ``Q``: the squared norm of every unit over all members (``[C]``, accumulation dtype).

        Args:
            names: Only these clusters (``None``: every cluster); the same on every rank.
        """

    def reduce(
        self,
        *,
        shard_riders: Mapping[str, Tensor] | None = None,
        data_riders: Mapping[str, Tensor] | None = None,
        columns: bool = False,
        weights: Collection[str] | None = None,
    ) -> Reduced:
        """``Q`` of every cluster, with the riders of an :class:`Evidence` reduced alongside (see :class:`Reduced`).

        The default serves plain tensors that every rank holds whole: shard riders are complete already, data riders
        are summed over every rank (one collective), columns are computed from the (dense) readers. ``weights``:
        the clusters whose ``Q`` is computed (``None``: every cluster; the same on every rank), for a data-aware
        selection that reads ``Q`` of a few clusters only (layer units), or of none.
        """
        out = Reduced(self.unit_sq_norms(weights))
        mine = [rc for rc in self.clusters if shard_riders and rc.name in shard_riders]
        out.shard = {rc.name: shard_riders[rc.name] for rc in mine}  # type: ignore[index]
        if data_riders:
            out.data = self._sum_data({rc.name: data_riders[rc.name] for rc in self.clusters if rc.name in data_riders})
        if columns:
            out.columns = self._columns()
        return out

    def _sum_data(self, riders: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Riders summed over every rank: one packed collective (nothing without a process group)."""
        if not riders:
            return {}
        summed = reduce.sum_over_ranks(torch.cat(list(riders.values())), group=ranks.world_group())
        out, start = {}, 0
        for name, rider in riders.items():
            out[name] = summed[start : start + rider.numel()]
            start += rider.numel()
        return out

    def _columns(self) -> dict[str, Tensor]:
        """Reader member name -> squared norm of each column of the whole tensor (dense readers)."""
        out = {}
        for rc in self.clusters:
            for m in rc.members:
                if m.role == "reader" and m.name not in out:
                    dense = self._dense_param(m.name)
                    out[m.name] = channel_sq_sums(dense.detach(), dim=1, acc_dtype=ACCUMULATION_DTYPE)
        return out

    @torch.no_grad()
    def unit_grad_products(self) -> dict[str, Tensor]:
        """Per cluster, ``[C]`` sums of ``|w * g|`` (``score="taylor"``), identical on every rank that holds them.

        A member without a gradient contributes nothing. The default serves whole tensors: plain ones as they are
        (no communication), DTensors gathered whole (``full_tensor`` of the weight and of its gradient: collectives
        every step, the price of a layout the sharded path cannot serve).
        """
        out = {}
        for rc in self.clusters:
            total_C = torch.zeros(rc.num_units, dtype=ACCUMULATION_DTYPE)
            for m in rc.members:
                param = self.params[m.name]
                if param.grad is None:
                    continue
                part_C = member_unit_abs_prod_sums(
                    dtensor.full_tensor(param), dtensor.full_tensor(param.grad), m, num_units=rc.num_units,
                    acc_dtype=ACCUMULATION_DTYPE,
                )  # fmt: skip
                total_C = total_C.to(part_C.device) + part_C
            out[rc.name] = total_C
        return out

    def _dense_param(self, name: str) -> Tensor:
        """The whole tensor of parameter ``name`` (a plain tensor here; executors that gather override this)."""
        return self.params[name]

    @abstractmethod
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """Scale and zero units in place: of the weights, or of their ``.grad`` when ``grads`` is true."""

    @abstractmethod
    def zero_counts(self) -> dict[str, tuple[int, int]]:
        """Per parameter, ``(literal zeros, numel)`` over the whole (global) tensor, identical on every rank."""
