"""The training controller: what happens to the weights around each real optimizer step (no Lightning here).

:class:`PruningController` owns the progress counters, the real-step tracker
(:class:`~lightning_pat.training.tracker.StepTracker`), the bound run (:class:`~lightning_pat.training.bound.BoundRun`:
the latent copies, the pruner, the data-aware scorers), the mask's freeze and shrink, and with ``distill_alpha > 0``
the :class:`~lightning_pat.training.distill.Distiller`. A training loop (the callback, or any loop of your own) calls
:meth:`~PruningController.bind` once the model and optimizers are final (resolve, agree across ranks, route; nothing
is mutated), :meth:`~PruningController.start` before the first step, :meth:`~PruningController.after_backward`
between the backward and the update, :meth:`~PruningController.after_step` after the batch (it returns the result to
log), and :meth:`~PruningController.state_dict` / :meth:`~PruningController.load_state_dict`. Around them, for a
trainer with fit-level events (the callback): :meth:`~PruningController.begin_fit`,
:meth:`~PruningController.before_batch` (re-project after weight averaging; open the distillation window),
:meth:`~PruningController.end_fit`, :meth:`~PruningController.reproject_after_averaging` and
:meth:`~PruningController.before_restore` (a checkpoint of a shrunk model).

The controller holds what changes from fit to fit and step to step and decides when to act; the work is done by
functions on the bound run: :mod:`lightning_pat.training.per_step` (after the backward, after a step: select, hold,
freeze, ``shrink_on_freeze``) and :mod:`lightning_pat.training.resume` (the fit lifecycle and the saved state).
Errors are ``ValueError`` naming the option or cluster; the callback turns them into ``MisconfigurationException``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.saved_state import saved_score
from lightning_pat.core.spec import Cluster, ResolvedCluster
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.declarations import declarations_for
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.pruner import PruneResult
from lightning_pat.training import per_step, resume, state
from lightning_pat.training.bound import (
    BoundRun,
    ConfigurationError,
    RunViews,
    ScoreChoice,
    bind_run,
    early_declarations,
)
from lightning_pat.training.distill import Distiller
from lightning_pat.training.tracker import StepTracker

log = logging.getLogger(__name__)


class PruningController(RunViews):
    """Coupled pruning around a training loop's optimizer steps (see the module docstring).

    Args:
        options: The run's options.
        info: Where informational messages go (the routes, the shrink, a new schedule), on rank zero; by default
            this module's logger. The callback passes Lightning's ``rank_zero_info`` so that they show in the console.
        forward_error: The exception type of errors raised inside the model's forward (the distillation hook), where
            no caller can convert them; the callback passes ``MisconfigurationException``.

    Example::

        >>> import torch.nn as nn
        >>> from lightning_pat import Cluster
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> opts = PruningOptions([Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])],
        ...                       target_sparsity=0.5, ramp_steps=1, mode="direct")
        >>> opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
        >>> ctl = PruningController(opts)
        >>> ctl.bind(mlp, optimizers=[opt])
        >>> ctl.start()
        >>> mlp(torch.ones(2, 4)).sum().backward()
        >>> ctl.after_backward(opt)
        >>> opt.step()
        >>> len(ctl.after_step(count=True).dropped["h"]), ctl.frozen
        (4, True)
    """

    def __init__(
        self,
        options: PruningOptions,
        *,
        info: Callable[[str], None] | None = None,
        forward_error: type[Exception] = ConfigurationError,
    ) -> None:
        self.options = options
        self._info = info or (lambda message: ranks.rank_zero_info(message, logger=log))
        self.schedule = options.schedule
        self.progress = state.Progress()
        self.tracker = StepTracker()
        self.run: BoundRun | None = None  # what bind built (see lightning_pat.training.bound)
        self.resolved: list[ResolvedCluster] = []
        self.shrunk: dict[str, list[int]] | None = None  # the dropped units, once the model has been shrunk
        self._carry: dict[str, Any] | None = None  # in-memory state kept for the next fit (see finish_fit)
        self._pending: dict[str, Any] | None = None  # a loaded state, applied by the next start()
        self._early: list[Cluster] | ValueError | None = None  # clusters="auto" traced before sharding (see prepare)
        self.distiller: Distiller | None = None
        if options.distill:
            self.distiller = Distiller(
                alpha=options.distill_alpha, temperature=options.distill_temperature, teacher=options.distill_teacher,
                error=forward_error, store=options.distill_teacher_store,
            )  # fmt: skip
        self.kl: Tensor | None = None  # the last batch's distillation KL (see after_step)
        self._averaged = False  # a weight-averaging callback may write averaged weights into dropped units
        self._last_fit: tuple[Any, int] | None = None  # (weakref to the trainer, its step) at the last end_fit

    # ------------------------------------------------------------------ views
    @property
    def frozen(self) -> bool:
        """Whether the mask is frozen (healing) at the current step."""
        return self.schedule.frozen(self.progress.step, heal=self.options.heal)

    @property
    def dropped(self) -> dict[str, list[int]]:
        """Cluster name -> sorted dropped unit indices of the current mask."""
        if self.shrunk is not None:
            return dict(self.shrunk)
        return {} if self.pruner is None else self.pruner.result().dropped

    @property
    def teacher(self) -> nn.Module | None:
        """The distillation teacher (``None`` without distillation, or before pruning starts with a copied one)."""
        return None if self.distiller is None else self.distiller.teacher

    # ------------------------------------------------------------------ build
    def prepare(
        self, module: nn.Module, batch_input: Callable[[], Any] | None, *, weight_averaging: bool = False
    ) -> None:
        """Discover ``clusters="auto"`` by tracing now, before ``configure_model`` shards the model (or forget it).

        Under torch.distributed only global rank 0 traces; every other rank receives its outcome (the declarations, an
        error, or nothing) and :meth:`bind` still compares the resolved clusters across ranks. A discovery error is
        kept and raised by :meth:`bind`, where every rank raises together.

        Args:
            module: The model, not sharded yet.
            batch_input: Returns the first training batch's inputs (used without an ``example_input_array``);
                ``None`` outside ``fit`` (nothing is discovered).
            weight_averaging: Whether a weight-averaging callback (``StochasticWeightAveraging``) runs too: the mask
                is then re-applied after its weight transfers (:meth:`before_batch`,
                :meth:`reproject_after_averaging`).
        """
        self._averaged = weight_averaging
        self._early = None if batch_input is None else early_declarations(self.options, module, batch_input)

    def _declarations(self, module: nn.Module) -> list[Cluster]:
        if isinstance(self._early, ValueError):  # discovery failed in setup: every rank raises it in bind
            raise self._early
        return self._early or declarations_for(module, self.options.clusters, self.options.preset_options)

    def bind(
        self,
        module: nn.Module,
        *,
        optimizers: Sequence[torch.optim.Optimizer],
        fsdp1_root: nn.Module | None = None,
        sharded_ckpt: bool = False,
        accumulate: int = 1,
    ) -> None:
        """Resolve the clusters against ``module``'s final (possibly sharded) parameters, agree, build executors.

        Nothing is mutated. Resolution and routing use global metadata only; their outcome (or a rank's error) is
        compared across ranks in one collective, so a rank with a different declaration or model makes every rank
        raise the same error instead of hanging in a later collective.

        Args:
            module: The model (under FSDP1, the LightningModule inside ``fsdp1_root``).
            optimizers: The optimizers whose steps count.
            fsdp1_root: The FSDP1-wrapped root module, if any (parameters are summoned whole around each action).
            sharded_ckpt: Whether checkpoints are distributed checkpoints (latents of DTensors are then written
                next to the model's shards).
            accumulate: Micro-batches per optimizer step (the distillation gradient is divided by it, as the loss).

        Raises:
            ValueError: If the clusters do not resolve or route on some rank (or ``clusters="auto"`` could not be
                discovered, see :meth:`prepare`), a target below 1 would drop every unit of a cluster, or ranks
                disagree; if ``score="activation"`` readers are not ``nn.Linear`` weights; if ``shrink_on_freeze``
                could not shrink the model.
            Exception: ``forward_error`` if ``distill_module`` names no submodule.
        """
        self.tracker.attach(optimizers)
        if self.shrunk is not None:  # the model was shrunk: nothing is left to prune, only steps to count
            kept = self.run.score if self.run is not None else ScoreChoice(self.options.score)
            params = dict(module.named_parameters(remove_duplicate=False))
            self.run = BoundRun(module, list(optimizers), params, fsdp1_root, sharded_ckpt, score=kept)
        else:
            self.run = bind_run(
                module, options=self.options, optimizers=optimizers, declarations=self._declarations,
                fsdp1_root=fsdp1_root, sharded_ckpt=sharded_ckpt, saved_score=saved_score(self._pending),
                info=self._info,
            )  # fmt: skip
            self.resolved = list(self.run.clusters)
        if self.distiller is not None:
            self.distiller.bind(module, self.options.distill_module, accumulate=accumulate, sharded_ckpt=sharded_ckpt)

    def _bound(self) -> BoundRun:
        assert self.run is not None, "bind() first"
        return self.run

    # ------------------------------------------------------------------ start and end of a fit (resume.py)
    @property
    def restoring(self) -> bool:
        """Whether a loaded state waits for :meth:`start`."""
        return self._pending is not None

    def begin_fit(
        self,
        *,
        owner: object,
        global_step: int,
        steps_left: float,
        ckpt_path: Any,
        key: str,
        teacher_dirs: Sequence[str] = (),
    ) -> None:
        """A fit starts: continue a restored state, ``owner``'s previous fit, or start a new schedule at step 0.

        ``owner``'s previous fit is continued if it ended (:meth:`end_fit`) at ``global_step``; a fit with a fresh
        trainer starts a new schedule (and, with distillation, takes a new teacher when pruning starts).

        Args:
            owner: The trainer (held by a weak reference).
            global_step: The trainer's optimizer steps so far (above 0 on a resume).
            steps_left: The fit's estimated optimizer steps (``inf`` if unknown), for :meth:`warn_short_fit`.
            ckpt_path: The checkpoint the fit resumes from, if any.
            key: This run's state key in a checkpoint (for the message).
            teacher_dirs: Where the teacher file (``distill_teacher_store="file"``) is written, and where a restored
                state's teacher file is looked up after the directory of ``ckpt_path``; checked at fit start.

        Raises:
            ConfigurationError: If the fit resumes (``global_step > 0``) but no state was loaded and there is no
                previous fit of ``owner`` to continue.
            ValueError: As for :meth:`start`; on every rank, as for
                :func:`~lightning_pat.training.resume.restore_teacher`.
        """
        last = self._last_fit
        carry = last is not None and last[0]() is owner and last[1] == global_step
        resume.check_fit_resumes(
            restoring=self.restoring, carry=carry, shrunk=self.shrunk is not None, global_step=global_step,
            ckpt_path=ckpt_path, key=key,
        )  # fmt: skip
        if self.distiller is not None:
            resume.restore_teacher(
                self.distiller, self.options, fresh=not self.restoring and not carry, restoring=self.restoring,
                ckpt_path=ckpt_path, dirs=teacher_dirs,
            )  # fmt: skip
        self.start(carry=carry, ckpt_path=ckpt_path, global_step=global_step)
        if self.shrunk is None:
            self.warn_short_fit(steps_left - global_step)

    def start(self, *, carry: bool = False, ckpt_path: Any = None, global_step: int | None = None) -> None:
        """Decide where the schedule stands and project the weights accordingly.

        A state given to :meth:`load_state_dict` continues; else, with ``carry``, the in-memory state of the previous
        fit (the same Trainer's next ``fit``); else a new schedule starts at step 0.

        Args:
            carry: Continue the in-memory state of the previous fit, if there is one.
            ckpt_path: The checkpoint the loaded state came from (a distributed checkpoint's latents are read there).
            global_step: The trainer's optimizer steps so far: a loaded state's ``step`` may not exceed it.

        Raises:
            ValueError: On every rank, before anything of it is applied, if the loaded state does not fit its schema
                (:mod:`lightning_pat.core.state_schema`) or this run, or cannot be continued exactly; if the mask
                is empty after the final ramp step although the target requires dropped units (see
                :func:`~lightning_pat.training.resume.start`).
        """
        restored, self._pending = self._pending, None
        carried, self._carry = self._carry, None
        if self.shrunk is not None:  # shrunk (before the restore, or by an earlier fit): count steps
            self.progress = resume.shrunk_progress(restored, carried, global_step=global_step) or self.progress
            return
        self.run, self.progress = resume.start(
            self._bound(), restored=restored, carried=carried if carry else None, dropped_carry=carried is not None,
            options=self.options, ckpt_path=ckpt_path, global_step=global_step, info=self._info,
        )  # fmt: skip
        self.resolved = list(self.run.clusters)  # a size solved by importance before: the saved targets

    def warn_short_fit(self, steps_left: float) -> None:
        """Warn when a fit of ``steps_left`` more steps ends before the final ramp step (the target is never met)."""
        resume.warn_short_fit(self.schedule, step=self.progress.step, steps_left=steps_left)

    def end_fit(self, *, owner: object, global_step: int) -> None:
        """A fit of ``owner`` ended at ``global_step``: keep what its next fit continues from (:meth:`finish_fit`)."""
        self._last_fit = (weakref.ref(owner), global_step)
        self.finish_fit()

    def finish_fit(self) -> None:
        """Keep what a next :meth:`start` with ``carry=True`` continues from (this rank's own; no collective)."""
        self.release()
        if self.shrunk is not None:
            self._carry = self.progress.state_dict()  # only the step count goes on
            return
        assert self.pruner is not None
        self._carry = self._save(gather=False)  # this rank's own statistics: each rank reads its own

    def release(self) -> None:
        """Remove the optimizer, scorer and distillation hooks (the state for a next fit is kept)."""
        self.tracker.detach()
        self.scorers.detach()
        if self.distiller is not None:
            self.distiller.release()

    def before_batch(self, *, first_of_epoch: bool, share: tuple[Any, ...] = (), ckpt_path: Any = None) -> None:
        """Before a training batch: re-project after weight averaging; build the teacher and open its window.

        ``StochasticWeightAveraging`` copies its averaged weights (dropped units included) into the model at the start
        of its BatchNorm-update epoch; re-projecting before that epoch's first forward keeps the statistics exact.

        Args:
            first_of_epoch: Whether this is the epoch's first batch.
            share: Objects a copied teacher shares with the student instead of copying (the trainer).
            ckpt_path: The checkpoint this fit resumed from (a sharded teacher's shards are read from it).

        Raises:
            Exception: ``forward_error`` if pruning started before this fit and no teacher state was restored.
        """
        if self._averaged and first_of_epoch:
            self.reproject()
        self.scorers.batch_open(True)
        if self.distiller is not None:
            self.distiller.ensure_teacher(
                step=self.progress.step, start=self.schedule.warmup_steps, share=share, ckpt_path=ckpt_path
            )
            self.distiller.open()

    def reproject_after_averaging(self) -> None:
        """With weight averaging: zero the dropped units again after its final weight transfer."""
        if self._averaged:
            self.reproject()

    # ------------------------------------------------------------------ per step (per_step.py)
    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """After the backward, before ``optimizer`` updates: swap latents in (ramp) or zero dropped grads (healing).

        Raises:
            Exception: ``forward_error`` if distillation is on and the logits module's forward did not run.
        """
        if self.distiller is not None:
            self.distiller.check_ran()
        if self.pruner is None or self.latents is None:
            return
        action = self.schedule.action(self.progress.step + 1, heal=self.options.heal)
        per_step.after_backward(self._bound(), optimizer, action=action)

    def after_step(self, *, count: bool | Callable[[int], bool] = False) -> PruneResult | None:
        """After a batch: if a real optimizer step happened, advance the schedule and act.

        Args:
            count: Whether to return a result with literal-zero counts (which may communicate): a bool, or a
                function of the new step. Nothing is returned without it.

        Returns:
            The current mask with its literal-zero counts, when counted; else ``None``. With distillation, the
            batch's KL is in :attr:`kl` (``None`` if nothing was distilled).

        Raises:
            ConfigurationError: If ``score="activation"`` statistics cannot score the clusters, or the model cannot
                be shrunk at the freeze (``shrink_on_freeze``).
            ValueError: If a score is not finite (see :func:`~lightning_pat.core.selection.check_finite`).
        """
        self.kl = None if self.distiller is None else self.distiller.close()
        stepped = self.tracker.consume()
        self.scorers.end_batch(stepped=stepped)  # only a real step's gradient counts (not an AMP-skipped one)
        if self.shrunk is not None:  # healing on the shrunk model: the dropped units no longer exist
            if stepped:
                self.progress.tick()
                self.progress.add_lr(self.tracker.last_lr)
            return None
        if self.pruner is None or self.latents is None:
            return None
        result, run = per_step.after_step(
            self._bound(), self.progress, stepped=stepped, lr=self.tracker.last_lr, options=self.options, count=count,
            info=self._info,
        )  # fmt: skip
        if run is not self.run:  # the size was solved by importance at this selection: the clusters' targets changed
            self.run, self.resolved = run, list(run.clusters)
        if stepped and self.schedule.freezes(self.progress.step, heal=self.options.heal):  # a selection's step
            shrunk = per_step.freeze(
                run, options=self.options, clusters=self.resolved, step=self.progress.step, info=self._info
            )
            if shrunk is not None:
                self.shrunk, self.run = shrunk
        return result

    def reproject(self) -> None:
        """Zero the dropped units again, e.g. after another callback copied averaged weights into the model."""
        if self.pruner is None or self.shrunk is not None:
            return
        with torch.no_grad(), self._bound().weights():
            self.pruner.hold()

    # ------------------------------------------------------------------ the saved state (resume.py)
    def _save(self, *, gather: bool) -> dict[str, Any]:
        return resume.save(
            self.run, progress=self.progress, options=self.options, clusters=self.resolved, dropped=self.dropped,
            shrunk=self.shrunk is not None, distiller=self.distiller if gather else None, gather=gather,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The state (see :mod:`lightning_pat.training.state`); a collective where latents or statistics are gathered.

        Every rank must call this: FSDP1 latents, full DTensor latents and the activation statistics are gathered.
        """
        return self._save(gather=True)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Keep a state (see :meth:`state_dict`); :meth:`start` checks and applies it once the model is bound.

        Raises:
            ValueError: If ``saved`` is not a mapping.
        """
        self._pending = resume.load(saved, self.distiller)

    def sharded_latents(self) -> dict[str, Tensor]:
        """For a distributed checkpoint: the latents and a sharded teacher as model-state entries, else ``{}``."""
        return resume.sharded_entries(self.run, self.distiller)

    def teacher_bytes(self) -> Tensor:
        """This rank's bytes of the distillation teacher (float64 scalar; 0 without a teacher)."""
        size = 0 if self.distiller is None else self.distiller.teacher_bytes
        return torch.tensor(float(size), dtype=torch.float64)

    def write_teacher(self, directories: Sequence[str]) -> None:
        """After a checkpoint save: write the teacher file (``distill_teacher_store="file"``) into ``directories``."""
        if self.distiller is not None:
            self.distiller.write_file(directories)

    def before_restore(self, module: nn.Module, saved: Mapping[str, Any] | None, *, weights: Mapping[str, Any]) -> None:
        """Before a checkpoint's ``weights`` load into ``module``: reconcile the shapes of a ``shrink_on_freeze``.

        A checkpoint written after the shrink (``saved`` says ``shrunk``) gives a full-size module the small shapes; a
        checkpoint written before it cannot load into a module this controller already shrank.

        Args:
            module: The module whose weights the checkpoint restores.
            saved: This run's state in that checkpoint, if any.
            weights: The checkpoint's weights for ``module``.

        Raises:
            ConfigurationError: If the module cannot be shrunk to the saved shapes, or the checkpoint predates the
                shrink of this (shrunk) module.
        """
        small = resume.before_restore(
            module, saved, weights=weights, distiller=self.distiller, options=self.options,
            shrunk=self.shrunk is not None,
        )  # fmt: skip
        if small is not None and self.shrunk is None:
            self.resolved, self.shrunk = small
