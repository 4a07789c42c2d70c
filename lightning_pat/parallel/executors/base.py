"""The executor interface and the unit action it applies.

An executor owns a fixed list of resolved clusters and the parameters they name. It answers three questions for
the engine: the squared norm of every unit (identical on every participating rank), how to apply a selection to the
weights (or gradients) in place, and how many literal zeros each parameter holds. It never sees a Trainer.

Executors are stateless between calls: dense copies (materializing path) live only inside one :meth:`session`
(one pruning step: score, select, apply), so a later call can never write stale values back over newer weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from lightning_pat.core.masking import unit_channels, zero_channels_
from lightning_pat.core.spec import Member, ResolvedCluster


@dataclass(frozen=True)
class UnitAction:
    """What to do to one cluster's units.

    Attributes:
        dropped: Sorted indices of units set to exactly zero.
        factors: Optional per-unit scale (group lasso) applied before zeroing; ``None`` for a hard mask.
    """

    dropped: Tensor
    factors: Tensor | None = None


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
        self._channels: dict[tuple, tuple[Tensor, Tensor]] = {}
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
        step this is a single ``index_fill_`` per member.
        """
        length = tensor.shape[m.dim] if length < 0 else length
        key = (rc.name, m.name, m.dim, m.start, offset, length, tensor.device)
        hit = self._channels.get(key)
        if hit is None or hit[0] is not dropped:
            channels = unit_channels(
                m, dropped, num_units=rc.num_units, offset=offset, length=length, device=tensor.device
            )
            self._channels[key] = hit = (dropped, channels)
        zero_channels_(tensor, m, hit[1])

    @abstractmethod
    def unit_sq_norms(self) -> dict[str, Tensor]:
        """Per cluster, ``Q``: the squared norm of every unit over all members (``[C]``, accumulation dtype)."""

    @abstractmethod
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """Scale and zero units in place: of the weights, or of their ``.grad`` when ``grads`` is true."""

    @abstractmethod
    def zero_counts(self) -> dict[str, tuple[int, int]]:
        """Per parameter, ``(literal zeros, numel)`` over the whole (global) tensor, identical on every rank."""
