"""CoupledPruningCallback: the Lightning face of :class:`~lightning_pat.training.controller.PruningController`.

The callback routes Lightning's hooks to the controller's verbs, logs the sparsity metrics and turns the
controller's ``ValueError`` into ``MisconfigurationException`` (one boundary, :func:`_user_errors`):

* ``setup``: refuse strategies and modes the controller cannot serve; with ``shrink_on_freeze``, watch for a
  checkpoint of a shrunk model (its weights load before any callback hook runs);
* ``on_fit_start``: :meth:`~PruningController.bind` the final (possibly sharded) parameters and the optimizers;
* ``on_train_start`` (the first hook after a checkpoint restore under every strategy): ``start``;
* ``on_before_optimizer_step`` (inside ``optimizer.step(closure)``, after the backward): ``after_backward``;
* ``on_train_batch_end``: ``after_step``, then log the result;
* ``state_dict`` / ``load_state_dict`` / ``on_save_checkpoint``: the controller's state (``state``);
* with ``distill_alpha > 0``, ``on_train_batch_start`` / ``on_train_batch_end`` open and close the window in which
  the :class:`~lightning_pat.training.distill.Distiller`'s forward hook adds the teacher's gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_pat.core.budget import SizeSolution
from lightning_pat.core.schedule import Schedule
from lightning_pat.core.scoring import ScoreType
from lightning_pat.core.spec import Cluster, ResolvedCluster
from lightning_pat.engine import Pruner
from lightning_pat.options import Method, Mode, PruningOptions, StrategyKind, check_environment
from lightning_pat.parallel.executors import ExecutorKind
from lightning_pat.training.controller import ConfigurationError, PruningController
from lightning_pat.training.distill import Distiller
from lightning_pat.training.metrics import PruningMetrics

if TYPE_CHECKING:
    import lightning.pytorch as pl


@contextmanager
def _user_errors(*kinds: type[Exception]) -> Iterator[None]:
    """The one boundary: errors of the options or the controller are the user's configuration errors.

    ``kinds`` are the errors converted, by default ``ValueError`` and ``TypeError``.

    Raises:
        MisconfigurationException: With the same message, if the enclosed code raises one of ``kinds``.
    """
    caught = kinds or (ValueError, TypeError)
    try:
        yield
    except caught as err:
        raise MisconfigurationException(str(err)) from err


def first_batch_input(trainer: pl.Trainer) -> Any:
    """What ``forward`` takes, from the first training batch (``None`` if there is no training data to read yet).

    ``batch[0]`` of a tuple or list, a mapping (keyword arguments) or the batch itself. The loader gets a fresh
    iterator (training starts its own later) and the global torch RNG state is restored afterwards, so a shuffling
    sampler draws the same order as without this peek.
    """
    try:
        source = trainer.fit_loop._data_source  # noqa: SLF001 - Lightning keeps fit's train data here before setup_data
        loader = source.dataloader() if source.is_defined() else None
    except Exception:  # noqa: BLE001 - any failure means "no batch to trace": the caller says how to fix it
        return None
    if loader is None:
        return None
    rng = torch.random.get_rng_state()
    try:
        batch = next(iter(loader))
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        torch.random.set_rng_state(rng)
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0]
    return batch


def _strategy_kind(strategy: Strategy) -> StrategyKind:
    if "DeepSpeed" in type(strategy).__name__:
        return "deepspeed"
    kinds: tuple[tuple[type, StrategyKind], ...] = (
        (FSDPStrategy, "fsdp1"), (ModelParallelStrategy, "model_parallel"), (DDPStrategy, "ddp"),
        (SingleDeviceStrategy, "single"),
    )  # fmt: skip
    return next((kind for cls, kind in kinds if isinstance(strategy, cls)), "other")


class CoupledPruningCallback(Callback):
    """Drive coupled units (MLP channels, heads, GQA groups, residual channels) to exact zeros during training.

    Steps are real optimizer steps (not accumulation micro-batches, not AMP-skipped steps). The schedule follows
    the fit: a fit resumed from a checkpoint continues the saved schedule (mask, latent copies, group-lasso state);
    a later ``fit`` of the same Trainer continues where the previous one stopped; a fit with a fresh Trainer starts
    a new schedule at step 0 (a new mask is selected; nothing of an earlier run is reused).

    Args:
        clusters: Cluster declarations (:class:`~lightning_pat.Cluster` objects or mappings of their fields), a
            preset name (``"llama"``, ``"gpt2"``, ``"tiny_gpt"``, ``"linear_chain"``, or ``"auto"`` to detect the
            family; a model no preset fits is traced in ``setup`` from its ``example_input_array`` or first training
            batch, see :func:`~lightning_pat.discover`), or a list mixing preset names and declarations.
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
        distill_alpha: Distill from the dense model during the ramp and healing (0, the default, is off). The
            student's gradient becomes that of ``loss + distill_alpha * T^2 * KL(teacher || student)`` (softmax of
            the logits at temperature ``T``, mean over tokens), added through a forward hook on the logits: no change
            to ``training_step``; the logged loss stays the user's, the KL is logged as ``pruning/distill_kl``. Single
            device and DDP (see :mod:`lightning_pat.training.distill`).
        distill_temperature: The softmax temperature ``T`` (> 0).
        distill_teacher: The teacher module (run on the student's inputs, never updated); ``None`` (default) takes
            a frozen copy of the model when pruning starts, saved in the callback state for resume.
        distill_module: The submodule whose forward returns the logits (a tensor, or an output with ``logits``,
            such as a Hugging Face ``ModelOutput``); ``""`` (default) is the LightningModule itself, whose forward
            ``training_step`` must call (``self(x)``).

        target_params: A size instead of a fraction: an absolute parameter count (``4e9``, ``"4B"``, ``"350M"``) or a
            fraction of the model's parameters (``0.5``, ``"50%"``). At fit start the per-cluster widths that reach it
            are solved (one width per declaration, as a stock config loads; every parameter a unit carries is counted,
            tied weights once; clusters with their own ``target`` keep it; layer units drop whole layers) and the
            ramp goes towards them; ``target_sparsity`` is then unused. :attr:`size` reports the achieved count and
            the nearest achievable counts on either side. ``method="hard"`` only.
        target_side: ``"below"`` (default): the closest achievable count not above ``target_params``; ``"above"``:
            the closest not below it.
        target_layers: With layer units (``preset_options={"layers": True}``) and ``target_params``: how many layers
            to keep; the widths make up the rest of the size. By default depth and widths keep the same fraction.
        layer_score: How layer units are ranked: ``"cosine"`` (default): ``1 - cos(input, output)`` of each decoder
            layer over the training forwards since the previous selection, summed over ranks (ShortGPT, ModelOpt;
            see :mod:`lightning_pat.layer_score`), the weight score if no layer saw a forward; ``"weight"``: the
            RMS of the layer's output projections.

    Raises:
        MisconfigurationException: If an option is out of range or unknown, a declaration mapping has an unknown
            key, or a preset name is unknown (at construction); if the strategy is DeepSpeed or the module uses
            manual optimization, or ``shrink_on_freeze`` runs under another strategy than a single device (at setup);
            if the clusters do not resolve against the model, a target below 1 would drop every unit of a cluster
            (a 1-unit cluster, ``multiple_of``, one KV head), or ranks disagree on
            clusters, routes or schedule (at fit start, on every rank, before any weight is touched); if
            ``StochasticWeightAveraging`` runs with ``shrink_on_freeze`` (at setup; without it, the mask is re-applied
            after SWA's weight transfers); if a checkpoint written before a ``shrink_on_freeze`` shrink is restored
            into the shrunk module (``validate``/``test``/``predict``/``fit`` with ``ckpt_path``); if
            ``score="activation"`` runs under FSDP or ``ModelParallelStrategy`` (at setup) or a cluster's readers
            are not ``nn.Linear`` weights (at fit start); if ``target_params`` is malformed (at construction) or
            above the model's size or below what the clusters can reach (at fit start, with the numbers); if a
            checkpoint's state cannot be restored (at train start).

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
        target_params: int | float | str | None = None,
        target_side: Literal["below", "above"] = "below",
        target_layers: int | None = None,
        layer_score: Literal["cosine", "weight"] = "cosine",
        distill_alpha: float = 0.0,
        distill_temperature: float = 1.0,
        distill_teacher: torch.nn.Module | None = None,
        distill_module: str = "",
    ) -> None:
        with _user_errors():
            self.options = PruningOptions(
                clusters=clusters, target_sparsity=target_sparsity, warmup_steps=warmup_steps, ramp_steps=ramp_steps,
                every_n_steps=every_n_steps, ramp=ramp, heal=heal, method=method, reg_lambda=reg_lambda, score=score,
                mode=mode, executor=executor, group_count_ref=group_count_ref, preset_options=preset_options or {},
                log_metrics=log_metrics, debug_check_selection=debug_check_selection, shrink_on_freeze=shrink_on_freeze,
                target_params=target_params, target_side=target_side, target_layers=target_layers,
                layer_score=layer_score, distill_alpha=distill_alpha, distill_temperature=distill_temperature,
                distill_teacher=distill_teacher, distill_module=distill_module,
            )  # fmt: skip
        self.controller = PruningController(self.options, info=rank_zero_info)
        opts = self.options
        self.distiller = (
            Distiller(
                alpha=opts.distill_alpha,
                temperature=opts.distill_temperature,
                teacher=opts.distill_teacher,
                error=MisconfigurationException,
            )  # fmt: skip
            if opts.distill
            else None
        )
        self.metrics: PruningMetrics | None = None
        self._restore_hook: Any = None
        self._reproject = False  # a weight-averaging callback may write averaged weights into dropped units
        self._last_fit: tuple[Any, int] | None = None  # (weakref to the Trainer, its global_step) at the last fit end

    # ------------------------------------------------------------------ views
    @property
    def schedule(self) -> Schedule:
        """The step schedule."""
        return self.options.schedule

    @property
    def target_sparsity(self) -> float:
        """Fraction of each cluster's units removed at the end of the ramp (clusters may override)."""
        return self.options.target_sparsity

    @property
    def size(self) -> SizeSolution | None:
        """With ``target_params``, after fit start: the solved widths, the achieved count and its neighbours."""
        return self.controller.size

    @property
    def step(self) -> int:
        """Completed real optimizer steps seen by the schedule."""
        return self.controller.progress.step

    @property
    def dropped(self) -> dict[str, list[int]]:
        """Cluster name -> sorted dropped unit indices of the current mask."""
        return self.controller.dropped

    @property
    def resolved(self) -> list[ResolvedCluster]:
        """The resolved clusters (after fit start)."""
        return self.controller.resolved

    @property
    def pruner(self) -> Pruner | None:
        """The engine (after fit start; ``None`` once the model was shrunk)."""
        return self.controller.pruner

    @property
    def teacher(self) -> torch.nn.Module | None:
        """The distillation teacher (``None`` without distillation, or before pruning starts with a copied one)."""
        return None if self.distiller is None else self.distiller.teacher

    def sparsity(self) -> dict[str, float]:
        """The latest logged values (unit, parameter and per-cluster sparsity)."""
        return {} if self.metrics is None else self.metrics.values()

    def latent_params(self) -> Mapping[str, Tensor]:
        """The latent copies held right now (empty in direct mode, during warmup and during healing)."""
        latents = self.controller.latents
        return {} if latents is None else latents.state_dict()

    # ------------------------------------------------------------------ state
    @property
    @override
    def state_key(self) -> str:
        """Identity in a checkpoint: the cluster declarations' names only (options may change on resume)."""
        return self._generate_state_key(clusters=self.options.key_names())

    @override
    def state_dict(self) -> dict[str, Any]:
        """The controller's state; every rank calls this (Lightning does), so its gathers are safe here."""
        state = self.controller.state_dict()
        if self.distiller is not None:
            state["distill"] = self.distiller.state_dict()
        return state

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """Distributed checkpoint: put the sharded latents next to the model's shards (each rank writes its own)."""
        checkpoint["state_dict"].update(self.controller.sharded_latents())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stash the state; it is applied in ``on_train_start`` once the model, clusters and weights are restored."""
        state = dict(state_dict)
        distill = state.pop("distill", None) or {}
        if self.distiller is not None:
            self.distiller.load_state_dict(distill)
        self.controller.load_state_dict(state)

    # ------------------------------------------------------------------ fit
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse what cannot be supported, before any step; watch for a shrunk checkpoint (``shrink_on_freeze``)."""
        callbacks = getattr(trainer, "callbacks", ())  # a stand-in Trainer may have none
        swa = [type(cb).__name__ for cb in callbacks if isinstance(cb, StochasticWeightAveraging)]
        with _user_errors():
            check_environment(
                self.options,
                strategy=type(trainer.strategy).__name__,
                kind=_strategy_kind(trainer.strategy),
                automatic_optimization=getattr(pl_module, "automatic_optimization", True),
                module=type(pl_module).__name__,
                weight_averaging=swa[0] if swa else None,
            )
        self._reproject = bool(swa)
        self.controller.prepare(pl_module, (lambda: first_batch_input(trainer)) if stage == "fit" else None)
        self._unwatch_restore()  # one hook at a time (setup runs for every fit, validate, test and predict)
        if self.options.shrink_on_freeze:
            connector = trainer._checkpoint_connector  # Lightning restores the weights before any callback hook
            self._restore_hook = pl_module.register_load_state_dict_pre_hook(
                lambda mod, weights, prefix, *_: (
                    None
                    if prefix
                    else self._before_restore(mod, getattr(connector, "_loaded_checkpoint", None), weights)
                )
            )

    def _before_restore(
        self, module: torch.nn.Module, checkpoint: Mapping[str, Any] | None, weights: Mapping[str, Any]
    ) -> None:
        saved = (checkpoint or {}).get("callbacks", {}).get(self.state_key)
        if self.distiller is not None and saved and saved.get("shrunk"):  # a dense copy to rebuild the teacher into
            self.distiller.keep_skeleton(module, saved.get("distill"), self.options.distill_module)
        with _user_errors():
            self.controller.before_restore(module, saved, weights=weights)

    def _unwatch_restore(self) -> None:
        if self._restore_hook is not None:
            self._restore_hook.remove()
            self._restore_hook = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve, route and agree across ranks on the final parameters (nothing is mutated)."""
        self._unwatch_restore()  # the checkpoint's weights are loaded by now
        strategy = trainer.strategy
        with _user_errors():
            self.controller.bind(
                pl_module,
                optimizers=trainer.optimizers,
                fsdp1_root=strategy.model if isinstance(strategy, FSDPStrategy) else None,
                sharded_ckpt=isinstance(strategy, ModelParallelStrategy)
                and bool(getattr(strategy, "_save_distributed_checkpoint", False)),
            )
            if self.distiller is not None:
                self.distiller.bind(pl_module, self.options.distill_module, accumulate=trainer.accumulate_grad_batches)
        if self.controller.pruner is not None:
            self.metrics = PruningMetrics([rc.name for rc in self.controller.resolved])

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Continue a restored state, the same Trainer's previous fit, or start at step 0.

        A resume whose checkpoint holds no state for this callback is an error.
        """
        last = self._last_fit
        carry = last is not None and last[0]() is trainer and last[1] == trainer.global_step
        ctl = self.controller
        if not ctl.restoring and not carry and trainer.global_step > 0 and ctl.shrunk is None:
            raise MisconfigurationException(
                f"CoupledPruningCallback: the fit resumes at global step {trainer.global_step} from "
                f"{trainer.ckpt_path!r}, which holds no state under this callback's key {self.state_key!r} (the "
                "cluster declaration names identify it). Resume with the same cluster names, or, to start pruning "
                "from trained weights, load them into the module and fit with a fresh Trainer without `ckpt_path`."
            )
        if self.distiller is not None and not ctl.restoring and not carry:
            self.distiller.reset()  # a new schedule: a new teacher when pruning starts
        with _user_errors():
            ctl.start(carry=carry, ckpt_path=trainer.ckpt_path)
        if self.controller.shrunk is None:
            steps_left = getattr(trainer, "estimated_stepping_batches", float("inf"))
            self.controller.warn_short_fit(steps_left - trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep what the same Trainer's next ``fit`` needs to continue (the latents only during the ramp)."""
        self._last_fit = (weakref.ref(trainer), trainer.global_step)
        self.controller.finish_fit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove optimizer and activation hooks (the in-memory state for a next fit of the same Trainer is kept)."""
        self.controller.release()
        if self.distiller is not None:
            self.distiller.release()
        self._unwatch_restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A failed fit does not reach ``teardown``: remove the hooks here (no leak into the next cell's fit)."""
        self.controller.release()
        if self.distiller is not None:
            self.distiller.release()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With weight averaging: re-apply the mask once per epoch, after the averaging callbacks' epoch start.

        ``StochasticWeightAveraging`` copies its averaged weights (dropped units included) into the model at the start
        of its BatchNorm-update epoch; re-projecting before that epoch's first forward keeps the statistics exact.

        With distillation: build the teacher when pruning starts; open the window of the forward hook.
        """
        if self._reproject and batch_idx == 0:
            self.controller.reproject()
        if self.distiller is not None:
            with _user_errors():
                self.distiller.ensure_teacher(
                    step=self.controller.progress.step, start=self.schedule.warmup_steps, share=(trainer,)
                )
            self.distiller.open()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With weight averaging: zero the dropped units again after its final weight transfer (``on_train_end``)."""
        if self._reproject:
            self.controller.reproject()

    # ------------------------------------------------------------------ per step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """After the backward: zero dropped gradients (healing) or swap latents in (latent mode, ramp).

        Raises:
            MisconfigurationException: If distillation is on and the logits module's forward did not run.
        """
        distiller = self.distiller
        if distiller is not None:
            if distiller.on and distiller.calls == 0:
                raise MisconfigurationException(
                    f"CoupledPruningCallback(distill_alpha={distiller.alpha}): the forward of `distill_module="
                    f"{distiller.module_name!r}` did not run in this training step, so nothing was distilled. Call "
                    "`self(...)` in `training_step`, or set `distill_module` to the submodule it calls (e.g. 'model')."
                )
            distiller.calls = 0
        self.controller.after_backward(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a real optimizer step: advance the schedule and act; log the sparsity on logging steps."""
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        schedule = self.schedule

        def count(step: int) -> bool:
            return self.options.log_metrics and (schedule.phase(step) == "final" or step % every == 0)

        if self.distiller is not None:
            kl = self.distiller.close()
            if kl is not None and self.options.log_metrics:
                pl_module.log("pruning/distill_kl", kl, on_step=True, on_epoch=False)
        with _user_errors(ConfigurationError):  # a non-finite score is a failed run, not a configuration error
            result = self.controller.after_step(count=count)
        if result is None or self.metrics is None:
            return
        self.metrics.update(result.dropped, result.num_units, zeros=result.zeros, numel=result.numel)
        for key, metric in self.metrics.metrics.items():
            attribute = "_lightning_pat_" + key.replace("/", "_").replace(".", "_")
            pl_module.log(
                key, metric, on_step=True, on_epoch=False, prog_bar=key == self.metrics.main, metric_attribute=attribute
            )
