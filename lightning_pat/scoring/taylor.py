r"""First-order unit scores from the gradients training already computes (opt-in, ``score="taylor"``).

The score of unit ``c`` is the first-order (Taylor) estimate of how much the loss depends on it, summed over the
real optimizer steps since the previous selection::

    score_c = sum over real steps t since the last selection, sum over members, sum over the unit's elements k:
              |w_k(t) * g_k(t)|

* ``g(t)`` is the gradient the optimizer applies at step ``t``: after gradient accumulation (one term per real
  step, the micro-batches' sum as Lightning builds it), after the DDP all-reduce / FSDP2 reduce-scatter, unscaled
  by AMP. A step the AMP scaler skips adds nothing (its term is dropped at the batch end).
* ``w(t)`` is the weight the optimizer updates with ``g(t)``: the live weight in ``mode="direct"`` (a dropped
  unit's weights are zero, so it scores 0 and stays dropped unless the mask changes elsewhere); the dense latent
  in ``mode="latent"`` (a dropped unit keeps its latent weights and its gradient at the projected point, so it can
  earn its way back).
* In healing (the mask is frozen) nothing is collected. The sums restart from zero after each fresh selection.

Cost: one elementwise product and a per-channel sum over every clustered parameter per real step (on the local
shards under FSDP2/tensor parallelism: no communication), ``C`` float64 values per cluster of memory. At a selection
the per-unit sums travel in the sharded path's one packed gather with the weight partials (no extra collective);
with plain parameters (one device, DDP) the gradients are identical on every rank already, so nothing is summed.
A DTensor cluster that the sharded path cannot serve (routed to the materializing executor) gathers its weights and
gradients whole every step instead: correct, but a collective per member per step.

Legend: ``C`` units of a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_pat.core.state_fields import FieldChecker, rank_entry
from lightning_pat.parallel.comm import dtensor
from lightning_pat.parallel.executors import Evidence, Executor, Reduced, ShardedExecutor
from lightning_pat.scoring.collector import Collector, entries


class TaylorScores(Collector):
    """Per-unit sums of ``|w * g|`` over the real steps since the last selection (see the module docstring).

    An :class:`~lightning_pat.parallel.executors.Evidence`: pass it to ``Pruner.step(..., evidence=...)``. A
    :class:`~lightning_pat.scoring.collector.Collector` of the state's ``taylor`` entry without forward hooks: the
    ranks' partial sums in rank order when they are partials of sharded pieces, else one entry (plain parameters:
    the same sums on every rank). A training batch's term is kept at its end only if the optimizer really stepped.

    Args:
        executors: The pruner's executors (they read the local pieces of the weights and gradients).

    Example::

        >>> import torch.nn as nn
        >>> from lightning_pat import Cluster
        >>> from lightning_pat.pruning.plan import make_plan
        >>> from lightning_pat.pruning.pruner import Pruner
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pruner = Pruner(mlp, make_plan(mlp, Cluster("h", writers=["0.weight"], readers=["2.weight"])))
        >>> taylor = TaylorScores(pruner.executors)
        >>> mlp(torch.randn(3, 4)).sum().backward()
        >>> taylor.observe(); taylor.commit()
        >>> pruner.step({"h": 0.5}, evidence=taylor).dropped["h"].__len__()
        4
    """

    key: ClassVar[str] = "taylor"
    columns = False

    def __init__(self, executors: Sequence[Executor]) -> None:
        """Build empty sums.

        Raises:
            ValueError: If every member of a cluster is frozen (``requires_grad=False``): its sums would stay 0 and
                the selection would drop units by index.
        """
        for ex in executors:
            for rc in ex.clusters:
                if not any(ex.params[n].requires_grad for n in rc.param_names):
                    raise ValueError(
                        f"cluster {rc.name!r} has no member with a gradient: {list(rc.param_names)[:4]} are frozen "
                        "(requires_grad=False), so their |w * g| sums stay 0 and every selection would drop units "
                        "by index. Use score='activation' or score='rms', unfreeze them (requires_grad_(True)), or "
                        "remove the cluster."
                    )
        self.executors = list(executors)
        self.sums: dict[str, Tensor] = {}
        self.steps = 0
        self._pending: dict[str, Tensor] | None = None

    @torch.no_grad()
    def observe(self) -> None:
        """Take this step's ``|w * g|`` per unit (call between the backward and the update).

        The term is kept until :meth:`commit` or :meth:`discard`; a second call before either replaces the first.
        """
        pending: dict[str, Tensor] = {}
        for ex in self.executors:
            pending.update(ex.unit_grad_products())
        self._pending = pending

    def commit(self) -> None:
        """The optimizer really stepped: add the observed term to the sums."""
        if self._pending is None:
            return
        for name, part in self._pending.items():
            prev = self.sums.get(name)
            self.sums[name] = part if prev is None else prev + part.to(prev.device)
        self.steps += 1
        self._pending = None

    def discard(self) -> None:
        """The step did not happen (AMP skipped it): forget the observed term."""
        self._pending = None

    def reset(self) -> None:
        """Start new sums (after a selection)."""
        self.sums, self.steps, self._pending = {}, 0, None

    def end_batch(self, *, stepped: bool) -> None:
        """The training batch is over: keep its observed term if the optimizer ``stepped``, else forget it."""
        self.commit() if stepped else self.discard()

    def as_evidence(self) -> Evidence:
        """The sums are the selection's data-aware score (see :meth:`shard_riders`, :meth:`finish`)."""
        return self

    # ------------------------------------------------------------------ evidence
    def shard_riders(self) -> dict[str, Tensor]:
        """Cluster name -> this rank's partial sums (summed over the pieces in the selection's one reduction).

        Raises:
            ValueError: If no real step has been observed since the last selection (every score would be 0).
        """
        if self.steps == 0:
            raise ValueError(
                "score='taylor' has no gradient sums yet: no real optimizer step was observed since the last "
                "selection (e.g. the first selection right at step 0, or a resume without the saved sums). Give the "
                "schedule at least one step before each selection (warmup_steps >= 1 or every_n_steps >= 1), or use "
                "another score."
            )
        return dict(self.sums)

    def data_riders(self) -> dict[str, Tensor]:
        """None: the gradients are already summed over the data-parallel ranks by the training strategy."""
        return {}

    def finish(self, reduced: Reduced) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` float64 scores: the sums over every piece.

        Raises:
            ValueError: If a score is not finite (NaN/Inf gradients or weights).
        """
        out = {}
        for name, total_C in reduced.shard.items():
            if not bool(torch.isfinite(total_C).all()):
                raise ValueError(
                    f"Cluster {name!r}: score='taylor' sums of |w * g| are not finite (NaN/Inf gradients or weights "
                    "reached an optimizer step); no units were pruned. Check the learning rate or loss scaling."
                )
            out[name] = total_C
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's sums (CPU float64) and the number of steps in them."""
        return {"steps": self.steps, "sums": {k: v.detach().cpu().clone() for k, v in self.sums.items()}}

    @property
    def sharded(self) -> bool:
        """Whether the sums are partials of local pieces (they differ per rank and depend on the layout)."""
        return any(isinstance(ex, ShardedExecutor) for ex in self.executors)

    @property
    def per_rank(self) -> bool:
        """Sharded partials differ per rank (a checkpoint keeps every rank's); plain sums are the same (one entry)."""
        return self.sharded

    def rank_entry(self, saved: Sequence[Mapping[str, Any]] | None, *, rank: int, world: int) -> Mapping[str, Any]:
        """This rank's entry of the ranks' saved states (rank order); ``{}`` if there is none.

        Raises:
            ValueError: If the sums are partials of sharded pieces and the checkpoint has another number of ranks.
        """
        split = "as partials of their sharded pieces" if self.sharded else None  # plain: every rank's sums the same
        return rank_entry(
            saved, rank=rank, world=world, split=split, who="score='taylor'", entries="the gradient sums",
            fix="resume with another score",
        )  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly.

        Raises:
            ValueError: If a saved sum does not have its cluster's number of units.
        """
        self.reset()
        first = next((t for ex in self.executors for t in ex.params.values()), None)
        device = None if first is None else dtensor.local_tensor(first).device
        units = {rc.name: rc.num_units for ex in self.executors for rc in ex.clusters}
        for name, total in state.get("sums", {}).items():
            if name not in units:
                continue
            if total.shape != (units[name],):
                raise ValueError(
                    f"The saved score='taylor' sums of cluster {name!r} have shape {tuple(total.shape)}, the cluster "
                    f"{units[name]} units; resume with the same model."
                )
            self.sums[name] = total.to(device=device, dtype=torch.float64).clone()
        self.steps = int(state.get("steps", 0))

    @classmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: TaylorScores | None) -> None:
        """Check a saved ``taylor`` entry; with ``held``, against its clusters and their numbers of units.

        Per rank: the steps, and per cluster its sums (finite, not negative).

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        units = None if held is None else {rc.name: rc.num_units for ex in held.executors for rc in ex.clusters}
        for where, entry in entries(raw, check, cls.key):
            check.integer(entry.get("steps", 0), f"{where}.steps")
            sums = check.mapping(entry.get("sums", {}), f"{where}.sums") or {}
            check.names(sums, units, f"{where}.sums", "clusters")
            for name, value in sums.items():
                shape = None if units is None else (units[name],)
                check.tensor(value, f"{where}.sums[{name!r}]", shape=shape, nonnegative=True)
