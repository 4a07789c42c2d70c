"""The resume side of a run: the saved state out and in, and the start and end of a fit (no Lightning here).

Every function takes the run first: a :class:`~lightning_pat.training.bound.BoundRun` (what
:meth:`~lightning_pat.training.controller.PruningController.bind` built; it carries the options and where messages
go), then its :class:`~lightning_pat.training.progress.Progress` where it needs it, and returns what changed; the
controller keeps the results. A resume reads top to bottom here:

1. :func:`load`: the callback's ``load_state_dict`` keeps the state (the teacher's entry goes to the distiller);
2. before a checkpoint's weights load, a module gets the shapes of a ``shrink_on_freeze``
   (:mod:`lightning_pat.training.shrunk_restore`);
3. :func:`begin_fit` when the fit starts (the controller hands it a :class:`FitStart`): :func:`check_fit_resumes`,
   :func:`restore_teacher`, then :func:`start`: a model already shrunk only continues its step count
   (:func:`shrunk_progress`); else the score is settled, once (:func:`settle_score`: ``score="auto"`` continues a
   loaded state's score; the pruner and the scorers are built with it), then :func:`restore` checks and reads the
   state once (:func:`lightning_pat.training.state.read`, with the run's :func:`read_context`, returns one
   :class:`~lightning_pat.training.state.Restored`), its dropped units checked against the restored weights
   (:func:`check_dropped_are_zero`) and applied (:func:`apply`); a size solved by importance before the checkpoint
   keeps its widths (:func:`reallocated`); else the same Trainer's previous fit, or a new schedule; last
   :func:`warn_short_fit`;
4. :func:`save` at every checkpoint, and with ``gather=False`` at the end of a fit (what the same Trainer's next
   fit continues from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_pat.core.saved_state import DISTILL, saved_score, split_distill
from lightning_pat.core.schedule import Schedule
from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.state_schema import allocation_entry, saved_clusters
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.scoring.experts import expert_modules
from lightning_pat.sizing.problem import SizeSolution
from lightning_pat.training import state, teacher_file
from lightning_pat.training.bound import BoundRun, choice_message
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.distill import Distiller
from lightning_pat.training.errors import WHO, ConfigurationError, prefixed
from lightning_pat.training.progress import Progress
from lightning_pat.training.score_choice import resolve_score


# ---------------------------------------------------------------------------------------------------- state in
def load(saved: object, distiller: Distiller | None) -> dict[str, Any]:
    """The state to keep until the fit starts; the teacher's entry goes to ``distiller`` now.

    Raises:
        ConfigurationError: If ``saved`` is not a mapping.
    """
    if not isinstance(saved, Mapping):
        raise ConfigurationError(
            f"{state.WHAT} must be a mapping, got {type(saved).__name__}; the checkpoint was edited or is not one "
            "of lightning_pat's."
        )
    pending, distill = split_distill(saved)
    if distiller is not None:
        distiller.load_state_dict(distill or {})
    return pending


# ---------------------------------------------------------------------------------------------------- fit start
@dataclass(frozen=True)
class FitStart:
    """What a fit starts from, as the controller kept it (see :func:`begin_fit`).

    Attributes:
        restored: A state loaded from a checkpoint (:func:`load`), if any.
        carried: The in-memory state the same process's previous fit kept (:func:`save` with ``gather=False``).
        carry: Whether this fit continues ``carried`` (the same Trainer, at the step its previous fit ended).
        shrunk: Whether the model was shrunk (by an earlier fit, or to a checkpoint's shapes): only steps count.
        global_step: The trainer's optimizer steps so far (``None``: not known); a loaded ``step`` may not exceed it.
        ckpt_path: The checkpoint ``restored`` came from (a distributed checkpoint's latents are read there).
    """

    restored: Mapping[str, Any] | None = None
    carried: Mapping[str, Any] | None = None
    carry: bool = False
    shrunk: bool = False
    global_step: int | None = None
    ckpt_path: Any = None


def begin_fit(
    run: BoundRun,
    progress: Progress,
    fit: FitStart,
    *,
    distiller: Distiller | None,
    key: str,
    steps_left: float,
    teacher_dirs: Sequence[str] = (),
) -> tuple[BoundRun, Progress]:
    """A fit starts (the callback's ``on_train_start``, after a restore under every strategy), top to bottom.

    1. :func:`check_fit_resumes`: a fit that resumes needs a loaded state or the same Trainer's previous fit;
    2. :func:`restore_teacher` (with distillation): a new teacher, or the saved one checked on every rank;
    3. :func:`start`: the score settled and the pruner built, then the loaded state, the previous fit's, or step 0;
    4. :func:`warn_short_fit`: a fit that ends before the final ramp step is said so.

    Args:
        run: The bound run.
        progress: The run's progress so far.
        fit: What the fit starts from.
        distiller: The distiller, with distillation.
        key: This run's state key in a checkpoint (for the message of :func:`check_fit_resumes`).
        steps_left: The fit's estimated optimizer steps (``inf`` if unknown).
        teacher_dirs: Where the teacher file (``distill_teacher_store="file"``) is written, and where a restored
            state's teacher file is looked up after the directory of ``ckpt_path``.

    Returns:
        The run with its score settled, and its progress.

    Raises:
        ConfigurationError: As for :func:`check_fit_resumes`.
        ValueError: On every rank, as for :func:`restore_teacher` and :func:`start`.
    """
    check_fit_resumes(fit, key=key)
    if distiller is not None:
        fresh = fit.restored is None and not fit.carry
        restore_teacher(distiller, run.options, fit, fresh=fresh, dirs=teacher_dirs)
    run, progress = start(run, progress, fit)
    if not fit.shrunk:
        warn_short_fit(run.options.schedule, step=progress.step, steps_left=steps_left - (fit.global_step or 0))
    return run, progress


def check_fit_resumes(fit: FitStart, *, key: str) -> None:
    """A fit that resumes (``global_step > 0``) needs a loaded state or the same Trainer's previous fit.

    Raises:
        ConfigurationError: If neither is there (and the model was not shrunk).
    """
    global_step = fit.global_step or 0
    if fit.restored is None and not fit.carry and global_step > 0 and not fit.shrunk:
        raise ConfigurationError(
            f"{WHO}: the fit resumes at global step {global_step} from {fit.ckpt_path!r}, which "
            f"holds no state under this callback's key {key!r} (the cluster declaration names identify it). "
            "Resume with the same cluster names, or, to start pruning from trained weights, load them into the "
            "module and fit with a fresh Trainer without `ckpt_path`."
        )


def restore_teacher(
    distiller: Distiller, options: PruningOptions, fit: FitStart, *, fresh: bool, dirs: Sequence[str]
) -> None:
    """At fit start, on every rank: a new teacher for a new schedule, the teacher file's directories, a saved teacher.

    A restored teacher file is read and checked after the directory of ``fit.ckpt_path``, then ``dirs``. One
    agreement collective each: if one rank fails, every rank raises.

    Raises:
        ValueError: If the teacher file's directories cannot hold it, a restored teacher does not fit the model, or
            a restored teacher file cannot be read or checked.
    """
    if fresh:
        distiller.reset()  # a new schedule: a new teacher when pruning starts
    with ranks.together(WHO):
        if options.distillation.teacher_store == "file" and options.distillation.teacher is None:
            teacher_file.check_directories(dirs)
        distiller.check_saved()
    if fit.restored is None or not teacher_file.is_file_entry(distiller.saved):
        return
    where = [] if fit.ckpt_path is None else [str(Path(fit.ckpt_path).parent)]
    with ranks.together(WHO):
        distiller.restore_file(directories=[*where, *dirs])


def start(run: BoundRun, progress: Progress, fit: FitStart) -> tuple[BoundRun, Progress]:
    """Where the schedule stands: the score settled, then a loaded state, the previous fit's, or a new schedule.

    A shrunk model only continues its step count (:func:`shrunk_progress`). Otherwise the score is settled once per
    bind (:func:`settle_score`), then a loaded state continues (:func:`restore`), else the previous fit's state
    when ``fit.carry`` (this process's own: nothing to check), else a new schedule starts at step 0.

    Returns:
        The run and its progress. The scorers' hooks are attached unless the mask is frozen.

    Raises:
        ValueError: As for :func:`settle_score` and :func:`restore`; if the mask is empty after the final ramp step
            although the target requires dropped units (:func:`check_mask_not_empty`).
    """
    if fit.shrunk:
        return run, shrunk_progress(fit) or progress
    if run.pruner is None:
        run = settle_score(run, saved_score(fit.restored))
    if fit.restored is not None:
        run, progress = restore(run, fit.restored, fit)
    elif fit.carry and fit.carried is not None:
        run = reallocated(run, fit.carried)
        progress = apply(run, state.Restored.carried(fit.carried))
    else:
        if fit.carried is not None:
            run.info(f"{WHO}: a fresh Trainer starts a new pruning schedule at step 0.")
        run.collectors.reset()
        progress = Progress()
    if run.options.schedule.frozen(progress.step, heal=run.options.heal):
        check_mask_not_empty(run, progress)
    else:
        run.collectors.attach()  # removed at the freeze and at the end of the fit
    return run, progress


def shrunk_progress(fit: FitStart) -> Progress | None:
    """A shrunk model's progress at fit start (only the step count goes on): a loaded state's, else the previous fit's.

    Returns:
        The progress to continue, or ``None`` when there is neither state (the progress stands).

    Raises:
        ValueError: If the loaded state does not fit the schema (see :func:`lightning_pat.training.state.check_saved`).
    """
    if fit.restored is not None:
        return state.read_progress(fit.restored, global_step=fit.global_step)
    return None if fit.carried is None else Progress.from_state(fit.carried)


def settle_score(run: BoundRun, saved: str | None) -> BoundRun:
    """The score, settled once, now that a restored state is known under every strategy; the pruner built with it.

    ``score="auto"`` continues the score a loaded state was written with (``saved``) where it runs
    (:func:`~lightning_pat.training.score_choice.resolve_score`); the size target's rule and ``"auto"``'s score are
    logged.

    Raises:
        ConfigurationError: As for :meth:`~lightning_pat.training.bound.BoundRun.scored`.
    """
    choice = resolve_score(
        run.options, module=run.module, clusters=run.clusters, fsdp1=run.fsdp1_root is not None, saved=saved
    )
    run = run.scored(choice)
    for line in choice_message(run):
        run.info(line)
    return run


def restore(run: BoundRun, saved: Mapping[str, Any], fit: FitStart) -> tuple[BoundRun, Progress]:
    """Continue a loaded state: its checks, its mask, latents and statistics (the score is settled).

    Returns:
        The run (with the saved targets of a size solved by importance) and the restored progress.

    Raises:
        ValueError: On every rank, before anything of it is applied, if the state does not fit its schema or this
            run, its dropped units are not zero in the restored weights, or it cannot be continued exactly.
    """
    run = reallocated(run, saved)
    restored = state.read(
        saved, read_context(run, global_step=fit.global_step), fit.ckpt_path,
        before_latents=lambda dropped: check_dropped_are_zero(run, dropped),
    )  # fmt: skip
    return run, apply(run, restored)


def read_context(run: BoundRun, *, global_step: int | None) -> state.ReadContext:
    """What a loaded state is checked against and read with (:class:`~lightning_pat.training.state.ReadContext`)."""
    assert run.latents is not None
    checks = state.restore_context(
        global_step=global_step, clusters=run.clusters, params=run.params, latent_names=run.latents.names,
        entries=run.collectors.checks(),
    )  # fmt: skip
    options = run.options
    return state.ReadContext(
        checks, run.params, resumable(options, run), options.schedule, options.mode == "latent", options.heal
    )


def reallocated(run: BoundRun, saved: Mapping[str, Any]) -> BoundRun:
    """A state whose size was solved by importance: the run takes its widths (a resume never solves them again).

    Solving again would change the widths in the middle of a run; a state saved before the solve has no
    ``allocation`` entry, and its run solves at its first selection. The clusters' fingerprints are then checked
    against the state as usual (:func:`restore`), so that any other change of the clusters is still refused.

    Returns:
        ``run``, or the run with the saved clusters' targets and solution.

    Raises:
        ValueError: If the entry or the saved clusters do not fit the schema, or an option that defines the size
            (:data:`~lightning_pat.pruning.options.SIZE_OPTIONS`) changed since the solve.
    """
    entry = allocation_entry(saved, what=state.WHAT)
    if entry is None:
        return run
    step, then, now = entry["step"], dict(entry["options"]), run.options.sizing.to_dict()
    changed = {k: (then.get(k), v) for k, v in now.items() if then.get(k) != v}
    if changed or run.basis is None or run.plan is None:
        desc = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()) or "no size target now"
        raise ConfigurationError(
            f"{WHO}: the checkpoint's widths were solved by importance at step {step} for "
            f"{ {k: then.get(k) for k in changed} or then }; the changed options ({desc}) would solve them again and "
            "change the widths in the middle of the run. Resume with the saved options, or start a new run (a fresh "
            "Trainer) to prune to another size."
        )
    targets = {rc.name: rc.target for rc in saved_clusters(saved, what=state.WHAT)}
    current = {rc.name: targets.get(rc.name, rc.target) for rc in run.plan.clusters}  # another cluster: refused later
    run = run.retargeted(current, SizeSolution.from_dict(entry["size"]), solved_at=step)
    assert run.size is not None
    run.info(
        f"{WHO} {run.options.sizing.option}: {run.size.describe()}; solved at step {step} (the first "
        "selection), kept on resume."
    )
    return run


def check_dropped_are_zero(run: BoundRun, dropped: Mapping[str, Sequence[int]]) -> None:
    """A restored mask must be the one the restored weights carry: its dropped units exactly zero.

    One reduction of the unit norms (the executors' own, identical on every rank), so every rank raises together.

    Raises:
        ValueError: Naming the clusters whose dropped units are not zero in the weights.
    """
    assert run.pruner is not None
    with torch.no_grad(), run.weights():
        norms = run.pruner.unit_sq_norms()
    bad = {}
    for name, units in dropped.items():
        if name in norms and units:
            live = [u for u, v in zip(units, norms[name][list(units)].tolist(), strict=True) if v != 0.0]
            if live:
                bad[name] = live
    if bad:
        shown = "; ".join(f"cluster {n!r} (units {u[:8]})" for n, u in list(bad.items())[:5])
        raise ValueError(
            f"{state.WHAT}: the dropped units of {shown} are not zero in the weights restored from the checkpoint, "
            "so the mask does not belong to these weights (the checkpoint was edited, or its weights come from "
            "another run). Resume from an unedited checkpoint of this run, or start a new run."
        )


def apply(run: BoundRun, restored: state.Restored) -> Progress:
    """Set the mask, latents and statistics of ``restored`` and project the weights; return its progress."""
    assert run.pruner is not None
    assert run.latents is not None
    run.pruner.load_dropped(restored.dropped, restored.factors)
    if restored.latents is None:
        run.latents.clear()
    else:
        run.latents.load_state_dict(restored.latents)
    run.collectors.load(restored.state, errors=prefixed)  # none saved (e.g. the score changed on resume): from here
    with torch.no_grad(), run.weights():
        run.pruner.hold()
    return restored.progress


def check_mask_not_empty(run: BoundRun, progress: Progress) -> None:
    """Never heal with an empty mask where the final target requires dropped units (call it once frozen).

    Raises:
        ValueError: Naming the clusters without dropped units.
    """
    assert run.plan is not None
    assert run.pruner is not None
    step = progress.step
    assert run.options.target_sparsity is not None  # PruningOptions sets it (0.5 when a size target is given)
    targets = run.plan.targets(run.options.target_sparsity)
    dropped = run.pruner.result().dropped
    empty = [
        rc.name for rc in run.plan.clusters if not dropped[rc.name] and num_to_drop(targets[rc.name], rc.num_units)
    ]
    if empty:
        raise ValueError(
            f"{WHO}: at step {step} (after the final ramp step) clusters "
            f"{empty[:5]} have no dropped units although the target requires some; refusing to heal with an empty "
            "mask. Resume from a checkpoint of this run, or start a new run with a fresh Trainer."
        )


def warn_short_fit(schedule: Schedule, *, step: int, steps_left: float) -> None:
    """Warn when a fit of ``steps_left`` more steps ends before the final ramp step (the target is never met)."""
    if steps_left == float("inf"):
        return
    end = step + int(steps_left)
    if end < schedule.final_step:
        ranks.rank_zero_warn(
            f"{WHO}: this fit ends after optimizer step {end}, before the final ramp step "
            f"{schedule.final_step} (warmup {schedule.warmup_steps} + ramp {schedule.ramp_steps}); the mask will "
            f"only reach {schedule.fraction(end):.0%} of the target and is not frozen. Raise max_steps/max_epochs "
            "or shorten the schedule."
        )


# ---------------------------------------------------------------------------------------------------- state out
def resumable(options: PruningOptions, run: BoundRun | None) -> dict[str, Any]:
    """The options saved with the state, with the score in use (``"auto"`` resolved).

    ``expert_score`` only where the run has whole routed experts: a model without them saves what it saved before.
    """
    saved = {**options.resumable(), "score": options.score if run is None or run.score is None else run.score.score}
    if run is None or not expert_modules(run.module, run.clusters):
        saved.pop("expert_score", None)
    return saved


def save(
    run: BoundRun | None,
    *,
    progress: Progress,
    options: PruningOptions,
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, list[int]],
    shrunk: bool,
    distiller: Distiller | None = None,
    gather: bool = True,
) -> dict[str, Any]:
    """The state (see :mod:`lightning_pat.training.state`); with ``gather`` a collective, else this rank's own.

    Args:
        run: The bound run (``None`` before :meth:`bind`).
        progress: The run's progress.
        options: The run's options.
        clusters: The resolved clusters.
        dropped: The current mask.
        shrunk: Whether the model was shrunk.
        distiller: The distiller, whose state goes under ``"distill"``.
        gather: A checkpoint's state: FSDP1 latents, full DTensor latents and every rank's statistics are
            gathered (every rank must call it). Else what the same process's next fit continues from: the latents
            as they are, this rank's own statistics, no collective.
    """
    latents, scorers = None, Collectors()
    if run is not None:
        if run.latents is not None and run.latents.active:
            fmt = run.latent_format() if gather else "local"
            latents = state.latent_entry(run.latents.state_dict(), run.params, fmt=fmt)
        scorers = run.collectors
    pruner = None if run is None else run.pruner
    allocation = None
    if run is not None and run.solved_at is not None and run.size is not None:
        allocation = {
            "rule": "importance", "step": run.solved_at, "options": options.sizing.to_dict(), "size": run.size.to_dict()
        }  # fmt: skip
    saved = state.build(
        progress,
        dropped=dropped,
        factors={} if pruner is None else pruner.factors(),
        clusters=clusters,
        options=resumable(options, run),
        latents=latents,
        shrunk=shrunk,
        allocation=allocation,
        collectors=scorers,
        gather=gather,
    )
    if distiller is not None:
        saved[DISTILL] = distiller.state_dict()
    return saved


def sharded_entries(run: BoundRun | None, distiller: Distiller | None) -> dict[str, Tensor]:
    """For a distributed checkpoint: the latents and a sharded teacher as model-state entries, else ``{}``."""
    entries = {} if distiller is None else distiller.sharded_state()
    if run is None or run.latents is None or not run.latents.active or run.latent_format() != "dcp":
        return entries
    return {**state.sharded_latents(run.latents.state_dict(), run.params), **entries}
