"""CoupledPruningCallback: the Lightning face of :class:`~lightning_pat.training.controller.PruningController`.

Each hook calls one controller verb (its docstring names it); the callback also logs the sparsity metrics and turns
the controller's ``ValueError`` into ``MisconfigurationException`` at one boundary (:func:`_user_errors`). What it
reads from the Trainer comes from :mod:`~lightning_pat.training.trainer_facts`. ``on_train_start`` is the first hook
after a checkpoint restore under every strategy; ``on_before_optimizer_step`` runs inside ``optimizer.step(closure)``,
after the backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_pat.core.choices import Method, Mode, TrainingScore
from lightning_pat.core.saved_state import callback_state
from lightning_pat.core.spec import Cluster
from lightning_pat.parallel.executors import ExecutorKind
from lightning_pat.pruning.options import PruningOptions, options_doc
from lightning_pat.training import trainer_facts as facts
from lightning_pat.training.controller import PruningController
from lightning_pat.training.environment import check_environment
from lightning_pat.training.errors import ConfigurationError
from lightning_pat.training.metrics import PruningMetrics
from lightning_pat.training.views import PruningViews

if TYPE_CHECKING:
    import lightning.pytorch as pl


@contextmanager
def _user_errors(*kinds: type[Exception]) -> Iterator[None]:
    """The one boundary: ``kinds`` (by default ``ValueError`` and ``TypeError``) are the user's configuration errors.

    Raises:
        MisconfigurationException: With the same message, if the enclosed code raises one of ``kinds``.
    """
    caught = kinds or (ValueError, TypeError)
    try:
        yield
    except caught as err:
        raise MisconfigurationException(str(err)) from err


class CoupledPruningCallback(PruningViews, Callback):
    """Drive coupled units (MLP channels, heads, GQA groups, residual channels) to exact zeros during training.

    Steps are real optimizer steps (not accumulation micro-batches, not AMP-skipped steps). The schedule follows
    the fit: a fit resumed from a checkpoint continues the saved schedule (mask, latent copies, group-lasso state);
    a later ``fit`` of the same Trainer continues where the previous one stopped; a fit with a fresh Trainer starts
    a new schedule at step 0 (a new mask is selected; nothing of an earlier run is reused). The read-only views
    (``dropped``, ``step``, ``size``, ``sparsity()``, ...) are :class:`~lightning_pat.training.views.PruningViews`'.
    The options are documented once, in :class:`~lightning_pat.pruning.options.PruningOptions`; at import their
    ``Args:`` section is appended here, where ``help(CoupledPruningCallback)`` and ``lightning-pat fit --help`` read
    it.

    Raises:
        MisconfigurationException: With a message naming the option or cluster and the fix (``docs/bad-input.md``):
            at construction, for an invalid option, declaration or preset name; at setup, for a strategy or mode the
            options cannot run under; at fit start (on every rank, before any weight is touched), if the clusters do
            not resolve, ranks disagree or a target cannot be reached; at train start, if a checkpoint's state cannot
            be restored; when a checkpoint written before a ``shrink_on_freeze`` shrink is restored into the shrunk
            module.

    Example::

        >>> from lightning_pat import Cluster
        >>> cb = CoupledPruningCallback(
        ...     [Cluster(name="mlp", writers=["net.0.weight", "net.0.bias"], readers=["net.2.weight"])],
        ...     target_sparsity=0.5, warmup_steps=10, ramp_steps=100)
        >>> cb.schedule.final_step
        110
    """

    def __init__(
        self,
        clusters: list[Cluster] | str = "auto",
        target_sparsity: float | None = None,
        *,
        warmup_steps: int = 0,
        ramp_steps: int = 100,
        every_n_steps: int = 1,
        ramp: Literal["cubic", "linear"] = "cubic",
        heal: bool = True,
        method: Method = "hard",
        reg_lambda: float = 0.0,
        score: TrainingScore = "auto",
        mode: Mode = "latent",
        executor: ExecutorKind = "auto",
        group_count_ref: int | None = None,
        preset_options: dict[str, Any] | None = None,
        log_metrics: bool = True,
        debug_check_selection: bool = False,
        shrink_on_freeze: bool = False,
        target_params: int | float | str | None = None,
        target_side: Literal["below", "above"] = "below",
        target_layers: int | None = None,
        target_widths: Literal["uniform", "ranked"] = "uniform",
        min_kept: float | None = None,
        target_flops: int | float | str | None = None,
        seq_len: int | None = None,
        target_allocation: Literal["auto", "importance", "fractions"] = "auto",
        layer_score: Literal["cosine", "weight"] = "cosine",
        expert_score: Literal["reap_sum", "reap", "frequency", "weight"] = "reap_sum",
        distill_alpha: float = 0.0,
        distill_temperature: float = 1.0,
        distill_teacher: torch.nn.Module | None = None,
        distill_module: str = "",
        distill_teacher_store: Literal["checkpoint", "file"] = "checkpoint",
        distill_teacher_dir: str | None = None,
    ) -> None:
        with _user_errors():
            self.options = PruningOptions(
                # a list of declarations is normalized (and checked) into a tuple by PruningOptions
                clusters=clusters,  # type: ignore[arg-type]
                target_sparsity=target_sparsity, warmup_steps=warmup_steps, ramp_steps=ramp_steps,
                every_n_steps=every_n_steps, ramp=ramp, heal=heal, method=method, reg_lambda=reg_lambda, score=score,
                mode=mode, executor=executor, group_count_ref=group_count_ref, preset_options=preset_options or {},
                log_metrics=log_metrics, debug_check_selection=debug_check_selection, shrink_on_freeze=shrink_on_freeze,
                target_params=target_params, target_side=target_side, target_layers=target_layers,
                target_widths=target_widths, min_kept=min_kept, target_flops=target_flops, seq_len=seq_len,
                target_allocation=target_allocation, layer_score=layer_score, expert_score=expert_score,
                distill_alpha=distill_alpha,
                distill_temperature=distill_temperature, distill_teacher=distill_teacher, distill_module=distill_module,
                distill_teacher_store=distill_teacher_store, distill_teacher_dir=distill_teacher_dir,
            )  # fmt: skip
        self.controller = PruningController(self.options, info=rank_zero_info, forward_error=MisconfigurationException)
        self.metrics: PruningMetrics | None = None
        self._restore_hook: Any = None
        self._sharded_restore_hook: Any = None

    # ------------------------------------------------------------------ state
    @property
    @override
    def state_key(self) -> str:
        """Identity in a checkpoint: the cluster declarations' names only (options may change on resume)."""
        return self._generate_state_key(clusters=self.options.key_names())

    @override
    def state_dict(self) -> dict[str, Any]:
        """The controller's state; every rank calls this (Lightning does), so its gathers are safe here."""
        return self.controller.state_dict()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Distributed checkpoint: the sharded latents and teacher go next to the model's shards (each rank its own).

        With ``distill_teacher_store="file"`` the teacher file is written now, once per directory.
        """
        checkpoint["state_dict"].update(self.controller.sharded_latents())
        with _user_errors():
            self.controller.write_teacher(facts.teacher_dirs(trainer, self.options.distillation.teacher_dir))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stash the state; it is applied in ``on_train_start`` once the model, clusters and weights are restored."""
        with _user_errors():
            self.controller.load_state_dict(state_dict)

    # ------------------------------------------------------------------ fit
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse what cannot be supported, before any step; watch for a shrunk checkpoint (``shrink_on_freeze``)."""
        averaging = facts.weight_averaging(trainer)
        with _user_errors():
            check_environment(
                self.options, strategy=type(trainer.strategy).__name__, kind=facts.strategy_kind(trainer.strategy),
                automatic_optimization=getattr(pl_module, "automatic_optimization", True),
                module=type(pl_module).__name__, weight_averaging=averaging,
            )  # fmt: skip
        batch_input = (lambda: facts.first_batch_input(trainer)) if stage == "fit" else None
        self.controller.prepare(pl_module, batch_input, weight_averaging=averaging is not None)
        self._unwatch_restore(sharded=True)  # one hook at a time (setup runs for every fit, validate, test, predict)
        if self.options.shrink_on_freeze:
            self._restore_hook = facts.watch_restore(trainer, pl_module, self._before_restore)
            if facts.strategy_kind(trainer.strategy) == "model_parallel":  # restores after on_fit_start
                self._sharded_restore_hook = facts.watch_sharded_restore(
                    trainer, lambda checkpoint: self._before_sharded_restore(trainer, pl_module, checkpoint)
                )

    def _before_restore(
        self, module: torch.nn.Module, checkpoint: Mapping[str, Any] | None, weights: Mapping[str, Any]
    ) -> None:
        with _user_errors():
            saved = callback_state(checkpoint or {}, key=self.state_key)
            self.controller.before_restore(module, saved, weights=weights)

    def _before_sharded_restore(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Mapping[str, Any]
    ) -> None:
        with _user_errors():
            saved = callback_state(checkpoint, key=self.state_key)
            self.controller.before_sharded_restore(pl_module, saved, optimizers=trainer.optimizers)
        if self.controller.shrunk is not None:  # a model shrunk before this fit only counts steps
            self.metrics = None

    def _unwatch_restore(self, *, sharded: bool = False) -> None:
        if self._restore_hook is not None:
            self._restore_hook.remove()
            self._restore_hook = None
        if sharded and self._sharded_restore_hook is not None:
            self._sharded_restore_hook.remove()
            self._sharded_restore_hook = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve, route and agree across ranks on the final parameters (nothing is mutated)."""
        self._unwatch_restore()  # the checkpoint's weights are loaded by now
        strategy = trainer.strategy
        with _user_errors():
            self.controller.bind(
                pl_module, optimizers=trainer.optimizers, fsdp1_root=facts.fsdp1_root(strategy),
                sharded_ckpt=facts.sharded_checkpoints(strategy), accumulate=trainer.accumulate_grad_batches,
            )  # fmt: skip
        if self.controller.shrunk is None:  # a model shrunk before this fit only counts steps
            self.metrics = PruningMetrics([rc.name for rc in self.controller.resolved])

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Continue a restored state, the same Trainer's previous fit, or start at step 0 (``begin_fit``)."""
        self._unwatch_restore(sharded=True)  # ModelParallelStrategy restored its checkpoint by now
        with _user_errors():
            self.controller.begin_fit(
                owner=trainer, global_step=trainer.global_step, ckpt_path=trainer.ckpt_path, key=self.state_key,
                steps_left=getattr(trainer, "estimated_stepping_batches", float("inf")),
                teacher_dirs=facts.teacher_dirs(trainer, self.options.distillation.teacher_dir),
            )  # fmt: skip

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep what the same Trainer's next ``fit`` needs to continue (the latents only during the ramp)."""
        self.controller.end_fit(owner=trainer, global_step=trainer.global_step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With weight averaging: zero the dropped units again after its final weight transfer (``on_train_end``)."""
        self.controller.reproject_after_averaging()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the controller's hooks (the in-memory state for a next fit of the same Trainer is kept)."""
        self.controller.release()
        self._unwatch_restore(sharded=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A failed fit does not reach ``teardown``: remove the hooks here (no leak into the next cell's fit)."""
        self.controller.release()
        self._unwatch_restore(sharded=True)

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Re-project after weight averaging (first batch of an epoch); open the distillation window."""
        with _user_errors():
            self.controller.before_batch(first_of_epoch=batch_idx == 0, share=(trainer,), ckpt_path=trainer.ckpt_path)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """After the backward: zero dropped gradients (healing) or swap latents in (latent mode, ramp)."""
        self.controller.after_backward(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a real optimizer step: advance the schedule and act; log the sparsity on logging steps."""
        ctl, every = self.controller, int(getattr(trainer, "log_every_n_steps", 1) or 1)
        with _user_errors(ConfigurationError):  # a non-finite score is a failed run, not a configuration error
            result = ctl.after_step(count=lambda step: ctl.counts_at(step, every=every))
        if ctl.kl is not None and self.options.log_metrics:
            pl_module.log("pruning/distill_kl", ctl.kl, on_step=True, on_epoch=False)
            pl_module.log("pruning/teacher_bytes", ctl.teacher_bytes(), on_step=True, on_epoch=False)  # this rank's
        if result is not None and self.metrics is not None:
            self.metrics.update(result.dropped, result.num_units, zeros=result.zeros, numel=result.numel)
            self.metrics.log(pl_module.log)


CoupledPruningCallback.__doc__ = (CoupledPruningCallback.__doc__ or "").replace(
    "\n    Raises:\n", f"\n{options_doc()}\n\n    Raises:\n", 1
)
