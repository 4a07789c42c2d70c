"""CoupledPruningCallback: coupled structured pruning during Lightning training.

Timing (see ``pat-algorithm.md`` §10): under automatic optimization the forward and backward run inside
``optimizer.step(closure)``, so nothing here touches the weights before the closure. The model always trains the
projected (pruned) weights:

* ``on_before_optimizer_step`` (after the backward, before the update): in ``latent`` mode the dense latent copy is
  swapped into the parameters so the optimizer updates the latent with the gradient taken at the projected weights;
  during healing the gradients of dropped units are zeroed.
* an optimizer step post-hook records that a real step happened (not on accumulation micro-batches, not when an
  AMP scaler skipped the step).
* ``on_train_batch_end``: after a real step, the schedule advances; the latent is saved and the projection (a fresh
  selection when due, else the current mask) is applied; during healing the weights are re-zeroed so momentum and
  weight decay cannot revive dropped units.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_pat import _resume as R
from lightning_pat import _shrinking
from lightning_pat import _state as S
from lightning_pat import _validation as V
from lightning_pat import distributed as D
from lightning_pat.activation import ActivationStats
from lightning_pat.engine import METHODS, Method, Plan, Pruner, PruneResult, make_plan
from lightning_pat.executors import EXECUTOR_KINDS, ExecutorKind
from lightning_pat.latent import LatentStore
from lightning_pat.metrics import PruningMetrics
from lightning_pat.scoring import SCORE_TYPES, ScoreType
from lightning_pat.shrink import check_shrinkable
from lightning_pat.spec import Cluster, ResolvedCluster

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

Mode = Literal["latent", "direct"]
MODES: tuple[str, ...] = ("latent", "direct")
#: Options that may change on resume (they apply from the saved step on); the state key never depends on them.
_OPTIONS = (
    "target_sparsity", "warmup_steps", "ramp_steps", "every_n_steps", "ramp", "heal", "method", "reg_lambda",
    "score", "mode", "group_count_ref",
)  # fmt: skip


class CoupledPruningCallback(Callback):
    """Drive coupled units (MLP channels, heads, GQA groups, residual channels) to exact zeros during training.

    Steps are real optimizer steps (not accumulation micro-batches, not AMP-skipped steps). The schedule follows
    the fit: a fit resumed from a checkpoint continues the saved schedule (mask, latent copies, group-lasso state);
    a later ``fit`` of the same Trainer continues where the previous one stopped; a fit with a fresh Trainer starts
    a new schedule at step 0 (a new mask is selected; nothing of an earlier run is reused).

    Args:
        clusters: Cluster declarations (:class:`~lightning_pat.Cluster` objects or mappings of their fields), a
            preset name (``"llama"``, ``"gpt2"``, ``"tiny_gpt"``, ``"linear_chain"``, or ``"auto"`` to detect the
            family), or a list mixing preset names and declarations.
        target_sparsity: Fraction of each cluster's units removed at the end of the ramp (clusters may override).
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
        score: Unit score: ``"rms"`` (default), ``"l2"`` or ``"param_cost"`` (from the weights), or
            ``"activation"`` (opt-in, Minitron-style: each unit's expected squared contribution to its readers'
            outputs, ``sqrt(sum E[x_j^2] ||W[:, j]||^2)``, from an exponential average (0.9) of the readers' input
            over training batches, averaged over ranks before each selection; readers must be ``nn.Linear``
            weights; one device or DDP only; see :mod:`lightning_pat.activation`).
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

    Raises:
        MisconfigurationException: If an option is out of range or unknown, a declaration mapping has an unknown
            key, or a preset name is unknown (at construction); if the strategy is DeepSpeed or the module uses
            manual optimization, or ``shrink_on_freeze`` runs under another strategy than a single device (at setup);
            if the clusters do not resolve against the model, or ranks disagree on
            clusters, routes or schedule (at fit start, on every rank, before any weight is touched); if
            ``score="activation"`` runs under FSDP or ``ModelParallelStrategy`` (at setup) or a cluster's readers
            are not ``nn.Linear`` weights (at fit start); if a checkpoint's state cannot be restored (at train
            start).

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
        target_sparsity: float = 0.5,
        *,
        warmup_steps: int = 0,
        ramp_steps: int = 100,
        every_n_steps: int = 1,
        ramp: Literal["cubic", "linear"] = "cubic",
        heal: bool = True,
        method: Method = "hard",
        reg_lambda: float = 0.0,
        score: ScoreType = "rms",
        mode: Mode = "latent",
        executor: ExecutorKind = "auto",
        group_count_ref: int | None = None,
        preset_options: dict[str, Any] | None = None,
        log_metrics: bool = True,
        debug_check_selection: bool = False,
        shrink_on_freeze: bool = False,
    ) -> None:
        V.check_options(
            target_sparsity=target_sparsity,
            reg_lambda=reg_lambda,
            method=method,
            methods=METHODS,
            score=score,
            scores=SCORE_TYPES,
            mode=mode,
            modes=MODES,
            executor=executor,
            executors=EXECUTOR_KINDS,
            group_count_ref=group_count_ref,
            preset_options=preset_options,
        )
        self.clusters = V.normalize_clusters(clusters)
        self.schedule = V.make_schedule(
            warmup_steps=warmup_steps, ramp_steps=ramp_steps, every_n_steps=every_n_steps, shape=ramp
        )
        self.target_sparsity = float(target_sparsity)
        self.heal = heal
        self.method: Method = method
        self.reg_lambda = float(reg_lambda)
        self.score: ScoreType = score
        self.mode: Mode = mode
        self.executor: ExecutorKind = executor
        self.group_count_ref = group_count_ref
        self.preset_options = dict(preset_options or {})
        self.log_metrics = log_metrics
        self.debug_check_selection = debug_check_selection
        V.check_shrink_needs_heal(shrink_on_freeze=shrink_on_freeze, heal=heal)
        self.shrink_on_freeze = shrink_on_freeze
        self._shrinking = _shrinking.ShrinkOnFreeze()  # the dropped units, once the model has been shrunk
        self._early: list[Cluster] | ValueError | None = (
            None  # clusters="auto" traced in setup (configure_model shards)
        )

        self.pruner: Pruner | None = None
        self.plan: Plan | None = None
        self.resolved: list[ResolvedCluster] = []
        self.metrics: PruningMetrics | None = None
        self._progress = S.Progress()  # real steps and the group-lasso step sizes
        self._tracker = S.StepTracker()
        self._latents: LatentStore | None = None
        self._act: ActivationStats | None = None  # score="activation": the readers' input statistics
        self._pending_state: dict[str, Any] | None = None
        self._params: dict[str, Tensor] = {}
        self._fsdp1_root: torch.nn.Module | None = None
        self._strategy: Any = None
        self._last_fit: tuple[Any, int] | None = None  # (weakref to the Trainer, its global_step) at the last fit end
        self._carry: dict[str, Any] | None = None  # in-memory state kept for the same Trainer's next fit

    # ------------------------------------------------------------------ identity and state
    @property
    @override
    def state_key(self) -> str:
        """Identity in a checkpoint: the cluster declarations' names only (options may change on resume)."""
        return self._generate_state_key(clusters=R.key_names(self.clusters))

    @property
    @override
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        """The key of state version 1 (it included ``target_sparsity``): such checkpoints are still found."""
        qualname = type(self).__qualname__
        return R.legacy_state_key(self.state_key, qualname=qualname, target_sparsity=self.target_sparsity)

    @property
    def step(self) -> int:
        """Completed real optimizer steps seen by the schedule."""
        return self._progress.step

    @property
    def dropped(self) -> dict[str, list[int]]:
        """Cluster name -> sorted dropped unit indices of the current mask."""
        if self._shrinking.dropped is not None:
            return dict(self._shrinking.dropped)
        return {} if self.pruner is None else {rc.name: self.pruner.dropped(rc.name) for rc in self.pruner.clusters}

    def targets(self, step: int) -> dict[str, float]:
        """Per-cluster target fraction in force after optimizer step ``step``."""
        if self.plan is None:
            return {}
        return self.plan.targets(self.target_sparsity, fraction=self.schedule.fraction(step))

    def _options(self) -> dict[str, Any]:
        """The options that may change on resume, by name (``ramp`` is the schedule's shape)."""
        s = self.schedule
        held = {"warmup_steps": s.warmup_steps, "ramp_steps": s.ramp_steps, "every_n_steps": s.every_n_steps}
        held["ramp"] = s.shape
        return {k: held[k] if k in held else getattr(self, k) for k in _OPTIONS}

    @override
    def state_dict(self) -> dict[str, Any]:
        """Step, gamma, mask, group-lasso factors, latent copies (during the ramp), fingerprints and options.

        Under ``ModelParallelStrategy`` with a distributed checkpoint the latents are written by the checkpoint
        itself, as DTensors next to the model's shards (each rank writes its own); with a full checkpoint they
        are gathered into full tensors. Every rank calls this (Lightning does), so a gather is safe here.
        """
        return R.checkpoint_state(
            self._progress,
            pruner=self.pruner,
            dropped=self.dropped,
            resolved=self.resolved,
            options=self._options(),
            latent=self._latent_state(),
            shrunk=self._shrinking.dropped is not None,
            act=self._act,  # every rank's statistics, in rank order (ranks see other batches; each resumes its own)
        )

    def _latent_format(self) -> str:
        sharded_ckpt = isinstance(self._strategy, ModelParallelStrategy) and getattr(
            self._strategy, "_save_distributed_checkpoint", False
        )
        return S.latent_format(self._params.values(), fsdp1=self._fsdp1_root is not None, sharded_ckpt=sharded_ckpt)

    def _latent_state(self) -> dict[str, Any] | None:
        if self._latents is None or not self._latents.active:
            return None
        return S.latent_state(self._latents.state_dict(), self._params, fmt=self._latent_format())

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """Distributed checkpoint: put the sharded latents next to the model's shards (each rank writes its own)."""
        if self._latents is None or not self._latents.active or self._latent_format() != "dcp":
            return
        checkpoint["state_dict"].update(S.sharded_latents(self._latents.state_dict(), self._params))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stash the state; it is applied in ``on_train_start`` once the model, clusters and weights are restored."""
        self._pending_state = dict(state_dict)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Reject what cannot be supported, before any step (DeepSpeed, manual optimization, activation score)."""
        V.check_strategy_and_optimization(trainer, pl_module)
        self._early = (
            V.early_declarations(self.clusters, pl_module, trainer, preset_options=self.preset_options)
            if stage == "fit"
            else None
        )
        if self.score == "activation":
            V.check_activation_strategy(trainer)
        if self.shrink_on_freeze:
            V.check_shrink_on_freeze(trainer)
            connector = trainer._checkpoint_connector  # Lightning restores the weights before any callback hook
            self._shrinking.watch(
                pl_module, checkpoint=lambda: getattr(connector, "_loaded_checkpoint", None), state_key=self.state_key
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve clusters against the final (possibly sharded) parameters, agree across ranks, build executors.

        Nothing is mutated here. Resolution and routing use global metadata only; their outcome (or a rank's
        error) is compared across ranks in one collective, so a rank with a different declaration or model makes
        every rank raise the same error instead of hanging in a later collective.
        """
        self._strategy = trainer.strategy
        self._fsdp1_root = trainer.strategy.model if isinstance(trainer.strategy, FSDPStrategy) else None
        self._params = dict(pl_module.named_parameters(remove_duplicate=False))
        self._shrinking.unwatch()  # the checkpoint's weights are loaded by now
        if self._shrinking.dropped is not None:  # the model was shrunk: nothing is left to prune, only steps to count
            self.resolved = self._shrinking.resolved
            self.pruner, self._latents = None, None
            self._tracker.attach(trainer.optimizers)
            return
        with self._weights(pl_module) as params:

            def build() -> Plan:
                if isinstance(self._early, ValueError):  # discovery failed in setup: every rank raises it here
                    raise self._early
                declared = self._early or V.declarations(self.clusters, pl_module, preset_options=self.preset_options)
                return make_plan(
                    params, declared, score=self.score, executor=self.executor, group_count_ref=self.group_count_ref
                )

            self.plan = plan = V.agreed_plan(build, options=self._options())
            self.resolved = list(plan.clusters)
            self.pruner = Pruner.from_plan(params, plan)
            if self.score == "activation":
                with V.user_error("CoupledPruningCallback(score='activation')"):
                    self._act = ActivationStats(pl_module, self.resolved)
            if self.shrink_on_freeze:  # refuse now what the shrink at the final step could not rewrite
                with V.user_error("CoupledPruningCallback(shrink_on_freeze=True)"):
                    check_shrinkable(pl_module, self.resolved)
        clustered = sorted({n for rc in self.resolved for n in rc.param_names})
        # FSDP1 keeps parameters in flat shards between steps: the latent is a copy of every local shard.
        self._latents = LatentStore(self._params, list(self._params) if self._fsdp1_root is not None else clustered)
        self.metrics = PruningMetrics([rc.name for rc in self.pruner.clusters])
        V.warn_unoptimized(self._params, clustered, trainer.optimizers)
        self._log_routes()
        self._tracker.attach(trainer.optimizers)

    @contextmanager
    def _weights(self, pl_module: pl.LightningModule) -> Iterator[dict[str, Tensor]]:
        """The parameters the engine works on: the live ones, or FSDP1's summoned full ones (written back on exit)."""
        if self._fsdp1_root is None:
            yield self._params
            return
        with D.summoned_params(self._fsdp1_root, pl_module) as params:
            if self.pruner is not None:
                self.pruner.rebind(params)
            yield params

    def _log_routes(self) -> None:
        assert self.pruner is not None
        lines = [f"  {name}: {kind} ({reason})" for name, (kind, reason) in self.pruner.routes.items()]
        rank_zero_info(f"CoupledPruningCallback routes {len(lines)} cluster(s):\n" + "\n".join(lines))

    # ------------------------------------------------------------------ start: resume, continue or begin
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide where the schedule stands (after checkpoint restore under every strategy) and apply it.

        A restored state continues; the same Trainer's next fit continues its in-memory state; otherwise a new
        schedule starts at step 0. A resume whose checkpoint holds no state for this callback is an error.
        """
        if self._shrinking.dropped is not None:  # shrunk (before the restore, or by an earlier fit): count steps
            self._progress.count_from(self._pending_state or self._carry or {})
            self._pending_state = self._carry = None
            return
        assert self.pruner is not None
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._restore(trainer, pl_module, state)
        elif self._carry is not None and self._same_trainer(trainer):  # continue the in-memory state
            carry = self._carry
            self._apply(pl_module, carry, saved_latents=carry["latents"] or None, activation=carry.get("activation"))
        else:
            V.check_fresh_start(trainer, state_key=self.state_key)
            if self._carry is not None:
                rank_zero_info("CoupledPruningCallback: a fresh Trainer starts a new pruning schedule at step 0.")
            self._progress = S.Progress()
            if self._act is not None:
                self._act.reset()
        self._carry = None
        assert self.plan is not None
        V.check_mask_not_empty(
            self.plan,
            self.pruner,
            schedule=self.schedule,
            step=self._progress.step,
            heal=self.heal,
            target_sparsity=self.target_sparsity,
        )
        if self._act is not None and not self._frozen(self._progress.step):
            self._act.attach()  # removed at the freeze and at the end of the fit
        steps_left = getattr(trainer, "estimated_stepping_batches", float("inf"))
        V.warn_short_fit(schedule=self.schedule, step=self._progress.step, steps_left=steps_left - trainer.global_step)

    def _frozen(self, step: int) -> bool:
        """Whether the mask is frozen after ``step`` (healing): nothing is selected any more."""
        return self.heal and self.schedule.phase(step) in ("final", "healing")

    def _same_trainer(self, trainer: pl.Trainer) -> bool:
        return (
            self._last_fit is not None and self._last_fit[0]() is trainer and self._last_fit[1] == trainer.global_step
        )

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: dict[str, Any]) -> None:
        """A checkpoint's state, once checked; the latents are read back in the format they were written in."""
        needs_latent = V.check_restorable(
            state,
            fingerprints={rc.name: rc.fingerprint() for rc in self.resolved},
            options=self._options(),
            schedule=self.schedule,
            latent_mode=self.mode == "latent",
            heal=self.heal,
        )
        latent = state.get("latent")
        latents = S.saved_latents(latent, self._params, ckpt_path=trainer.ckpt_path) if needs_latent else None
        self._apply(pl_module, state, saved_latents=latents, activation=R.rank_activation(state.get("activation")))

    def _apply(
        self,
        pl_module: pl.LightningModule,
        state: Mapping[str, Any],
        *,
        saved_latents: Mapping[str, Tensor] | None,
        activation: Mapping[str, Any] | None,
    ) -> None:
        """Set progress, mask, latents and activation statistics from ``state``; project the weights."""
        assert self.pruner is not None
        assert self._latents is not None
        self._progress = R.apply_state(
            state,
            pruner=self.pruner,
            latents=self._latents,
            act=self._act,
            saved_latents=saved_latents,
            activation=activation,
        )
        with torch.no_grad(), self._weights(pl_module):
            self.pruner.hold()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep what the same Trainer's next ``fit`` needs to continue (the latents only during the ramp)."""
        if self._shrinking.dropped is not None:
            self._carry = self._progress.state_dict()  # only the step count goes on
            return
        assert self.pruner is not None
        self._last_fit = (weakref.ref(trainer), trainer.global_step)
        self._carry = R.carry_state(
            self._progress, pruner=self.pruner, dropped=self.dropped, latents=self._latents, act=self._act
        )
        if self._act is not None:
            self._act.detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove optimizer and activation hooks (the in-memory state for a next fit of the same Trainer is kept)."""
        self._tracker.detach()
        if self._act is not None:
            self._act.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A failed fit does not reach ``teardown``: remove the hooks here (no leak into the next cell's fit)."""
        self._tracker.detach()
        if self._act is not None:
            self._act.detach()

    # ------------------------------------------------------------------ per step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """After the backward: zero dropped gradients (healing) or swap latents in (latent mode, ramp)."""
        if self.pruner is None or self._latents is None:
            return
        action = self.schedule.action(self._progress.step + 1, heal=self.heal)
        with torch.no_grad():
            if action == "freeze":
                if self._fsdp1_root is None:  # FSDP1: grads live in flat shards; the weights are re-zeroed after
                    self.pruner.zero_grads()
            elif action != "none" and self._latents.active:
                self._latents.swap_in({id(p) for g in optimizer.param_groups for p in g["params"]})

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a real optimizer step: advance the schedule and act (select, hold or freeze)."""
        if self._shrinking.dropped is not None:  # healing on the shrunk model: the dropped units no longer exist
            if self._tracker.consume():
                self._progress.tick()
                self._progress.add_lr(self._tracker.last_lr)
            return
        if self.pruner is None or self._latents is None:
            return
        latent = self.mode == "latent"
        with torch.no_grad():
            if not self._tracker.consume():
                if self._latents.swapped:  # the scaler skipped the step: show the projection again
                    self._latents.commit()
                    with self._weights(pl_module):
                        self.pruner.hold(rescale=latent)
                return
            step = self._progress.tick()
            action = self.schedule.action(step, heal=self.heal)
            if action == "none":
                return
            self._progress.add_lr(self._tracker.last_lr)
            if latent and action != "freeze":
                self._latents.commit()
            with self._weights(pl_module):
                if action == "freeze":
                    self.pruner.hold()
                elif action == "hold":
                    self.pruner.hold(rescale=latent)
                else:
                    self._select(pl_module)
                count = self._should_count(trainer, step)
                result = self.pruner.result(count=True) if count else None  # counting may communicate
            if self.heal and self.schedule.phase(step) == "final":
                self._latents.clear()  # the mask is frozen from here on
                if self._act is not None:
                    self._act.detach()  # no per-forward cost during healing
                if self.shrink_on_freeze:
                    self._shrink_model(trainer, pl_module)
            if result is not None:
                self._log(pl_module, result)

    def _shrink_model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``shrink_on_freeze``: cut the frozen mask's units out of the module and the optimizer state."""
        self._shrinking.shrink(pl_module, self.resolved, self.dropped, optimizers=trainer.optimizers)
        self.pruner, self._latents, self._act = None, None, None
        rank_zero_info(
            f"CoupledPruningCallback: shrunk the model at step {self._progress.step} to "
            f"{sum(p.numel() for p in pl_module.parameters()):,} parameters; healing runs on the small model."
        )

    def _select(self, pl_module: pl.LightningModule) -> None:
        """A fresh selection at this step's targets (the final step always applies the exact hard target)."""
        assert self.pruner is not None
        step = self._progress.step
        method: Method = "hard" if self.schedule.phase(step) in ("final", "healing") else self.method
        scores = None
        if self._act is not None:
            with V.user_error("CoupledPruningCallback(score='activation')"):
                scores = self._act.summed_unit_scores(self._params)  # one collective under DDP
        threshold = self.reg_lambda * self._progress.prox_step(latent=self.mode == "latent")
        self.pruner.step(self.targets(step), method=method, threshold=threshold, scores=scores)
        self._progress.mark_selection()
        if self.debug_check_selection:
            V.check_selection_agreement(self.dropped, step=step)

    def _should_count(self, trainer: pl.Trainer, step: int) -> bool:
        if not self.log_metrics:
            return False
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        return self.schedule.phase(step) == "final" or step % every == 0

    def _log(self, pl_module: pl.LightningModule, result: PruneResult) -> None:
        if self.metrics is None:
            return
        self.metrics.update_units({k: len(v) for k, v in result.dropped.items()}, result.num_units)
        self.metrics.update_params(result.zeros, result.numel)
        main = f"{self.metrics.prefix}/unit_sparsity"
        for key, value in self.metrics.values().items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == main, sync_dist=False)

    def sparsity(self) -> dict[str, float]:
        """The latest logged values (unit, parameter and per-cluster sparsity)."""
        return {} if self.metrics is None else self.metrics.values()

    def latent_params(self) -> Mapping[str, Tensor]:
        """The latent copies held right now (empty in direct mode, during warmup and during healing)."""
        return {} if self._latents is None else self._latents.state_dict()
