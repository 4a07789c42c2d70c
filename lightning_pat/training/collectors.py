"""The data-aware scorers of a training run as one set: what the controller does to all of them at once.

:class:`Collectors` holds the scorers in use, each ``None`` when it is not:
:class:`~lightning_pat.scoring.activation.ActivationStats` (``score="activation"``),
:class:`~lightning_pat.scoring.taylor.TaylorScores` (``score="taylor"``) and
:class:`~lightning_pat.scoring.layers.LayerStats` (layer units with ``layer_score="cosine"``). The controller builds
them (which ones depends on the score and the clusters) and calls the set's verbs at fixed points of a fit:
:meth:`~Collectors.reset` (a new schedule), :meth:`~Collectors.attach` and :meth:`~Collectors.detach` (the forward
hooks, from the start of a fit until the freeze or the end of the fit), :meth:`~Collectors.batch_open` (a training
batch is open), :meth:`~Collectors.state_dicts` and :meth:`~Collectors.load` (the state's ``activation``, ``taylor``
and ``layer_scores`` entries; :meth:`~Collectors.saved_shapes` for their checks), and :attr:`~Collectors.evidence`
(what the selection's one reduction carries). The Taylor sums have no forward hooks: the controller observes,
commits and discards each step's term itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from lightning_pat.parallel.comm import ranks
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.layers import LayerStats
from lightning_pat.scoring.taylor import TaylorScores
from lightning_pat.training import state


class Collectors:
    """The active scorers of a run (see the module docstring); empty until the controller builds them.

    Example::

        >>> scorers = Collectors()
        >>> scorers.evidence is None, scorers.state_dicts()
        (True, {'activation': None, 'taylor': None, 'layer_scores': None})
    """

    def __init__(self) -> None:
        self.act: ActivationStats | None = None  # score="activation": the readers' input statistics
        self.taylor: TaylorScores | None = None  # score="taylor": |w * g| summed between selections
        self.layers: LayerStats | None = None  # layer units, layer_score="cosine": 1 - cos(input, output)

    def _hooked(self) -> list[ActivationStats | LayerStats]:
        """The scorers that collect through forward hooks (the activation statistics, then the layer stats)."""
        return [c for c in (self.act, self.layers) if c is not None]

    @property
    def evidence(self) -> ActivationStats | TaylorScores | None:
        """The data-aware score whose partials travel in the selection's reduction (``Pruner.step(evidence=)``)."""
        return self.act or self.taylor

    def reset(self) -> None:
        """A new schedule: every scorer starts empty."""
        for scorer in (self.act, self.taylor, self.layers):
            if scorer is not None:
                scorer.reset()

    def attach(self) -> None:
        """Register the forward hooks (they are removed at the freeze and at the end of the fit)."""
        for scorer in self._hooked():
            scorer.attach()

    def detach(self) -> None:
        """Remove the forward hooks (what they collected is kept): no per-forward cost during healing."""
        for scorer in self._hooked():
            scorer.detach()

    def batch_open(self, value: bool) -> None:
        """Tell the hooked scorers whether a training batch is open (its forwards count even in eval mode)."""
        for scorer in self._hooked():
            scorer.in_batch = value

    def end_batch(self, *, stepped: bool) -> None:
        """The training batch is over: the hooked scorers stop counting, and a Taylor score keeps the batch's sums.

        A Taylor score keeps the batch's gradient products only if a real optimizer step applied them (not
        accumulation, not an AMP-skipped step).
        """
        self.batch_open(False)
        if self.taylor is not None:
            self.taylor.commit() if stepped else self.taylor.discard()

    def saved_shapes(self) -> dict[str, Any]:
        """What a saved state's statistics are checked against (``state.restore_context``'s ``readers``, ``layers``).

        The reader modules' ``in_features`` by name and the hooked layers' module paths; ``None`` without the scorer.
        """
        act, layers = self.act, self.layers
        return {
            "readers": None if act is None else {n: m.in_features for n, m in act.modules.items()},
            "layers": None if layers is None else list(layers.modules),
        }

    def state_dicts(self, *, gather: bool = True) -> dict[str, list[Any] | None]:
        """The state's ``activation``, ``taylor`` and ``layer_scores`` entries: per-rank states, or ``None``.

        Args:
            gather: Every rank's own states in rank order (a collective: every rank calls it), as ranks see other
                batches and each resumes its own; the Taylor sums of plain parameters, the same on every rank, once.
                Else this rank's own state at every rank's index (what this process's next fit continues from; no
                collective).
        """
        if not gather:
            world = ranks.world_size()
            return {
                "activation": None if self.act is None else [self.act.state_dict()] * world,
                "taylor": None if self.taylor is None else [self.taylor.state_dict()] * world,
                "layer_scores": None if self.layers is None else [self.layers.state_dict()] * world,
            }
        activation = None
        if self.act is not None:
            activation = ranks.gather_objects(self.act.state_dict(), group=ranks.world_group())
        taylor = None
        if self.taylor is not None:  # sharded: every rank's partials; plain: the same sums on every rank
            mine = self.taylor.state_dict()
            sharded = self.taylor.sharded
            taylor = ranks.gather_objects(mine, group=ranks.world_group()) if sharded else [mine]
        layer_scores = None
        if self.layers is not None:
            layer_scores = ranks.gather_objects(self.layers.state_dict(), group=ranks.world_group())
        return {"activation": activation, "taylor": taylor, "layer_scores": layer_scores}

    def load(self, saved: Mapping[str, Any], *, errors: Callable[[str], AbstractContextManager[None]]) -> None:
        """Load this rank's entries of a state; a scorer with none saved (the score changed) collects from here on.

        Args:
            saved: A state (see :mod:`lightning_pat.training.state`).
            errors: The controller's ``prefixed``: it turns the Taylor sums' ``ValueError`` into its own error.

        Raises:
            ValueError: If the activation statistics were sharded by tensor parallelism over another number of ranks,
                or a saved statistic does not fit this model; the Taylor sums' errors as ``errors`` raises them.
        """
        if self.act is not None:
            self.act.load_state_dict(state.rank_activation(saved.get("activation")))
        if self.taylor is not None:
            rank, world = ranks.world_rank(), ranks.world_size()
            with errors("CoupledPruningCallback"):
                self.taylor.load_state_dict(self.taylor.rank_entry(saved.get("taylor"), rank=rank, world=world))
        if self.layers is not None:  # this rank's sums since the last selection
            self.layers.load_state_dict(state.rank_activation(saved.get("layer_scores")))
