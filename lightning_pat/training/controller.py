"""The training controller: what happens to the weights around each real optimizer step (no Lightning here).

:class:`PruningController` owns the progress counters, the real-step tracker
(:class:`~lightning_pat.training.progress.StepTracker`), the bound run (:class:`~lightning_pat.training.bound.BoundRun`:
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
freeze, ``shrink_on_freeze``), :mod:`lightning_pat.training.resume` (the fit lifecycle and the saved state) and
:mod:`lightning_pat.training.shrunk_restore` (a checkpoint written after the shrink: the module made small first).
Errors are ``ValueError`` naming the option or cluster; the callback turns them into ``MisconfigurationException``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.spec import Cluster, ResolvedCluster
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.declarations import declarations_for, early_declarations
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.pruner import PruneResult
from lightning_pat.training import per_step, resume, shrunk_restore
from lightning_pat.training.bound import BoundRun, bind_run
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.distill import Distiller
from lightning_pat.training.errors import ConfigurationError
from lightning_pat.training.progress import Progress, StepTracker

log = logging.getLogger(__name__)


class PruningController:
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
        self.progress = Progress()
        self.tracker = StepTracker()
        self.run: BoundRun | None = None  # what bind built (see lightning_pat.training.bound)
        self.resolved: list[ResolvedCluster] = []
        self.shrunk: dict[str, list[int]] | None = None  # the dropped units, once the model has been shrunk
        self._carry: dict[str, Any] | None = None  # in-memory state kept for the next fit (see finish_fit)
        self._pending: dict[str, Any] | None = None  # a loaded state, applied by the next start()
        self._early: list[Cluster] | ValueError | None = None  # clusters="auto" traced before sharding (see prepare)
        self.distiller: Distiller | None = None
        if options.distillation.on:
            self.distiller = Distiller.of(options.distillation, error=forward_error)
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
        pruner = None if self.run is None else self.run.pruner
        return {} if pruner is None else pruner.result().dropped

    @property
    def scorers(self) -> Collectors:
        """The run's data-aware scorers (empty before :meth:`bind` and once the model was shrunk)."""
        return Collectors() if self.run is None else self.run.collectors

    def counts_at(self, step: int, *, every: int) -> bool:
        """Whether the result after ``step`` is logged (counted): every ``every`` steps and at the final ramp step."""
        return self.options.log_metrics and (self.options.schedule.phase(step) == "final" or step % max(every, 1) == 0)

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
        self._early = (
            None
            if batch_input is None
            else early_declarations(module, self.options.clusters, self.options.preset_options, batch_input)
        )

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
        """Bind the run to ``module``'s final parameters (:func:`~lightning_pat.training.bound.bind_run`).

        Nothing is mutated and no pruner is built: :meth:`start` settles the score and builds it. Under
        torch.distributed every rank must call this (the clusters are agreed in one collective).

        Args:
            module: The model (under FSDP1, the LightningModule inside ``fsdp1_root``).
            optimizers: The optimizers whose steps count.
            fsdp1_root: The FSDP1-wrapped root module, if any (parameters are summoned whole around each action).
            sharded_ckpt: Whether checkpoints are distributed checkpoints (latents of DTensors are then written
                next to the model's shards).
            accumulate: Micro-batches per optimizer step (the distillation gradient is divided by it, as the loss).

        Raises:
            ValueError: As for :func:`~lightning_pat.training.bound.bind_run` (a discovery error kept by
                :meth:`prepare` included).
            Exception: ``forward_error`` if ``distill_module`` names no submodule.
        """
        self.tracker.attach(optimizers)
        if self.shrunk is not None:  # the model was shrunk: nothing is left to prune, only steps to count
            kept = None if self.run is None else self.run.score
            params = dict(module.named_parameters(remove_duplicate=False))
            self.run = BoundRun(
                module, list(optimizers), params, self.options, self._info, fsdp1_root=fsdp1_root,
                sharded_ckpt=sharded_ckpt, score=kept,
            )  # fmt: skip
        else:
            self.run = bind_run(
                module, options=self.options, optimizers=optimizers, declarations=self._declarations,
                fsdp1_root=fsdp1_root, sharded_ckpt=sharded_ckpt, info=self._info,
            )  # fmt: skip
            self.resolved = list(self.run.clusters)
        if self.distiller is not None:
            self.distiller.bind(
                module, self.options.distillation.module, accumulate=accumulate, sharded_ckpt=sharded_ckpt
            )

    def _bound(self) -> BoundRun:
        assert self.run is not None, "bind() first"
        return self.run

    # ------------------------------------------------------------------ start and end of a fit (resume.py)
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
        """A fit starts: :func:`~lightning_pat.training.resume.begin_fit`, where a resume reads top to bottom.

        ``owner``'s previous fit is continued if it ended (:meth:`end_fit`) at ``global_step``; a fit with a fresh
        trainer starts a new schedule (and, with distillation, takes a new teacher when pruning starts).

        Args:
            owner: The trainer (held by a weak reference).
            global_step: The trainer's optimizer steps so far (above 0 on a resume).
            steps_left: The fit's estimated optimizer steps (``inf`` if unknown): a fit that ends before the final
                ramp step is warned about.
            ckpt_path: The checkpoint the fit resumes from, if any.
            key: This run's state key in a checkpoint (for the message).
            teacher_dirs: Where the teacher file (``distill_teacher_store="file"``) is written, and where a restored
                state's teacher file is looked up after the directory of ``ckpt_path``; checked at fit start.

        Raises:
            ValueError: As for :func:`~lightning_pat.training.resume.begin_fit`.
        """
        last = self._last_fit
        carry = last is not None and last[0]() is owner and last[1] == global_step
        fit = self._fit_start(carry=carry, ckpt_path=ckpt_path, global_step=global_step)
        self._started(
            *resume.begin_fit(
                self._bound(), self.progress, fit, distiller=self.distiller, key=key, steps_left=steps_left,
                teacher_dirs=teacher_dirs,
            )
        )  # fmt: skip

    def start(self, *, carry: bool = False, ckpt_path: Any = None, global_step: int | None = None) -> None:
        """Decide where the schedule stands: :func:`~lightning_pat.training.resume.start` (for a loop of one's own).

        A state given to :meth:`load_state_dict` continues; else, with ``carry``, the in-memory state of the previous
        fit (the same Trainer's next ``fit``); else a new schedule starts at step 0. The score is settled and the
        pruner built here, once per :meth:`bind`.

        Args:
            carry: Continue the in-memory state of the previous fit, if there is one.
            ckpt_path: The checkpoint the loaded state came from (a distributed checkpoint's latents are read there).
            global_step: The trainer's optimizer steps so far: a loaded state's ``step`` may not exceed it.

        Raises:
            ValueError: As for :func:`~lightning_pat.training.resume.start`.
        """
        fit = self._fit_start(carry=carry, ckpt_path=ckpt_path, global_step=global_step)
        self._started(*resume.start(self._bound(), self.progress, fit))

    def _fit_start(self, *, carry: bool, ckpt_path: Any, global_step: int | None) -> resume.FitStart:
        """What the fit starts from; the loaded and the carried state are handed over (and forgotten here)."""
        fit = resume.FitStart(
            self._pending, self._carry, carry=carry, shrunk=self.shrunk is not None, global_step=global_step,
            ckpt_path=ckpt_path,
        )  # fmt: skip
        self._pending = self._carry = None
        return fit

    def _started(self, run: BoundRun, progress: Progress) -> None:
        self.run, self.progress = run, progress
        if self.shrunk is None:  # a size solved by importance before: the saved targets
            self.resolved = list(run.clusters)

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
        assert self.run is not None
        assert self.run.pruner is not None
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
        if self.run is not None:
            per_step.after_backward(self.run, self.progress, optimizer)

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
        if self.run is None or self.run.pruner is None or self.run.latents is None:
            return None
        result, run = per_step.after_step(
            self.run, self.progress, stepped=stepped, lr=self.tracker.last_lr, count=count
        )
        if run is not self.run:  # the size was solved by importance at this selection: the clusters' targets changed
            self.run, self.resolved = run, list(run.clusters)
        if stepped and self.schedule.freezes(self.progress.step, heal=self.options.heal):  # a selection's step
            shrunk = per_step.freeze(run, self.progress)
            if shrunk is not None:
                self.shrunk, self.run = shrunk
        return result

    def reproject(self) -> None:
        """Zero the dropped units again, e.g. after another callback copied averaged weights into the model."""
        pruner = None if self.run is None else self.run.pruner
        if pruner is None or self.shrunk is not None:
            return
        with torch.no_grad(), self._bound().weights():
            pruner.hold()

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
        """Before a checkpoint's ``weights`` load: :func:`~lightning_pat.training.shrunk_restore.before_restore`.

        A module given the shrunk shapes of ``saved`` (this run's state in that checkpoint) makes this controller's
        run a shrunk one: only steps are counted from there on.

        Raises:
            ConfigurationError: As for :func:`~lightning_pat.training.shrunk_restore.before_restore`.
        """
        small = shrunk_restore.before_restore(
            module, saved, weights=weights, distiller=self.distiller, options=self.options,
            shrunk=self.shrunk is not None,
        )  # fmt: skip
        if small is not None and self.shrunk is None:
            self.resolved, self.shrunk = small

    def before_sharded_restore(
        self, module: nn.Module, saved: Mapping[str, Any] | None, *, optimizers: Sequence[torch.optim.Optimizer]
    ) -> None:
        """Before ``ModelParallelStrategy`` loads a checkpoint: the sharded :meth:`before_restore`.

        :func:`~lightning_pat.training.shrunk_restore.before_sharded_restore`: a ``module`` given the shrunk shapes of
        ``saved`` (its ``optimizers``' param groups repointed) makes this controller's run a shrunk one; in a fit
        (the strategy restores after fit start, so after :meth:`bind`) the run is bound again to the new parameters
        (only steps are counted from there on).

        Raises:
            ConfigurationError: As for :func:`~lightning_pat.training.shrunk_restore.before_sharded_restore`.
        """
        small = shrunk_restore.before_sharded_restore(
            module, saved, optimizers=optimizers, distiller=self.distiller, options=self.options,
            shrunk=self.shrunk is not None,
        )  # fmt: skip
        if small is None:
            return
        self.resolved, self.shrunk = small
        if self.run is not None:  # a fit: bound at fit start to the full-size parameters
            params = dict(module.named_parameters(remove_duplicate=False))
            self.run = BoundRun(
                module, list(optimizers), params, self.options, self._info, sharded_ckpt=self.run.sharded_ckpt
            )
