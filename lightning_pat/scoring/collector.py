"""What every data-aware scorer of a training run is: a :class:`Collector` owns its state entry and its checks.

A collector (:class:`~lightning_pat.scoring.activation.ActivationStats`,
:class:`~lightning_pat.scoring.taylor.TaylorScores`, :class:`~lightning_pat.scoring.layers.LayerStats`,
:class:`~lightning_pat.scoring.experts.ExpertStats`) collects statistics while a model trains and keeps them under one
entry of the saved pruning state, :attr:`Collector.key`.
The training floor runs a set of them (:class:`lightning_pat.training.collectors.Collectors`) through the same verbs
at fixed points of a fit, and never needs to know which scorer it holds:

* :meth:`~Collector.reset` (a new schedule), :meth:`~Collector.attach` and :meth:`~Collector.detach` (forward hooks;
  a scorer without hooks does nothing), :meth:`~Collector.begin_batch` and :meth:`~Collector.end_batch` (the window
  of one training batch: hooked scorers count its forwards even in eval mode, the Taylor sums keep its term only
  when the optimizer really stepped);
* :meth:`~Collector.state_dict` and :meth:`~Collector.load_state_dict` (this rank's own statistics, exactly);
* :meth:`~Collector.saved_entry` (what the state holds under :attr:`~Collector.key`: the ranks' states in rank order,
  a collective, or this rank's own state for the same process's next fit) and :meth:`~Collector.load_saved` (this
  rank's part of it: :meth:`~Collector.rank_entry` picks it from a per-rank list);
* :meth:`~Collector.check_saved` (a saved entry checked against what this scorer holds, before anything of the
  state is applied) and :meth:`~Collector.check_layout` (the same without a scorer: only the entry's layout).

A :class:`SummedStats` (:class:`~lightning_pat.scoring.layers.LayerStats`,
:class:`~lightning_pat.scoring.experts.ExpertStats`) ends each selection the same way: its sums since the last one,
one float64 vector, are summed over the ranks, scored and started again; :func:`summed_over_ranks` sums those of every
such collector of a run in one collective.

The checks raise :class:`~lightning_pat.core.state_fields.StateError` naming the state (``what``), the field, what
was expected and what was found, like the core schema (:mod:`lightning_pat.core.state_schema`), which checks only the
entries core readers use and leaves these to their owners. Pure torch and the rank helpers; no Lightning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_pat.core.state_fields import FieldChecker, rank_entry
from lightning_pat.parallel.comm import ranks, reduce
from lightning_pat.parallel.executors import Evidence

if TYPE_CHECKING:
    from torch import Tensor
    from typing_extensions import Self


class Collector(ABC):
    """A scorer that collects statistics during training and owns its entry of the saved state.

    Subclasses set :attr:`key` and define :meth:`reset`, :meth:`state_dict`, :meth:`load_state_dict` and
    :meth:`check_entry`; the rest has defaults for a scorer without hooks whose every rank holds whole statistics.

    Attributes:
        key: The state entry (e.g. ``"activation"``): one per kind, fixed by the saved format.
        saved_when_unused: Whether a state holds the entry (``None``) when the run does not use this kind; a kind
            added after the format was fixed sets it ``False``, so that runs without it save what they saved before.
    """

    key: ClassVar[str]
    saved_when_unused: ClassVar[bool] = True

    @property
    def per_rank(self) -> bool:
        """Whether the ranks' states differ, so that a checkpoint keeps each rank's (else one: rank 0's)."""
        return True

    # ------------------------------------------------------------------ a fit's verbs
    @abstractmethod
    def reset(self) -> None:
        """Forget what was collected (a new schedule, or a selection consumed it)."""

    def attach(self) -> None:  # noqa: B027 - optional: a scorer without hooks does nothing
        """Start collecting from forwards (register the hooks); nothing for a scorer without hooks."""

    def detach(self) -> None:  # noqa: B027 - optional, as attach
        """Stop collecting from forwards (what was collected is kept); nothing for a scorer without hooks."""

    def begin_batch(self) -> None:  # noqa: B027 - optional: a scorer may ignore the batch window
        """A training batch opens (its forwards count even in eval mode)."""

    def end_batch(self, *, stepped: bool) -> None:  # noqa: B027 - optional, as begin_batch
        """The training batch is over.

        Args:
            stepped: A real optimizer step applied the batch's gradients (not accumulation, not an AMP-skipped step).
        """

    def as_evidence(self) -> Evidence | None:
        """This scorer as the selection's data-aware score (its partials ride the one reduction), or ``None``."""
        return None

    # ------------------------------------------------------------------ its state entry
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's statistics as plain types and CPU tensors."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (``{}``: start empty)."""

    def saved_entry(self, *, gather: bool = True) -> list[dict[str, Any]] | dict[str, Any]:
        """The state's entry under :attr:`key`.

        Args:
            gather: Every rank's state in rank order (a collective: every rank calls it), or only rank 0's when
                every rank holds the same (:attr:`per_rank` false). Else this rank's own state, a mapping (what the
                same process's next fit continues from; no collective).
        """
        mine = self.state_dict()
        if not gather:
            return mine
        if not self.per_rank:
            return [mine]
        return ranks.gather_objects(mine, group=ranks.world_group())

    def rank_entry(self, saved: Sequence[Mapping[str, Any]] | None, *, rank: int, world: int) -> Mapping[str, Any]:
        """This rank's entry of the ranks' saved states (rank order); ``{}`` if there is none.

        By default every entry is whole, so a rank beyond the saved ones takes rank 0's (see
        :func:`~lightning_pat.core.state_fields.rank_entry`); a scorer whose entries are pieces of a split refuses
        another number of ranks.

        Raises:
            ValueError: If the entries are pieces of a split and ``world`` differs from the number saved.
        """
        return rank_entry(saved, rank=rank, world=world, split=None, who=self.key, entries="entries", fix="")

    def load_saved(self, entry: object) -> None:
        """Load this rank's part of the state's entry (``None``: nothing saved, the statistics start empty).

        Args:
            entry: The ranks' states in rank order (a checkpoint, checked by :meth:`check_saved`), or this rank's own
                state, a mapping (the same process's previous fit: :meth:`saved_entry` with ``gather=False``).

        Raises:
            ValueError: As :meth:`rank_entry` and :meth:`load_state_dict` raise it.
        """
        if isinstance(entry, Mapping):
            self.load_state_dict(entry)
            return
        assert entry is None or isinstance(entry, Sequence)  # a checked state's entry is a list
        self.load_state_dict(self.rank_entry(entry, rank=ranks.world_rank(), world=ranks.world_size()))

    # ------------------------------------------------------------------ its checks
    @classmethod
    @abstractmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: Self | None) -> None:
        """Check a saved entry under :attr:`key`: its layout, and with ``held`` against what that scorer holds.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """

    def check_saved(self, raw: object, what: str) -> None:
        """Check the state's entry under :attr:`key` against this scorer, before anything of the state is applied.

        Args:
            raw: The entry (``None``: nothing saved, nothing to check).
            what: The state's name, the first words of every message.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        if raw is not None:
            self.check_entry(raw, FieldChecker(what), held=self)

    @classmethod
    def check_layout(cls, raw: object, what: str) -> None:
        """Check the state's entry under :attr:`key` without a scorer (this run does not collect it): its layout.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        if raw is not None:
            cls.check_entry(raw, FieldChecker(what), held=None)


class SummedStats(Collector):
    """A collector whose sums since the last selection are one float64 vector that a selection sums over the ranks.

    Subclasses keep the sums in ``_sum`` and ``_count`` and define :meth:`stacked` (this rank's vector) and
    :meth:`scores` (from the vector summed over ranks); :meth:`take_scores` scores a summed vector and starts the sums
    again, :meth:`summed_scores` does both for this collector alone.
    """

    _sum: dict[str, Tensor]
    _count: dict[str, Tensor]

    @property
    def scored(self) -> bool:
        """Whether it has units to score (else a selection reads no scores from it and sums nothing)."""
        return True

    @abstractmethod
    def stacked(self) -> Tensor:
        """This rank's sums since the last selection as one 1-D float64 vector (the same length on every rank)."""

    @abstractmethod
    def scores(self, summed: Tensor | None = None) -> dict[str, Tensor] | None:
        """Cluster name -> float64 scores; ``None`` if nothing was seen since the last selection.

        Args:
            summed: :meth:`stacked` summed over ranks; ``None`` uses this rank's sums.
        """

    def take_scores(self, summed: Tensor | None) -> dict[str, Tensor] | None:
        """:meth:`scores` of ``summed`` (its entry of :func:`summed_over_ranks`); then the sums start again.

        ``None`` (nothing to score, see :attr:`scored`) gives ``None``.

        Raises:
            ValueError: As :meth:`scores` raises it.
        """
        if summed is None:
            return None
        try:
            return self.scores(summed)
        finally:
            self._sum, self._count = {}, {}

    def summed_scores(self) -> dict[str, Tensor] | None:
        """:meth:`scores` from the sums of every rank (one collective when distributed); then the sums start again.

        Raises:
            ValueError: As for :meth:`scores`.
        """
        return self.take_scores(summed_over_ranks(self)[0])


def summed_over_ranks(*stats: SummedStats | None) -> list[Tensor | None]:
    """Each collector's :meth:`~SummedStats.stacked` summed over the world's ranks, all in one collective.

    The vectors are packed into one (:func:`~lightning_pat.parallel.comm.reduce.sum_packed_over_ranks`), with the bits
    of one sum each. ``None`` for a ``None`` collector and one with nothing to score (:attr:`~SummedStats.scored`).
    """
    mine = [s.stacked() if s is not None and s.scored else None for s in stats]
    summed = iter(reduce.sum_packed_over_ranks([v for v in mine if v is not None], group=ranks.world_group()))
    return [None if v is None else next(summed) for v in mine]


def entries(raw: object, check: FieldChecker, key: str) -> list[tuple[str, Mapping[str, Any]]]:
    """The per-rank entries of a saved list under ``key``, each as ``(its field name, the mapping)``.

    Raises:
        StateError: If ``raw`` is not a list or an entry not a mapping with str keys.

    Example::

        >>> entries([{"steps": 1}], FieldChecker("the state"), "taylor")
        [('taylor[0]', {'steps': 1})]
    """
    out = []
    for r, item in enumerate(check.sequence(raw, key)):
        where = f"{key}[{r}]"
        entry = check.mapping(item, where)
        assert entry is not None
        out.append((where, entry))
    return out


__all__ = ["Collector", "SummedStats", "entries", "summed_over_ranks"]
