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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_pat import distributed as D
from lightning_pat import presets
from lightning_pat.engine import METHODS, Method, Pruner, PruneResult
from lightning_pat.executors import EXECUTOR_KINDS, ExecutorKind
from lightning_pat.metrics import PruningMetrics
from lightning_pat.schedule import Schedule
from lightning_pat.scoring import SCORE_TYPES, ScoreType
from lightning_pat.spec import Cluster, ResolvedCluster, resolve_clusters

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

Mode = Literal["latent", "direct"]
MODES: tuple[str, ...] = ("latent", "direct")
_STATE_VERSION = 1
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _check_choice(name: str, value: object, valid: Sequence[str]) -> None:
    if value not in valid:
        raise MisconfigurationException(f"`{name}` must be one of {tuple(valid)}, got {value!r}.")


def _check_number(name: str, value: object, *, low: float, high: float | None = None, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        kind = "an int" if integer else "a number"
        raise MisconfigurationException(f"`{name}` must be {kind} {span}, got {value!r}.")


class CoupledPruningCallback(Callback):
    """Drive coupled units (MLP channels, heads, GQA groups, residual channels) to exact zeros during training.

    Args:
        clusters: Cluster declarations (:class:`~lightning_pat.Cluster` objects or mappings of their fields), or a
            preset name (``"llama"``, ``"gpt2"``, ``"tiny_gpt"``, ``"linear_chain"``, or ``"auto"`` to detect the
            family).
        target_sparsity: Fraction of each cluster's units removed at the end of the ramp (clusters may override).
        warmup_steps: Optimizer steps of dense training before pruning starts.
        ramp_steps: Optimizer steps over which the target ramps up to ``target_sparsity``; 1 prunes at once.
        every_n_steps: Cadence of fresh selections during the ramp; in between, the current mask is held.
        ramp: Ramp shape, ``"cubic"`` (default) or ``"linear"``.
        heal: After the ramp, freeze the mask and keep dropped units at zero (default). If false, keep
            re-selecting at the final target every ``every_n_steps``.
        method: ``"hard"`` (drop the lowest-scoring units) or ``"group_lasso"`` (block soft-threshold during the
            ramp with strength ``reg_lambda``; the final step always applies the exact target).
        reg_lambda: Group-lasso strength ``lambda``; the threshold is ``lambda * gamma * sqrt(G)`` with ``gamma``
            the sum of learning rates since warmup.
        score: Unit score: ``"rms"`` (default), ``"l2"`` or ``"param_cost"``.
        mode: ``"latent"`` (default: the optimizer updates a dense latent copy, the model uses its projection) or
            ``"direct"`` (project the weights themselves; no extra memory).
        executor: ``"auto"`` (sharded path for eligible DTensor clusters, else materializing), ``"materializing"``
            or ``"sharded"``.
        group_count_ref: Opt-in score correction ``sqrt(C / ref)`` for clusters sharing a budget.
        preset_options: Keyword options for a preset (e.g. ``{"residual": True}``).
        log_metrics: Log sparsity through the Trainer's loggers, every ``log_every_n_steps`` optimizer steps and at
            the final ramp step (literal zeros are counted only then).

    Raises:
        MisconfigurationException: If an option is out of range or unknown (at construction), or if the clusters do
            not resolve against the model or the strategy is unsupported (at fit start, on every rank, before any
            weight is touched).

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
    ) -> None:
        _check_number("target_sparsity", target_sparsity, low=0.0, high=1.0)
        _check_number("reg_lambda", reg_lambda, low=0.0)
        _check_choice("method", method, METHODS)
        _check_choice("score", score, SCORE_TYPES)
        _check_choice("mode", mode, MODES)
        _check_choice("executor", executor, EXECUTOR_KINDS)
        if group_count_ref is not None:
            _check_number("group_count_ref", group_count_ref, low=1, integer=True)
        if method == "group_lasso" and reg_lambda == 0.0:
            raise MisconfigurationException(
                "`method='group_lasso'` needs `reg_lambda` > 0 (got 0.0); set a strength such as 1e-3 or use 'hard'."
            )
        if not isinstance(clusters, str):
            if not isinstance(clusters, Sequence) or not clusters:
                raise MisconfigurationException(
                    f"`clusters` must be a preset name or a non-empty list of Cluster declarations, got {clusters!r}."
                )
            clusters = [c if isinstance(c, Cluster) else Cluster(**c) for c in clusters]
        try:
            self.schedule = Schedule(
                warmup_steps=warmup_steps, ramp_steps=ramp_steps, every_n_steps=every_n_steps, shape=ramp
            )
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        self.clusters = clusters
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

        self.pruner: Pruner | None = None
        self.resolved: list[ResolvedCluster] = []
        self.metrics: PruningMetrics | None = None
        self._step = 0  # completed real optimizer steps
        self._gamma = 0.0  # sum of learning rates since warmup
        self._latents: dict[str, Tensor] = {}
        self._swapped: set[str] = set()
        self._stepped = False
        self._last_lr: float | None = None
        self._hooks: list[Any] = []
        self._pending_state: dict[str, Any] | None = None
        self._params: dict[str, Tensor] = {}
        self._latent_names: list[str] = []
        self._fsdp1_root: torch.nn.Module | None = None

    # ------------------------------------------------------------------ identity and state
    @property
    @override
    def state_key(self) -> str:
        """Identity of this callback in a checkpoint."""
        name = self.clusters if isinstance(self.clusters, str) else ",".join(c.name for c in self.clusters)
        return self._generate_state_key(clusters=name, target_sparsity=self.target_sparsity)

    @property
    def step(self) -> int:
        """Completed real optimizer steps seen by the schedule."""
        return self._step

    @property
    def dropped(self) -> dict[str, list[int]]:
        """Cluster name -> sorted dropped unit indices of the current mask."""
        return {} if self.pruner is None else {rc.name: self.pruner.dropped(rc.name) for rc in self.pruner.clusters}

    def targets(self, step: int) -> dict[str, float]:
        """Per-cluster target fraction in force after optimizer step ``step``."""
        frac = self.schedule.fraction(step)
        return {rc.name: frac * (self.target_sparsity if rc.target is None else rc.target) for rc in self.resolved}

    @override
    def state_dict(self) -> dict[str, Any]:
        """Plain-typed state: step, gamma, current mask and cluster fingerprints."""
        return {
            "version": _STATE_VERSION,
            "step": self._step,
            "gamma": self._gamma,
            "dropped": self.dropped,
            "fingerprints": {rc.name: rc.fingerprint() for rc in self.resolved},
            "clusters": [rc.to_dict() for rc in self.resolved],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stash the state; it is applied in ``on_train_start`` once the model and clusters exist."""
        self._pending_state = dict(state_dict)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Reject strategies that cannot be supported (before any step): DeepSpeed."""
        name = type(trainer.strategy).__name__
        if "DeepSpeed" in name:
            raise MisconfigurationException(
                f"CoupledPruningCallback does not support {name}: DeepSpeed partitions parameters into flat buffers "
                "that have no per-tensor structure. Use strategy='ddp', or ModelParallelStrategy with fully_shard."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve clusters against the final (possibly sharded) parameters and route them to executors."""
        self._fsdp1_root = trainer.strategy.model if isinstance(trainer.strategy, FSDPStrategy) else None
        self._params = dict(pl_module.named_parameters(remove_duplicate=False))
        with self._weights(pl_module) as params:
            declarations = self._declarations(pl_module)
            try:
                self.resolved = resolve_clusters(params, declarations)
                self.pruner = Pruner(
                    params,
                    self.resolved,
                    score=self.score,
                    executor=self.executor,
                    group_count_ref=self.group_count_ref,
                )
            except ValueError as err:
                raise MisconfigurationException(f"CoupledPruningCallback: {err}") from err
        clustered = {n for rc in self.resolved for n in rc.param_names}
        # FSDP1 keeps parameters in flat shards between steps: the latent is a copy of every local shard.
        self._latent_names = list(self._params) if self._fsdp1_root is not None else sorted(clustered)
        self.metrics = PruningMetrics([rc.name for rc in self.pruner.clusters])
        self._log_routes()
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_stepped))

    @contextmanager
    def _weights(self, pl_module: pl.LightningModule) -> Iterator[dict[str, Tensor]]:
        """The parameters the engine works on: the live ones, or FSDP1's summoned full ones (written back on exit)."""
        if self._fsdp1_root is None:
            yield self._params
            return
        with D.summon_full_params(self._fsdp1_root):
            params = {_clean_name(n): p for n, p in pl_module.named_parameters(remove_duplicate=False)}
            if self.pruner is not None:
                self.pruner.rebind(params)
            yield params

    def _declarations(self, pl_module: pl.LightningModule) -> list[Cluster]:
        if not isinstance(self.clusters, str):
            return list(self.clusters)
        try:
            return presets.resolve_preset(self.clusters, pl_module, **self.preset_options)
        except ValueError as err:
            raise MisconfigurationException(f"CoupledPruningCallback: {err}") from err

    def _log_routes(self) -> None:
        assert self.pruner is not None
        lines = [f"  {name}: {kind} ({reason})" for name, (kind, reason) in self.pruner.routes.items()]
        rank_zero_info(f"CoupledPruningCallback routes {len(lines)} cluster(s):\n" + "\n".join(lines))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply a restored state (after checkpoint restore under every strategy)."""
        if self._pending_state is None or self.pruner is None:
            return
        state, self._pending_state = self._pending_state, None
        saved = state.get("fingerprints", {})
        current = {rc.name: rc.fingerprint() for rc in self.resolved}
        if saved and saved != current:
            changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
            raise MisconfigurationException(
                f"CoupledPruningCallback: the checkpoint was written for different clusters ({changed[:5]} differ); "
                "resume with the same cluster declarations and model, or start a new run."
            )
        self._step = int(state.get("step", 0))
        self._gamma = float(state.get("gamma", 0.0))
        self.pruner.load_dropped(state.get("dropped", {}))
        with torch.no_grad(), self._weights(pl_module):
            self.pruner.hold()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove optimizer hooks and free latent copies."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._latents.clear()

    # ------------------------------------------------------------------ per step
    def _on_optimizer_stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._stepped = True
        for group in optimizer.param_groups:
            if "lr" in group:
                self._last_lr = float(group["lr"])
                break

    def _latent_active(self, step: int) -> bool:
        phase = self.schedule.phase(step)
        return self.mode == "latent" and (phase in ("ramp", "final") or (phase == "healing" and not self.heal))

    def _healing(self, step: int) -> bool:
        return self.heal and self.schedule.phase(step) == "healing"

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """After the backward: swap latents in (latent mode) or zero dropped gradients (healing)."""
        if self.pruner is None:
            return
        upcoming = self._step + 1
        with torch.no_grad():
            if self._healing(upcoming):
                if self._fsdp1_root is None:  # FSDP1: grads live in flat shards; the weights are re-zeroed after
                    self.pruner.zero_grads()
            elif self._latents and self._latent_active(upcoming):
                in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
                for name, latent in self._latents.items():
                    param = self._params[name]
                    if id(param) in in_optimizer:
                        D.local_tensor(param).copy_(latent)
                        self._swapped.add(name)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a real optimizer step: advance the schedule and project."""
        if self.pruner is None:
            return
        stepped, self._stepped = self._stepped, False
        with torch.no_grad():
            if not stepped:
                if self._swapped:  # the scaler skipped the step: show the projection again
                    self._restore_latents()
                    with self._weights(pl_module):
                        self.pruner.hold(rescale=self.mode == "latent")
                return
            self._step += 1
            step = self._step
            phase = self.schedule.phase(step)
            if phase == "warmup":
                return
            self._gamma += self._last_lr or 0.0
            count = self._should_count(trainer, phase)
            if not self._healing(step):
                self._restore_latents()
            with self._weights(pl_module):
                if self._healing(step):
                    self.pruner.hold()
                else:
                    self._project(fresh=self._is_due(step))
                # logging (and counting literal zeros, a collective when sharded) only on the logging cadence
                result = self.pruner.result(count=True) if count else None
            if phase == "final" and self.heal:
                self._latents.clear()  # the mask is frozen from here on
            if result is not None:
                self._log(pl_module, result)

    def _is_due(self, step: int) -> bool:
        if self.schedule.phase(step) == "healing":  # heal=False: keep re-selecting on cadence
            return (step - self.schedule.final_step) % self.schedule.every_n_steps == 0
        return self.schedule.is_due(step)

    def _restore_latents(self) -> None:
        """Latent mode: save the updated latents and put every latent back into the (live) weights."""
        if self.mode != "latent":
            return
        if not self._latents:
            self._latents = {n: D.local_tensor(self._params[n]).clone() for n in self._latent_names}
        for name, latent in self._latents.items():
            local = D.local_tensor(self._params[name])
            if name in self._swapped:
                latent.copy_(local)
            else:
                local.copy_(latent)
        self._swapped.clear()

    def _project(self, *, fresh: bool) -> None:
        """Apply a fresh projection, or re-apply the current one (on the weights the engine is bound to)."""
        assert self.pruner is not None
        if not fresh:
            self.pruner.hold(rescale=self.mode == "latent")
            return
        final = self.schedule.phase(self._step) in ("final", "healing")
        method: Method = "hard" if final else self.method
        targets = self.targets(self._step)
        if method == "group_lasso":
            targets = dict.fromkeys(targets, 0.0)
        self.pruner.step(targets, method=method, threshold=self.reg_lambda * self._gamma)

    def _should_count(self, trainer: pl.Trainer, phase: str) -> bool:
        if not self.log_metrics:
            return False
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        return phase == "final" or self._step % every == 0

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
        return dict(self._latents)
