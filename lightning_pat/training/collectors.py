"""The data-aware scorers of a training run as one set: what the controller does to all of them at once.

Each scorer is a :class:`~lightning_pat.scoring.collector.Collector`: it owns its entry of the saved state, its
checks and its verbs. :data:`KINDS` registers them, in the state's order:
:class:`~lightning_pat.scoring.activation.ActivationStats` (``score="activation"``, entry ``activation``),
:class:`~lightning_pat.scoring.taylor.TaylorScores` (``score="taylor"``, entry ``taylor``),
:class:`~lightning_pat.scoring.layers.LayerStats` (layer units with ``layer_score="cosine"``, entry
``layer_scores``) and :class:`~lightning_pat.scoring.experts.ExpertStats` (whole routed experts with a data
``expert_score``, entry ``expert_scores``, saved only by a run that uses it). A new scorer is a module of
``scoring/`` plus its line in :data:`KINDS` (and its entry's name in the saved format's vocabulary,
:data:`lightning_pat.core.state_schema.KEYS`).

:class:`Collectors` is the list of the scorers in use (the controller builds them: which ones depends on the score
and the clusters). Its verbs run every one of them at fixed points of a fit: :meth:`~Collectors.reset` (a new
schedule), :meth:`~Collectors.attach` and :meth:`~Collectors.detach` (the forward hooks, from the start of a fit
until the freeze or the end of the fit), :meth:`~Collectors.batch_open` and :meth:`~Collectors.end_batch` (the
window of a training batch), :meth:`~Collectors.state_dicts`, :meth:`~Collectors.checks` and
:meth:`~Collectors.load` (the state's entries: built, checked before anything is applied, read), and
:attr:`~Collectors.evidence` (what the selection's one reduction carries). The Taylor sums have no forward hooks:
the controller observes each step's term itself, and the batch end commits or discards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from lightning_pat.parallel.executors import Evidence
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.collector import Collector
from lightning_pat.scoring.experts import ExpertStats
from lightning_pat.scoring.layers import LayerStats
from lightning_pat.scoring.taylor import TaylorScores

#: Every kind of collector a state holds an entry for (``None`` when the run does not use it), in the state's order.
KINDS: tuple[type[Collector], ...] = (ActivationStats, TaylorScores, LayerStats, ExpertStats)

_C = TypeVar("_C", bound=Collector)


class Collectors:
    """The active scorers of a run (see the module docstring), at most one of each kind, in :data:`KINDS` order.

    Args:
        collectors: The scorers (``None`` entries are left out).

    Raises:
        TypeError: If a scorer's kind is not registered in :data:`KINDS`.

    Example::

        >>> scorers = Collectors()
        >>> scorers.evidence is None, scorers.state_dicts()
        (True, {'activation': None, 'taylor': None, 'layer_scores': None})
    """

    def __init__(self, *collectors: Collector | None) -> None:
        self._items: dict[type[Collector], Collector] = {}
        for collector in collectors:
            if collector is not None:
                self.put(collector)

    def put(self, collector: Collector) -> None:
        """Use ``collector`` (it replaces the scorer of its kind).

        Raises:
            TypeError: If its kind is not registered in :data:`KINDS`.
        """
        kind = next((k for k in KINDS if isinstance(collector, k)), None)
        if kind is None:
            raise TypeError(
                f"{type(collector).__name__} is not a registered collector kind ({[k.__name__ for k in KINDS]}); "
                "add it to lightning_pat.training.collectors.KINDS."
            )
        self._items[kind] = collector

    def __iter__(self) -> Iterator[Collector]:
        """The scorers in use, in :data:`KINDS` order."""
        return iter([self._items[k] for k in KINDS if k in self._items])

    def __len__(self) -> int:
        return len(self._items)

    def get(self, kind: type[_C]) -> _C | None:
        """The scorer of ``kind`` in use, else ``None``."""
        found = self._items.get(kind)
        return found if isinstance(found, kind) else None

    # ------------------------------------------------------------------ the scorers by kind (for their own readers)
    @property
    def act(self) -> ActivationStats | None:
        """``score="activation"``: the readers' input statistics."""
        return self.get(ActivationStats)

    @property
    def taylor(self) -> TaylorScores | None:
        """``score="taylor"``: ``|w * g|`` summed between selections."""
        return self.get(TaylorScores)

    @property
    def layers(self) -> LayerStats | None:
        """Layer units with ``layer_score="cosine"``: ``1 - cos(input, output)``."""
        return self.get(LayerStats)

    @property
    def experts(self) -> ExpertStats | None:
        """Whole routed experts with a data ``expert_score``: per-expert token counts and output norms."""
        return self.get(ExpertStats)

    @property
    def evidence(self) -> Evidence | None:
        """The data-aware score whose partials travel in the selection's reduction (``Pruner.step(evidence=)``)."""
        return next((e for c in self if (e := c.as_evidence()) is not None), None)

    # ------------------------------------------------------------------ a fit's verbs
    def reset(self) -> None:
        """A new schedule: every scorer starts empty."""
        for scorer in self:
            scorer.reset()

    def attach(self) -> None:
        """Register the forward hooks (they are removed at the freeze and at the end of the fit)."""
        for scorer in self:
            scorer.attach()

    def detach(self) -> None:
        """Remove the forward hooks (what they collected is kept): no per-forward cost during healing."""
        for scorer in self:
            scorer.detach()

    def batch_open(self, value: bool) -> None:
        """A training batch opens: its forwards count even in eval mode.

        ``False``: the batch ends without a real optimizer step (:meth:`end_batch` with ``stepped=False``).
        """
        if not value:
            self.end_batch(stepped=False)
            return
        for scorer in self:
            scorer.begin_batch()

    def end_batch(self, *, stepped: bool) -> None:
        """The training batch is over: the hooked scorers stop counting, and a Taylor score keeps the batch's sums.

        A Taylor score keeps the batch's gradient products only if a real optimizer step applied them (not
        accumulation, not an AMP-skipped step).
        """
        for scorer in self:
            scorer.end_batch(stepped=stepped)

    # ------------------------------------------------------------------ the state's entries
    def state_dicts(self, *, gather: bool = True) -> dict[str, Any]:
        """The state's entry of every registered kind (:data:`KINDS` order): ``None`` for a kind not in use.

        A kind not in use whose ``saved_when_unused`` is false (the expert scores) has no entry at all.

        Args:
            gather: Every rank's own states in rank order (a collective: every rank calls it), as ranks see other
                batches and each resumes its own; the Taylor sums of plain parameters, the same on every rank, once.
                Else this rank's own state (a mapping, what this process's next fit continues from; no collective).
        """
        out: dict[str, Any] = {kind.key: None for kind in KINDS if kind.saved_when_unused}
        for scorer in self:
            out[scorer.key] = scorer.saved_entry(gather=gather)
        return out

    def checks(self) -> dict[str, Callable[[object, str], None]]:
        """Entry name -> the check of a saved state's entry (``check(entry, what)``), for every registered kind.

        A scorer in use checks its entry against what it holds (its modules, clusters, widths); a kind the run does
        not use checks only the layout of what was saved (the entry is not read).
        """
        return {kind.key: kind.check_layout if (held := self.get(kind)) is None else held.check_saved for kind in KINDS}

    def load(self, saved: Mapping[str, Any], *, errors: Callable[[str], AbstractContextManager[None]]) -> None:
        """Load this rank's entries of a state; a scorer with none saved (the score changed) collects from here on.

        Args:
            saved: A state (see :mod:`lightning_pat.training.state`; checked first, see :meth:`checks`), or the
                same process's previous fit's (:meth:`state_dicts` with ``gather=False``).
            errors: The controller's ``prefixed``: it turns a scorer's ``ValueError`` into its own error.

        Raises:
            ValueError: As ``errors`` raises it: statistics split by tensor parallelism (or Taylor partials of
                sharded pieces) over another number of ranks, or a saved statistic that does not fit this model.
        """
        for scorer in self:
            with errors("CoupledPruningCallback"):
                scorer.load_saved(saved.get(scorer.key))
