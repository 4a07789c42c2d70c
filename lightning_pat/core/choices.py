"""The options' vocabularies and ranges, spelled once (pure: the standard library only).

Every option that takes one of a few words has its ``Literal`` here, and the tuple of its words is derived from that
``Literal`` (``get_args``), so the type and the check cannot drift apart. Every numeric option has its :class:`Range`.
The readers: :mod:`lightning_pat.pruning.options` (the options' checks), :mod:`lightning_pat.core.schedule` (the ramp
shape and the step counts), :mod:`lightning_pat.scoring.layers` and :mod:`lightning_pat.scoring.experts` (the layer
and expert scores), the executors' routing (:data:`EXECUTOR_KINDS`), and :mod:`lightning_pat.core.state_schema`,
which checks a saved state's options against the same tuples and ranges (it sits below the options and cannot import
them). :func:`check_option` in :mod:`lightning_pat.core.checks` checks one option against its entry here.

Example::

    >>> METHODS, RANGES["ramp_steps"]
    (('hard', 'group_lasso'), Range(low=1, high=None, integer=True, none_ok=False))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

#: ``mode``: the optimizer updates a dense latent copy, or the weights are projected themselves.
Mode = Literal["latent", "direct"]
MODES: tuple[str, ...] = get_args(Mode)
#: ``method``: drop the lowest-scoring units, or a block soft-threshold during the ramp.
Method = Literal["hard", "group_lasso"]
METHODS: tuple[str, ...] = get_args(Method)
#: ``ramp``: the shape of the ramp from 0 to the final target (:class:`~lightning_pat.core.schedule.Schedule`).
RampShape = Literal["cubic", "linear"]
RAMP_SHAPES: tuple[str, ...] = get_args(RampShape)
#: The callback's ``score``: a score of :data:`~lightning_pat.core.norms.SCORE_TYPES`, or ``"auto"`` (the default).
TrainingScore = Literal["auto", "rms", "l2", "param_cost", "activation", "taylor"]
TRAINING_SCORES: tuple[str, ...] = get_args(TrainingScore)
#: ``layer_score``: ``1 - cos(input, output)`` from training forwards, or the output projections' RMS.
LayerScore = Literal["cosine", "weight"]
LAYER_SCORES: tuple[str, ...] = get_args(LayerScore)
#: ``expert_score``: how whole routed experts are ranked: from the training tokens routed to them (REAP's
#: router-weighted output norm summed or averaged over those tokens, or their count), or by their weights.
ExpertScoreChoice = Literal["reap_sum", "reap", "frequency", "weight"]
EXPERT_SCORES: tuple[str, ...] = get_args(ExpertScoreChoice)
#: ``executor``: which path serves a cluster (``"auto"``: sharded where eligible, see the executors' routing).
ExecutorKind = Literal["auto", "materializing", "sharded"]
EXECUTOR_KINDS: tuple[str, ...] = get_args(ExecutorKind)
#: ``distill_teacher_store``: where a copied distillation teacher is saved for resume.
TeacherStore = Literal["checkpoint", "file"]
TEACHER_STORES: tuple[str, ...] = get_args(TeacherStore)
#: ``target_allocation`` of one step: by unit costs per parameter removed, or by kept fractions.
Allocation = Literal["importance", "fractions"]
ALLOCATIONS: tuple[str, ...] = get_args(Allocation)
#: The callback's ``target_allocation``: ``"auto"`` (by importance with a data-aware score), or one of the rules.
TrainingAllocation = Literal["auto", "importance", "fractions"]
TRAINING_ALLOCATIONS: tuple[str, ...] = get_args(TrainingAllocation)
#: ``target_side``: the closest achievable size not above the target, or not below it.
Side = Literal["below", "above"]
SIDES: tuple[str, ...] = get_args(Side)
#: ``target_widths``: one width per declaration (a stock config loads it), or units ranked by score per family.
Widths = Literal["uniform", "ranked"]
WIDTHS: tuple[str, ...] = get_args(Widths)

#: Option name -> its words, for the options a saved state or an entry point checks by name.
CHOICES: Mapping[str, tuple[str, ...]] = {
    "mode": MODES,
    "method": METHODS,
    "ramp": RAMP_SHAPES,
    "score": TRAINING_SCORES,
    "layer_score": LAYER_SCORES,
    "expert_score": EXPERT_SCORES,
    "executor": EXECUTOR_KINDS,
    "distill_teacher_store": TEACHER_STORES,
    "target_allocation": TRAINING_ALLOCATIONS,
    "target_side": SIDES,
    "target_widths": WIDTHS,
}
#: The options that are ``True`` or ``False``.
SWITCHES: tuple[str, ...] = ("heal", "log_metrics", "debug_check_selection", "shrink_on_freeze")


@dataclass(frozen=True)
class Range:
    """The values a numeric option takes: ``[low, high]`` (``high=None``: no upper bound).

    Attributes:
        low: The smallest value (an int for an int option, so that messages read ``>= 1``).
        high: The largest value, or ``None``.
        integer: Whether the value is an int (a bool never is).
        none_ok: Whether ``None`` is allowed (an option that is off by default).
    """

    low: float
    high: float | None = None
    integer: bool = False
    none_ok: bool = False


#: Option name -> its range.
RANGES: Mapping[str, Range] = {
    "target_sparsity": Range(0.0, 1.0),
    "warmup_steps": Range(0, integer=True),
    "ramp_steps": Range(1, integer=True),
    "every_n_steps": Range(1, integer=True),
    "reg_lambda": Range(0.0),
    "group_count_ref": Range(1, integer=True, none_ok=True),
    "distill_alpha": Range(0.0, 1.0),
    "gamma": Range(0.0),
}
