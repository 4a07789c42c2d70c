"""The pruning options, each checked once, where they enter (no Lightning here).

:class:`PruningOptions` (the callback's options) and :class:`StepOptions` (the options of one step without a
Trainer, :func:`~lightning_pat.prune_clusters`) are frozen dataclasses: building one checks every option it holds,
through the checkers below and those of :mod:`lightning_pat.core.checks`, and raises ``ValueError``/``TypeError``
naming the option, what was expected, what was found and the fix. The plan and the pruner take the options as they
are (:func:`~lightning_pat.pruning.plan.make_plan` does not check them again); the callback turns the errors into
``MisconfigurationException`` at its boundary. ``clusters`` becomes declarations in
:mod:`lightning_pat.pruning.declarations`; the Trainer's setup is checked by
:func:`lightning_pat.training.environment.check_environment`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lightning_pat import presets
from lightning_pat.core.checks import check_bool, check_choice, check_option
from lightning_pat.core.choices import (
    ALLOCATIONS,
    SWITCHES,
    TRAINING_SCORES,
    Allocation,
    ExecutorKind,
    ExpertScoreChoice,
    LayerScore,
    Method,
    Mode,
    RampShape,
    Side,
    TeacherStore,
    TrainingAllocation,
    TrainingScore,
    Widths,
)
from lightning_pat.core.schedule import Schedule
from lightning_pat.core.spec import Cluster
from lightning_pat.parallel.comm.ranks import rank_zero_warn
from lightning_pat.pruning.declarations import normalize_clusters
from lightning_pat.sizing.flops import check_flops
from lightning_pat.sizing.targets import check_target

#: Options that may change on resume (they apply from the saved step on); the state key never depends on them.
RESUMABLE: tuple[str, ...] = (
    "target_sparsity", "warmup_steps", "ramp_steps", "every_n_steps", "ramp", "heal", "method", "reg_lambda",
    "score", "mode", "group_count_ref", "layer_score", "expert_score",
)  # fmt: skip
#: Options that shape a frozen mask: they cannot change on a resume after the final ramp step (with healing).
MASK_SHAPING: frozenset[str] = frozenset(
    {"target_sparsity", "method", "score", "reg_lambda", "group_count_ref", "mode", "layer_score", "expert_score"}
)
#: What each size option is, for the message of an entry point that takes a fraction or a size.
_SIZE_GLOSSES: dict[str, str] = {
    "sparsity": "a fraction of each cluster's units",
    "target_params": "a size such as '350M' or 0.5 of the model",
    "target_flops": "FLOPs per token",
}


def check_method(method: object, reg_lambda: object) -> None:
    """``method`` is ``"hard"`` or ``"group_lasso"``, ``reg_lambda`` a number >= 0.

    Raises:
        ValueError: If ``method`` is unknown or ``reg_lambda`` is not a finite number >= 0.
    """
    check_option("method", method)
    check_option("reg_lambda", reg_lambda)


def check_group_count_ref(group_count_ref: object) -> None:
    """``group_count_ref`` is ``None`` or an int >= 1.

    Raises:
        ValueError: If it is anything else (a bool included).
    """
    check_option("group_count_ref", group_count_ref)


def check_size_target(target: SizeTarget) -> None:
    """A size target: ``target_params`` or ``target_flops`` (with ``seq_len``), its side, layers, widths, allocation.

    Raises:
        ValueError: If ``target_allocation`` is unknown, both targets are given, ``target_flops`` and ``seq_len``
            are not given together, or the target, side, layers, widths or ``min_kept`` are malformed (see
            :func:`~lightning_pat.sizing.targets.check_target`).
    """
    check_option("target_allocation", target.target_allocation)
    if target.target_params is not None and target.target_flops is not None:
        raise ValueError(
            "Give `target_params` (parameters) or `target_flops` (FLOPs per token), not both; got "
            f"target_params={target.target_params!r}, target_flops={target.target_flops!r}."
        )
    check_flops(target.target_flops, target.seq_len)
    check_target(
        target.value, target.target_side, target.target_layers, target.target_widths, target.min_kept,
        name=target.option,
    )  # fmt: skip


def check_one_size(who: str, **given: object) -> None:
    """Raise unless exactly one of ``given`` is set: the sizes an entry point takes, in its order, by name.

    With a fraction besides the two size targets (``sparsity``), the message says what each one is.

    Raises:
        ValueError: If none or several are set.
    """
    if sum(value is not None for value in given.values()) == 1:
        return
    names = [f"`{k}`" + (f" ({_SIZE_GLOSSES[k]})" if len(given) > 2 else "") for k in given]
    got = ", ".join(f"{k}={v!r}" for k, v in given.items())
    raise ValueError(f"{who} needs {', '.join(names[:-1])} or {names[-1]}, exactly one of them; got {got}.")


@dataclass(frozen=True)
class SizeTarget:
    """The size-target options as one group (a size instead of a fraction), checked once when it is built.

    The fields are the options of the same names (:class:`PruningOptions` documents each); the callback,
    :func:`~lightning_pat.prune_clusters` and :func:`~lightning_pat.pruning.allocation.size_clusters` keep them as
    flat parameters and build this group, which the code then reads. Without ``target_params`` and
    ``target_flops`` the group is off (:attr:`value` is ``None``).

    Raises:
        ValueError: As :func:`check_size_target`.

    Example::

        >>> SizeTarget(target_flops="2M", seq_len=64).option, SizeTarget().value
        ('target_flops', None)
    """

    target_params: int | float | str | None = None
    target_flops: int | float | str | None = None
    seq_len: int | None = None
    target_side: Side = "below"
    target_layers: int | None = None
    target_widths: Widths = "uniform"
    min_kept: float | None = None
    target_allocation: TrainingAllocation = "auto"

    def __post_init__(self) -> None:
        check_size_target(self)

    @property
    def value(self) -> int | float | str | None:
        """``target_params`` or ``target_flops``, whichever is set (``None``: no size target)."""
        return self.target_params if self.target_flops is None else self.target_flops

    @property
    def option(self) -> str:
        """The size option in use: ``"target_params"`` or ``"target_flops"``."""
        return "target_params" if self.target_flops is None else "target_flops"

    def allocation(self, score: str) -> Allocation:
        """The rule that spreads the target, with ``score`` the score in use (``"auto"`` settled here)."""
        if self.target_allocation in ("importance", "fractions"):
            return "importance" if self.target_allocation == "importance" else "fractions"
        return "importance" if score in ("activation", "taylor") else "fractions"

    def to_dict(self) -> dict[str, Any]:
        """The options by name (:data:`SIZE_OPTIONS`: the ``options`` of a saved ``allocation`` entry)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: The options that define a solved size: a resume after the widths were solved by importance may not change them.
SIZE_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(SizeTarget))


@dataclass(frozen=True)
class Distillation:
    """The distillation options (``distill_*``) as one group, checked once when it is built.

    Each field is the callback's option with the ``distill_`` prefix (:class:`PruningOptions` documents each):
    ``alpha`` is ``distill_alpha``, ``teacher_store`` is ``distill_teacher_store``, and so on. Numbers are stored as
    floats and the directory as a str.

    Raises:
        ValueError, TypeError: As :func:`check_distillation`.

    Example::

        >>> Distillation(alpha=1, temperature=2).on, Distillation().on
        (True, False)
    """

    alpha: float = 0.0
    temperature: float = 1.0
    teacher: Any = field(default=None, repr=False, compare=False)
    module: str = ""
    teacher_store: TeacherStore = "checkpoint"
    teacher_dir: str | None = None

    def __post_init__(self) -> None:
        check_distillation(self)
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.teacher_dir is not None:
            object.__setattr__(self, "teacher_dir", os.fspath(self.teacher_dir))

    @property
    def on(self) -> bool:
        """Whether the ramp and healing distill from a teacher (``alpha > 0``)."""
        return self.alpha > 0


def check_preset_options(preset_options: object) -> None:
    """``preset_options`` is ``None`` or a mapping of preset option names to bools.

    Raises:
        ValueError: If it is not a mapping, a name is unknown or a value is not a bool.
    """
    if preset_options is not None and not isinstance(preset_options, Mapping):
        raise ValueError(
            "`preset_options` must be a mapping of preset option names to bools (e.g. {'residual': True}), got "
            f"{type(preset_options).__name__} {preset_options!r}."
        )
    presets.check_options(preset_options or {})


@dataclass(frozen=True)
class PruningOptions:
    """Every option of a pruning run, checked once at construction.

    The options are those of :class:`~lightning_pat.CoupledPruningCallback` (whose help lists them from here);
    one step without a Trainer (:func:`~lightning_pat.prune_clusters`) takes its subset as :class:`StepOptions`,
    checked by the same checkers.

    Args:
        clusters: Cluster declarations (:class:`~lightning_pat.Cluster` objects or mappings of their fields), a
            preset name (``"llama"``, ``"gpt2"``, ``"linear_chain"``, the demo's ``"tiny_gpt"``, or ``"auto"`` to
            detect the family; a model no preset fits is traced in ``setup`` from its ``example_input_array`` or first
            training batch, see :func:`~lightning_pat.discover`), or a list mixing preset names and declarations.
        target_sparsity: Fraction of each cluster's units removed at the end of the ramp (clusters may override);
            ``None`` (default) means 0.5. With ``target_params`` or ``target_flops`` the size target sets the widths
            and ``target_sparsity`` is unused: a given value warns (as ``prune_clusters`` does with ``sparsity``).
        warmup_steps: Optimizer steps of dense training before pruning starts.
        ramp_steps: Optimizer steps over which the target ramps up to ``target_sparsity``; 1 prunes at once. Keep it
            to about a third of the steps spent pruning or less, so that most of them heal (BENCHMARKS.md).
        every_n_steps: Cadence of fresh selections during the ramp; in between, the current mask is held.
        ramp: Ramp shape, ``"cubic"`` (default) or ``"linear"``.
        heal: After the ramp, freeze the mask and keep dropped units at zero (default). If false, keep
            re-selecting at the final target every ``every_n_steps``.
        method: ``"hard"`` (drop the lowest-scoring units) or ``"group_lasso"`` (during the ramp, the scheduled
            target is a floor: the lowest-scoring units are dropped as with ``"hard"``, and every other unit is
            shrunk by a block soft-threshold of strength ``reg_lambda``, which may zero more; the final step always
            applies the exact target).
        reg_lambda: Group-lasso strength ``lambda``. A unit of norm ``||u||`` over all members is scaled by
            ``max(0, 1 - lambda * gamma * sqrt(G) / ||u||)``. In ``latent`` mode the prox acts on the unshrunk
            latent and ``gamma`` is the sum of learning rates since warmup; in ``direct`` mode it acts on weights
            that earlier steps already shrank and ``gamma`` is the sum of learning rates since the previous fresh
            selection (this step's lr with ``every_n_steps=1``): a proximal gradient step.
        score: Unit score: ``"auto"`` (default): ``"activation"`` wherever it runs, else ``"rms"`` (under FSDP1,
            and for clusters without an ``nn.Linear`` reader, e.g. convolutions); the choice is logged at setup,
            and a resumed run keeps the score its checkpoint was written with. The activation score beat the weight
            score at 75% on two budgets of three (on every seed) and at 50% on two of three in the quality
            benchmark, and never lost (BENCHMARKS.md). ``"rms"``, ``"l2"`` or ``"param_cost"`` (from the weights),
            or ``"activation"`` (Minitron-style: each unit's expected squared contribution to its readers'
            outputs, ``sqrt(sum E[x_j^2] ||W[:, j]||^2)``, from an exponential average (0.9) of the readers' input
            over training batches, averaged over ranks before each selection; readers must be ``nn.Linear``
            weights; its statistics need a training forward through every reader before the first selection; see
            :mod:`lightning_pat.scoring.activation`), or ``"taylor"`` (opt-in: ``|w * g|`` per unit summed
            over the real steps between selections, from the gradients the optimizer applies; see
            :mod:`lightning_pat.scoring.taylor`). Both data-aware scores run on one device, DDP and
            ``ModelParallelStrategy`` (FSDP2/TP: they ride in the sharded path's one gather), not under FSDP1.
        mode: ``"latent"`` (default: the optimizer updates a dense latent copy, the model uses its projection) or
            ``"direct"`` (project the weights themselves; no extra memory).
        executor: ``"auto"`` (sharded path for eligible DTensor clusters, else materializing), ``"materializing"``
            or ``"sharded"``.
        group_count_ref: Opt-in score correction ``sqrt(C / ref)`` for clusters sharing a budget.
        preset_options: Keyword options for a preset (e.g. ``{"residual": True}``).
        log_metrics: Log sparsity through the Trainer's loggers, every ``log_every_n_steps`` optimizer steps and at
            the final ramp step (literal zeros are counted only then).
        debug_check_selection: After every fresh selection, compare a hash of the selection across all ranks and
            raise if they differ (one small collective per selection; off by default).
        shrink_on_freeze: At the final ramp step, once the mask is frozen, physically shrink the LightningModule's
            model in place and slice the optimizer state the same way, so healing runs on the small model (single
            device only; needs ``heal=True``). A checkpoint written afterwards resumes: the fresh module is shrunk
            before its weights load.
        distill_alpha: Distill from the dense model during the ramp and healing (0, the default, is off). The
            student's gradient becomes that of ``loss + distill_alpha * T^2 * KL(teacher || student)`` (softmax of
            the logits at temperature ``T``, mean over tokens), added through a forward hook on the logits: no change
            to ``training_step``; the logged loss stays the user's, the KL is logged as ``pruning/distill_kl`` and
            the teacher's bytes on each rank as ``pruning/teacher_bytes``. Single device, DDP and
            ``ModelParallelStrategy`` (FSDP2, tensor parallel: the copied teacher is sharded like the student; see
            :mod:`lightning_pat.training.distill`); not FSDP1.
        distill_temperature: The softmax temperature ``T`` (> 0).
        distill_teacher: The teacher module (run on the student's inputs, never updated); ``None`` (default) takes
            a frozen copy of the model when pruning starts, saved for resume (see ``distill_teacher_store``). Under
            ``ModelParallelStrategy`` a teacher you pass is called as it is: shard it yourself (``fully_shard`` /
            ``parallelize_module`` in ``configure_model``) or keep a replica on every rank; it is never saved.
        distill_teacher_store: Where the copied teacher is saved for resume. ``"checkpoint"`` (default): in every
            checkpoint written during pruning, next to the model (the checkpoint holds the model twice; under
            ``ModelParallelStrategy`` with distributed checkpoints as shards next to the model's). ``"file"``: once,
            as safetensors (``pat-teacher-<key>.safetensors``, one per rank when sharded), written into the checkpoint
            directory (every ``ModelCheckpoint``'s ``dirpath``, else ``default_root_dir``; or ``distill_teacher_dir``)
            at the first checkpoint save after pruning starts; each checkpoint then holds only the file's name and
            sha256. On resume the file is looked up next to the checkpoint, then in those directories, and checked
            at fit start on every rank (a missing, truncated or modified file is an error, never a wrong teacher).
            Copy the file with the checkpoint; a sharded teacher's files resume only on the same mesh.
        distill_teacher_dir: With ``distill_teacher_store="file"``: the directory the teacher file is written to
            and looked up in (after the checkpoint's own directory); ``None`` (default): the checkpoint directory.
        distill_module: The submodule whose forward returns the logits (a tensor, or an output with ``logits``,
            such as a Hugging Face ``ModelOutput``); ``""`` (default) is the LightningModule itself, whose forward
            ``training_step`` must call (``self(x)``).
        target_params: A size instead of a fraction: an absolute parameter count (``4e9``, ``"4B"``, ``"350M"``) or a
            fraction of the model's parameters (``0.5``, ``"50%"``). At fit start the per-cluster widths that reach it
            are solved (one width per declaration, as a stock config loads; every parameter a unit carries is counted,
            tied weights once; clusters with their own ``target`` keep it; layer units drop whole layers) and the
            ramp goes towards them; ``target_sparsity`` is then unused. The callback's ``size`` reports the achieved
            count and the nearest achievable counts on either side. ``method="hard"`` only.
        target_side: ``"below"`` (default): the closest achievable count not above ``target_params``; ``"above"``:
            the closest not below it.
        target_layers: With layer units (``preset_options={"layers": True}``) and ``target_params``: how many layers
            to keep; the widths make up the rest of the size. By default depth and widths keep the same fraction.
        target_widths: ``"uniform"`` (default: one width per declaration) or ``"ranked"``: the units of a
            declaration's clusters (or of a declared ``budget``) are ranked jointly by score at every selection, so
            layers keep different widths; the solver fixes their total (see docs/size.md). Not with layer units.
        min_kept: With ``target_widths="ranked"``: the fraction of each cluster's units it keeps at least (default
            0.25, rounded up to ``multiple_of``).
        target_flops: Instead of ``target_params``: forward FLOPs per token for sequences of ``seq_len`` tokens
            (``"2M"``, or a fraction of the model's), solved like a parameter count (see
            :mod:`lightning_pat.sizing.flops`).
        seq_len: The sequence length of ``target_flops`` (attention costs grow with it).
        target_allocation: How ``target_params`` / ``target_flops`` is spread over the kinds (MLP channels, heads,
            layers, the residual stream). ``"importance"``: solved at the first selection (the end of warmup) from
            the run's own statistics, reduced over the ranks as for a selection (the activation statistics or the
            Taylor sums; with a weight score, the weights' scores scaled per kind): granules leave in increasing
            cost per parameter removed, as :func:`~lightning_pat.prune_clusters` does (see docs/size.md); a size the
            clusters cannot reach is still refused at fit start, and a resume after the solve keeps its widths.
            ``"fractions"``: solved at fit start, the kind with the highest kept fraction loses a granule first.
            ``"auto"`` (default): ``"importance"`` when the score in use is data-aware (``"activation"``, which
            ``score="auto"`` resolves to wherever it runs, or ``"taylor"``), else ``"fractions"``. The callback's
            ``size`` and the log say which rule was used.
        layer_score: How layer units are ranked: ``"cosine"`` (default): ``1 - cos(input, output)`` of each decoder
            layer over the training forwards since the previous selection, summed over ranks (ShortGPT, ModelOpt;
            see :mod:`lightning_pat.scoring.layers`), the weight score if no layer saw a forward; ``"weight"``: the
            RMS of the layer's output projections.
        expert_score: How whole routed experts (the ``experts.{layer}`` clusters of
            :func:`~lightning_pat.presets.moe`) are ranked, from the training tokens the router sent to each expert
            since the previous selection, summed over ranks (see :mod:`lightning_pat.scoring.experts`):
            ``"reap_sum"`` (default): the router weight times the norm of the expert's output, summed over those
            tokens (REAP's criterion times the expert's token count); ``"reap"``: its mean over them (REAP);
            ``"frequency"``: their number; ``"weight"``: the expert's weight norm, like every other cluster (no
            statistics). Other clusters keep ``score``'s ranking. The default is the score with the best mean
            held-out loss after a one-shot cut to half the experts of a small Mixtral (5 seeds), with and without
            the router's balancing loss, where REAP and frequency each lose clearly in one of the two settings
            (BENCHMARKS.md, "Expert scores"); it was ahead of the weight norm on all 10 seed runs. ``"reap"`` and
            ``"reap_sum"`` recompute the routed tokens' expert outputs in a forward hook (no extra model forward)
            and refuse, at the selection, experts whose weights are DTensors there; use ``"frequency"`` then.

    Raises:
        ValueError: If an option is out of range or unknown, a declaration is invalid, a preset name or preset
            option is unknown, ``method="group_lasso"`` has no ``reg_lambda``, or ``shrink_on_freeze`` is set without
            ``heal``.

    Example::

        >>> opts = PruningOptions(clusters="llama", target_sparsity=0.5, warmup_steps=10, ramp_steps=100)
        >>> opts.schedule.final_step, opts.resumable()["ramp"]
        (110, 'cubic')
    """

    clusters: str | tuple[Cluster | str, ...] = "auto"
    target_sparsity: float | None = None
    warmup_steps: int = 0
    ramp_steps: int = 100
    every_n_steps: int = 1
    ramp: RampShape = "cubic"
    heal: bool = True
    method: Method = "hard"
    reg_lambda: float = 0.0
    score: TrainingScore = "auto"
    mode: Mode = "latent"
    executor: ExecutorKind = "auto"
    group_count_ref: int | None = None
    preset_options: Mapping[str, bool] = field(default_factory=dict)
    log_metrics: bool = True
    debug_check_selection: bool = False
    shrink_on_freeze: bool = False
    target_params: int | float | str | None = None
    target_side: Side = "below"
    target_layers: int | None = None
    target_widths: Widths = "uniform"
    min_kept: float | None = None
    target_flops: int | float | str | None = None
    seq_len: int | None = None
    target_allocation: TrainingAllocation = "auto"
    layer_score: LayerScore = "cosine"
    expert_score: ExpertScoreChoice = "reap_sum"
    distill_alpha: float = 0.0
    distill_temperature: float = 1.0
    distill_teacher: Any = field(default=None, repr=False, compare=False)
    distill_module: str = ""
    distill_teacher_store: TeacherStore = "checkpoint"
    distill_teacher_dir: str | None = None
    schedule: Schedule = field(init=False, repr=False, compare=False)
    #: The size-target options as one group (built from the flat fields above).
    sizing: SizeTarget = field(init=False, repr=False, compare=False)
    #: The ``distill_*`` options as one group (built from the flat fields above).
    distillation: Distillation = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given_sparsity = self.target_sparsity
        object.__setattr__(self, "target_sparsity", 0.5 if given_sparsity is None else given_sparsity)
        check_option("target_sparsity", self.target_sparsity)
        check_method(self.method, self.reg_lambda)
        for switch in SWITCHES:
            check_bool(switch, getattr(self, switch))
        for name in ("score", "mode", "layer_score", "expert_score", "executor"):
            check_option(name, getattr(self, name))
        check_group_count_ref(self.group_count_ref)
        if self.method == "group_lasso" and self.reg_lambda == 0.0:
            raise ValueError(
                "`method='group_lasso'` needs `reg_lambda` > 0 (got 0.0); set a strength such as 1e-3 or use 'hard'."
            )
        check_preset_options(self.preset_options)
        sizing = SizeTarget(**{name: getattr(self, name) for name in SIZE_OPTIONS})
        if given_sparsity is not None and sizing.value is not None:  # one behaviour with prune_clusters
            which = sizing.option
            rank_zero_warn(
                f"CoupledPruningCallback: `target_sparsity={given_sparsity}` is unused: `{which}` sets the widths "
                f"({which}={sizing.value!r}); remove `target_sparsity` (e.g. from the config file) to silence this."
            )
        if sizing.value is not None and self.method == "group_lasso":
            raise ValueError(
                "`target_params` solves exact widths for `method='hard'`; group lasso may zero more units than the "
                "solved widths. Use method='hard' with `target_params`, or `target_sparsity` with group lasso."
            )
        if self.target_sparsity == 1.0:
            rank_zero_warn(
                "CoupledPruningCallback: `target_sparsity=1.0` removes every unit of each cluster without its own "
                "target; the model's output will not depend on those weights at all. Use a value below 1 unless that "
                "is intended."
            )
        clusters = normalize_clusters(self.clusters)
        schedule = Schedule(
            warmup_steps=self.warmup_steps,
            ramp_steps=self.ramp_steps,
            every_n_steps=self.every_n_steps,
            shape=self.ramp,
        )
        if self.shrink_on_freeze and not self.heal:
            raise ValueError(
                "`shrink_on_freeze=True` needs `heal=True`: the mask must be frozen before units can be removed."
            )
        distillation = Distillation(
            alpha=self.distill_alpha, temperature=self.distill_temperature, teacher=self.distill_teacher,
            module=self.distill_module, teacher_store=self.distill_teacher_store, teacher_dir=self.distill_teacher_dir,
        )  # fmt: skip
        object.__setattr__(self, "clusters", clusters)
        object.__setattr__(self, "distill_alpha", distillation.alpha)
        object.__setattr__(self, "distill_temperature", distillation.temperature)
        object.__setattr__(self, "distill_teacher_dir", distillation.teacher_dir)
        assert self.target_sparsity is not None  # filled in with 0.5 above when not given
        object.__setattr__(self, "target_sparsity", float(self.target_sparsity))
        object.__setattr__(self, "reg_lambda", float(self.reg_lambda))
        object.__setattr__(self, "preset_options", dict(self.preset_options or {}))
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "sizing", sizing)
        object.__setattr__(self, "distillation", distillation)

    def resumable(self) -> dict[str, Any]:
        """The options that may change on resume (:data:`RESUMABLE`), by name; they are saved in the state."""
        return {k: getattr(self, k) for k in RESUMABLE}

    def key_names(self) -> str:
        """The state key's ``clusters`` value: the preset name, or the declarations' names joined by commas."""
        if isinstance(self.clusters, str):
            return self.clusters
        return ",".join(c if isinstance(c, str) else c.name for c in self.clusters)


@dataclass(frozen=True)
class StepOptions:
    """The options of one pruning step without a Trainer (:func:`~lightning_pat.prune_clusters`), checked once.

    The same checkers as :class:`PruningOptions` (``sparsity`` is its ``target_sparsity``, without the default);
    ``executor`` is checked where it is used (:func:`~lightning_pat.parallel.executors.route`). See
    :func:`~lightning_pat.prune_clusters` for the meaning of each option.

    Raises:
        ValueError: If an option is out of range or unknown, none or several of ``sparsity``, ``target_params``
            and ``target_flops`` are given (``sparsity`` with a size target warns and is dropped), ``target_flops``
            comes without ``seq_len``, or ``score="taylor"`` (it exists only during training).

    Example::

        >>> StepOptions(sparsity=0.5).method, StepOptions(target_params="1M").sparsity
        ('hard', None)
    """

    sparsity: float | None = None
    target_params: int | float | str | None = None
    target_side: Side = "below"
    target_layers: int | None = None
    target_widths: Widths = "uniform"
    min_kept: float | None = None
    target_flops: int | float | str | None = None
    seq_len: int | None = None
    target_allocation: Allocation = "importance"
    score: TrainingScore = "auto"
    method: Method = "hard"
    reg_lambda: float = 0.0
    gamma: float = 1.0
    group_count_ref: int | None = None
    expert_score: ExpertScoreChoice = "reap_sum"
    #: The size-target options as one group (built from the flat fields above).
    sizing: SizeTarget = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sparsity, target_params, target_flops = self.sparsity, self.target_params, self.target_flops
        if sparsity is not None and (target_params is not None or target_flops is not None):  # as the callback does
            which = "target_params" if target_flops is None else "target_flops"
            rank_zero_warn(
                f"prune_clusters: `sparsity={sparsity}` is unused: `{which}` sets the widths "
                f"({which}={target_params if target_flops is None else target_flops!r}); pass one of them."
            )
            sparsity = None
        check_one_size("prune_clusters", sparsity=sparsity, target_params=target_params, target_flops=target_flops)
        object.__setattr__(self, "sizing", SizeTarget(**{name: getattr(self, name) for name in SIZE_OPTIONS}))
        if sparsity is not None:
            check_option("sparsity", sparsity, rule="target_sparsity")
        check_choice("score", self.score, TRAINING_SCORES)
        check_option("expert_score", self.expert_score)
        check_choice("target_allocation", self.target_allocation, ALLOCATIONS)
        check_method(self.method, self.reg_lambda)
        check_option("gamma", self.gamma)
        check_group_count_ref(self.group_count_ref)
        if self.score == "taylor":
            raise ValueError(
                "score='taylor' sums |w * g| over training steps, so it exists only during training: use it with "
                "CoupledPruningCallback (or lightning_pat.scoring.taylor.TaylorScores with a Pruner in your own "
                "loop); for prune_clusters use a weight score ('rms') or score='activation' with calibrate()."
            )
        object.__setattr__(self, "sparsity", None if sparsity is None else float(sparsity))


def options_doc() -> str:
    """The ``Args:`` section of :class:`PruningOptions`, as written (one entry per option, class-level indentation).

    The callback appends it to its own docstring, so that ``lightning-pat fit --help`` and jsonargparse's
    ``--trainer.callbacks.help`` read each option's help from this one place.
    """
    doc = PruningOptions.__doc__ or ""
    return doc[doc.index("    Args:\n") : doc.index("\n\n    Raises:")]


def check_distillation(options: Distillation) -> None:
    """Check the distillation options (``distill_*``; the group names them without the prefix).

    Raises:
        ValueError: If ``distill_alpha`` is outside ``[0, 1]``, ``distill_temperature`` is not a number > 0, a
            ``distill_teacher`` or ``distill_teacher_store="file"`` is given with ``distill_alpha=0``,
            ``distill_teacher_store`` is unknown, or ``distill_teacher_dir`` is given without the file store.
        TypeError: If ``distill_teacher`` is not a ``torch.nn.Module``, ``distill_module`` is not a string or
            ``distill_teacher_dir`` is not a path.
    """
    check_option("distill_alpha", options.alpha)
    temperature = options.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"`distill_temperature` must be a number > 0 (e.g. 1.0 or 2.0), got {temperature!r}.")
    if not math.isfinite(temperature):  # T^2 * KL would be inf * 0: NaN trained into the weights
        raise ValueError(f"`distill_temperature` must be a finite number > 0 (e.g. 1.0 or 2.0), got {temperature!r}.")
    teacher = options.teacher
    if teacher is not None and not isinstance(teacher, torch.nn.Module):
        raise TypeError(
            f"`distill_teacher` must be a torch.nn.Module (or None for a frozen copy of the model when pruning "
            f"starts), got {type(teacher).__name__}."
        )
    if teacher is not None and options.alpha == 0:
        raise ValueError("`distill_teacher` is set but `distill_alpha` is 0: set `distill_alpha` in (0, 1] to distill.")
    if not isinstance(options.module, str):
        raise TypeError(f"`distill_module` must be a submodule name (str), got {options.module!r}.")
    check_option("distill_teacher_store", options.teacher_store)
    if options.teacher_store == "file" and options.alpha == 0:
        raise ValueError(
            "`distill_teacher_store='file'` is set but `distill_alpha` is 0: set `distill_alpha` in (0, 1] to distill "
            "(the store says where the copied teacher is saved)."
        )
    where = options.teacher_dir
    if where is not None and (isinstance(where, bytes) or not isinstance(where, (str, os.PathLike)) or not str(where)):
        raise TypeError(f"`distill_teacher_dir` must be a directory path (str) or None, got {where!r}.")
    if where is not None and options.teacher_store != "file":
        raise ValueError(
            f"`distill_teacher_dir={str(where)!r}` is set but `distill_teacher_store` is "
            f"{options.teacher_store!r}: the directory is used only with distill_teacher_store='file'."
        )
