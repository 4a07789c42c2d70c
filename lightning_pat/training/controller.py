"""The training controller: what happens to the weights around each real optimizer step (no Lightning here).

:class:`PruningController` owns the progress counters, the real-step tracker, the latent copies, the pruner, the
data-aware scorers (:class:`~lightning_pat.training.collectors.Collectors`) and the freeze transition. A training
loop (the callback, or any loop of your own) calls:

* :meth:`~PruningController.bind` once the model and optimizers are final: resolve the clusters, agree across
  ranks, route them to executors (nothing is mutated);
* :meth:`~PruningController.start` before the first step: continue a saved or carried state, or begin at step 0;
* :meth:`~PruningController.after_backward` between the backward and the update: swap the latents in (latent mode)
  or zero the dropped units' gradients (healing);
* :meth:`~PruningController.after_step` after the batch: if a real optimizer step happened, advance the schedule
  and act (select, hold or freeze; shrink at the freeze with ``shrink_on_freeze``); returns the result to log;
* :meth:`~PruningController.state_dict` / :meth:`~PruningController.load_state_dict` (the ``state`` schema).

Around them, for a trainer with fit-level events (the callback): :meth:`~PruningController.begin_fit` (decide
between a restored state, the same trainer's previous fit and a new schedule), :meth:`~PruningController.before_batch`
(re-project after weight averaging; open the distillation window), :meth:`~PruningController.end_fit`,
:meth:`~PruningController.reproject_after_averaging` and :meth:`~PruningController.before_restore` (a checkpoint of a
shrunk model). With ``distill_alpha > 0`` the controller owns the :class:`~lightning_pat.training.distill.Distiller`.

Timing (``pat-algorithm.md`` §10): under automatic optimization the forward and backward run inside
``optimizer.step(closure)``, so nothing here restores dense weights before that forward: the model always trains the
projected weights, and the latent is swapped in only after the backward. Errors are ``ValueError`` naming the option
or cluster; the callback turns them into ``MisconfigurationException``.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.saved_state import DISTILL, is_shrunk, saved_score, split_distill
from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import Cluster, ResolvedCluster
from lightning_pat.discovery import outcome_from_json, outcome_to_json
from lightning_pat.engine import Plan, Pruner, PruneResult, make_plan
from lightning_pat.options import PruningOptions
from lightning_pat.parallel import distributed, fsdp1
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.layers import LayerStats, layer_clusters
from lightning_pat.scoring.taylor import TaylorScores
from lightning_pat.shrink import check_shrinkable, restore_shrunk, shrink_for_training
from lightning_pat.shrink.plan import read_saved
from lightning_pat.sizing.problem import SizeSolution
from lightning_pat.training import state, teacher_file
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.distill import Distiller
from lightning_pat.training.latent import LatentStore

log = logging.getLogger(__name__)


class ConfigurationError(ValueError):
    """A ``ValueError`` during training that the run's configuration caused (the callback reports it as such)."""


@contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` of the enclosed code as ``ConfigurationError(f"{prefix}: {error}")``.

    Raises:
        ConfigurationError: If the enclosed code raises a ``ValueError``.
    """
    try:
        yield
    except ValueError as err:
        raise ConfigurationError(f"{prefix}: {err}") from err


class StepTracker:
    """Whether a real optimizer step happened since the last batch end (not on accumulation or AMP-skipped steps)."""

    def __init__(self) -> None:
        self.stepped = False
        self.last_lr: float | None = None
        self._hooks: list[Any] = []

    def attach(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Watch ``optimizers`` through step post-hooks (replacing earlier ones)."""
        self.detach()
        self._hooks = [opt.register_step_post_hook(self._on_step) for opt in optimizers]

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.stepped = True
        self.last_lr = next((float(g["lr"]) for g in optimizer.param_groups if "lr" in g), self.last_lr)

    def consume(self) -> bool:
        """Whether a step happened since the last call."""
        stepped, self.stepped = self.stepped, False
        return stepped


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
        #: The score in use: ``options.score``, or what ``"auto"`` resolved to (``"auto"`` until :meth:`bind`)
        self.score: str = options.score
        self._fallback: str | None = None  # why score="auto" fell back to "rms" for these clusters
        self._info = info or (lambda message: distributed.rank_zero_info(message, logger=log))
        self.schedule = options.schedule
        self.progress = state.Progress()
        self.tracker = StepTracker()
        self.plan: Plan | None = None
        self.pruner: Pruner | None = None
        self.resolved: list[ResolvedCluster] = []
        self.latents: LatentStore | None = None
        self.scorers = Collectors()  # the data-aware scores in use (activation, taylor, layer cosines)
        self.shrunk: dict[str, list[int]] | None = None  # the dropped units, once the model has been shrunk
        self.size: SizeSolution | None = None  # target_params: the solved widths and the achieved count
        self._module: nn.Module | None = None
        self._optimizers: Sequence[torch.optim.Optimizer] = ()
        self._params: dict[str, Tensor] = {}
        self._fsdp1_root: nn.Module | None = None
        self._sharded_ckpt = False
        self._carry: dict[str, Any] | None = None  # in-memory state kept for the next fit (see finish_fit)
        self._pending: dict[str, Any] | None = None  # a loaded state, applied by the next start()
        self._early: list[Cluster] | ValueError | None = None  # clusters="auto" traced before sharding (see prepare)
        self.distiller = (
            Distiller(
                alpha=options.distill_alpha,
                temperature=options.distill_temperature,
                teacher=options.distill_teacher,
                error=forward_error,
                store=options.distill_teacher_store,
            )  # fmt: skip
            if options.distill
            else None
        )
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
    def act(self) -> ActivationStats | None:
        """The readers' input statistics (``score="activation"``), else ``None``."""
        return self.scorers.act

    @property
    def taylor(self) -> TaylorScores | None:
        """The sums of ``|w * g|`` since the last selection (``score="taylor"``), else ``None``."""
        return self.scorers.taylor

    @property
    def layer_stats(self) -> LayerStats | None:
        """The layer units' ``1 - cos(input, output)`` sums (``layer_score="cosine"``), else ``None``."""
        return self.scorers.layers

    @property
    def teacher(self) -> nn.Module | None:
        """The distillation teacher (``None`` without distillation, or before pruning starts with a copied one)."""
        return None if self.distiller is None else self.distiller.teacher

    def counts_at(self, step: int, *, every: int) -> bool:
        """Whether the result after ``step`` is logged (counted): every ``every`` steps and at the final ramp step."""
        return self.options.log_metrics and (self.schedule.phase(step) == "final" or step % max(every, 1) == 0)

    def targets(self, step: int) -> dict[str, float]:
        """Per-cluster target fraction in force after optimizer step ``step``."""
        if self.plan is None:
            return {}
        return self.plan.targets(self.options.target_sparsity, fraction=self.schedule.fraction(step))

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
        if batch_input is None:
            self._early = None
            return
        # rank 0 traces; the others take its declarations (JSON bytes in one broadcast, no pickle)
        mine = None
        if distributed.world_rank() == 0:
            try:
                mine = self.options.early_declarations(module, batch_input)
            except Exception as err:  # noqa: BLE001 - the other ranks wait in the broadcast: send any error to them
                mine = ValueError(f"clusters='auto': discovery failed on rank 0 ({type(err).__name__}: {err})")
        group = distributed.world_group()
        self._early = outcome_from_json(distributed.broadcast_json(outcome_to_json(mine), group=group))

    def _declarations(self, module: nn.Module) -> list[Cluster]:
        if isinstance(self._early, ValueError):  # discovery failed in setup: every rank raises it in bind
            raise self._early
        return self._early or self.options.declarations(module)

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
                disagree; if
                ``score="activation"`` readers are not ``nn.Linear`` weights; if ``shrink_on_freeze`` could not
                shrink the model.
            Exception: ``forward_error`` if ``distill_module`` names no submodule.
        """
        self._bind(module, optimizers=optimizers, fsdp1_root=fsdp1_root, sharded_ckpt=sharded_ckpt)
        if self.distiller is not None:
            self.distiller.bind(module, self.options.distill_module, accumulate=accumulate, sharded_ckpt=sharded_ckpt)

    def _bind(
        self,
        module: nn.Module,
        *,
        optimizers: Sequence[torch.optim.Optimizer],
        fsdp1_root: nn.Module | None,
        sharded_ckpt: bool,
    ) -> None:
        self._module, self._optimizers = module, list(optimizers)
        self._fsdp1_root, self._sharded_ckpt = fsdp1_root, sharded_ckpt
        self._params = dict(module.named_parameters(remove_duplicate=False))
        self.tracker.attach(self._optimizers)
        if self.shrunk is not None:  # the model was shrunk: nothing is left to prune, only steps to count
            self.plan, self.pruner, self.latents, self.scorers = None, None, None, Collectors()
            return
        opts = self.options
        self.score = opts.score if opts.score != "auto" else ("rms" if fsdp1_root is not None else "activation")
        with self._weights() as params:
            plan, error = None, None
            try:
                declarations = self._declarations(module)
                plan = make_plan(
                    params, declarations, score=self.score, executor=opts.executor,
                    group_count_ref=opts.group_count_ref,
                    sparsity=opts.target_sparsity if opts.size_target is None else None,  # else: checked when sized
                )  # fmt: skip
                if opts.size_target is not None:
                    plan, self.size = plan.sized(
                        params, opts.size_target, side=opts.target_side, declarations=declarations,
                        keep_layers=opts.target_layers, widths=opts.target_widths, min_kept=opts.min_kept,
                        flops=None if opts.target_flops is None else (module, int(opts.seq_len or 0)),
                    )  # fmt: skip
            except ValueError as err:
                error = f"CoupledPruningCallback: {err}"
            digest = {
                "clusters": None if plan is None else [rc.fingerprint() for rc in plan.clusters],
                "routes": None if plan is None else plan.routes,
                "options": opts.resumable(),
            }
            distributed.check_rank_agreement(digest, error)
            assert plan is not None
            self.plan, self.resolved = plan, list(plan.clusters)
            self._use_score(self.score, params)
            layers = layer_clusters(self.resolved)
            if layers and opts.layer_score == "cosine":
                with prefixed("CoupledPruningCallback(layer_score='cosine')"):
                    self.scorers.layers = LayerStats(module, layers)
            if opts.shrink_on_freeze:  # refuse now what the shrink at the final step could not rewrite
                with prefixed("CoupledPruningCallback(shrink_on_freeze=True)"):
                    check_shrinkable(module, self.resolved)
                    if any(is_layer_cluster(rc) for rc in self.resolved):
                        raise ValueError(
                            "layer units (preset_options={'layers': True}) are removed by `lightning_pat.shrink` "
                            "after fit, not during training; use shrink_on_freeze=False."
                        )
        clustered = sorted({n for rc in self.resolved for n in rc.param_names})
        # FSDP1 keeps parameters in flat shards between steps: the latent is a copy of every local shard.
        self.latents = LatentStore(self._params, list(self._params) if fsdp1_root is not None else clustered)
        _warn_unoptimized(self._params, clustered, optimizers)
        if self.size is not None:
            which = "target_params" if opts.target_flops is None else "target_flops"
            self._info(f"CoupledPruningCallback {which}: {self.size.describe()}")
        if opts.score == "auto":
            self._info(f"CoupledPruningCallback: score='auto' scores units by {self.score!r} ({self._why_score()}).")
        lines = [f"  {name}: {kind} ({reason})" for name, (kind, reason) in plan.routes.items()]
        self._info(f"CoupledPruningCallback routes {len(lines)} cluster(s):\n" + "\n".join(lines))

    def _use_score(self, score: str, params: Mapping[str, Tensor]) -> None:
        """Build the pruner and the score's collectors for ``score``; ``"auto"`` falls back to ``"rms"`` if needed.

        ``score="auto"`` is ``"activation"`` wherever its statistics can score the clusters, else ``"rms"``: under
        FSDP1 (decided in :meth:`bind`) and for clusters without an ``nn.Linear`` reader (e.g. convolutions).

        Raises:
            ValueError: If an explicit ``score="activation"`` cannot score the clusters (no ``nn.Linear`` reader).
        """
        assert self.plan is not None
        assert self._module is not None
        self.scorers.act, self.scorers.taylor, self._fallback = None, None, None
        if score == "activation" and len(layer_clusters(self.resolved)) < len(self.resolved):  # layers: scored apart
            try:
                with prefixed("CoupledPruningCallback(score='activation')"):
                    self.scorers.act = ActivationStats(self._module, self.resolved)
            except ValueError as err:
                if self.options.score != "auto":
                    raise
                score, self._fallback = "rms", str(err)
        self.score = score
        if self.plan.score != score:
            self.plan = dataclasses.replace(self.plan, score=score)
        self.pruner = Pruner(params, self.plan)
        if score == "taylor":
            with prefixed("CoupledPruningCallback(score='taylor')"):
                self.scorers.taylor = TaylorScores(self.pruner.executors)

    def _why_score(self) -> str:
        """Why ``score="auto"`` uses :attr:`score` (for the log)."""
        if self.score == "activation":
            return "the readers' input statistics, collected in training forwards; pass score='rms' for the weights"
        if self._fallback is not None:
            return f"the activation score cannot score these clusters: {self._fallback}"
        return "the activation score does not run under FSDPStrategy (FSDP1)"

    def _resumable(self) -> dict[str, Any]:
        """The options saved with the state, with the score in use (``"auto"`` resolved)."""
        return {**self.options.resumable(), "score": self.score}

    @contextmanager
    def _weights(self) -> Iterator[dict[str, Tensor]]:
        """The parameters the engine works on: the live ones, or FSDP1's summoned full ones (written back on exit)."""
        if self._fsdp1_root is None:
            yield self._params
            return
        assert self._module is not None
        with fsdp1.summoned_params(self._fsdp1_root, self._module) as params:
            if self.pruner is not None:
                self.pruner.rebind(params)
            yield params

    # ------------------------------------------------------------------ start and end of a fit
    @property
    def restoring(self) -> bool:
        """Whether a loaded state waits for :meth:`start`."""
        return self._pending is not None

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
                (see :mod:`lightning_pat.core.state_schema`: a field of the wrong type or out of range, unknown
                names, other shapes or dtypes) or this run, its dropped units are not zero in the restored weights,
                or it cannot be continued exactly (other clusters, options that cannot take effect, missing
                latents); if the mask is empty after the final ramp step although the target requires dropped units.
        """
        restored, self._pending = self._pending, None
        if self.shrunk is not None:  # shrunk (before the restore, or by an earlier fit): count steps
            if restored is not None:
                state.check_saved(restored, state.restore_context(global_step=global_step))
            saved = restored or self._carry or {}
            self.progress.step = int(saved.get("step", self.progress.step))
            self.progress.gamma = float(saved.get("gamma", self.progress.gamma))
            self._carry = None
            return
        assert self.pruner is not None
        assert self.plan is not None
        if restored is not None:
            self._restore(restored, ckpt_path=ckpt_path, global_step=global_step)
        elif carry and self._carry is not None:
            self._apply(self._carry, latents=self._carry["latents"]["tensors"] if self._carry["latents"] else None)
        else:
            if self._carry is not None:
                self._info("CoupledPruningCallback: a fresh Trainer starts a new pruning schedule at step 0.")
            self.progress = state.Progress()
            self.scorers.reset()
        self._carry = None
        self._check_mask_not_empty()
        if not self.frozen:
            self.scorers.attach()  # removed at the freeze and at the end of the fit

    def _restore(self, saved: Mapping[str, Any], *, ckpt_path: Any, global_step: int | None) -> None:
        opts = self.options
        kept = saved_score(saved)
        runs = not (kept == "activation" and self._fsdp1_root is not None)
        if opts.score == "auto" and kept in ("rms", "activation") and kept != self.score and runs:
            with self._weights() as params:  # "auto" continues the score the checkpoint was written with
                self._use_score(kept, params)
            self._info(f"CoupledPruningCallback: score='auto' continues the checkpoint's score {self.score!r}.")
        assert self.latents is not None
        context = state.restore_context(
            global_step=global_step, clusters=self.resolved, params=self._params, latent_names=self.latents.names,
            **self.scorers.saved_shapes(),
        )  # fmt: skip
        needs_latents = False
        with distributed.together():  # local checks; a rank-local failure (a latent's local shape) stops every rank
            needs_latents = state.check_restorable(
                saved,
                fingerprints={rc.name: rc.fingerprint() for rc in self.resolved},
                options=self._resumable(),
                schedule=self.schedule,
                latent_mode=opts.mode == "latent",
                heal=opts.heal,
                context=context,
            )
        self._check_dropped_are_zero(saved["dropped"])
        entry = saved.get("latents")
        latents = state.read_latents(entry, self._params, ckpt_path=ckpt_path) if needs_latents and entry else None
        self._apply(saved, latents=latents)

    def _apply(self, saved: Mapping[str, Any], *, latents: Mapping[str, Tensor] | None) -> None:
        """Set progress, mask, latents and activation statistics from a state; project the weights."""
        assert self.pruner is not None
        assert self.latents is not None
        self.progress = state.Progress.from_state(saved)
        self.pruner.load_dropped(saved.get("dropped", {}), saved.get("factors", {}))
        if latents is None:
            self.latents.clear()
        else:
            self.latents.load_state_dict(latents)
        self.scorers.load(saved, errors=prefixed)  # none saved (e.g. the score changed on resume): from here on
        with torch.no_grad(), self._weights():
            self.pruner.hold()

    def _check_dropped_are_zero(self, dropped: Mapping[str, Sequence[int]]) -> None:
        """A restored mask must be the one the restored weights carry: its dropped units exactly zero.

        One reduction of the unit norms (the executors' own, identical on every rank), so every rank raises together.

        Raises:
            ValueError: Naming the clusters whose dropped units are not zero in the weights.
        """
        assert self.pruner is not None
        with torch.no_grad(), self._weights():
            norms = self.pruner.unit_sq_norms()
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

    def _check_mask_not_empty(self) -> None:
        """Never heal with an empty mask where the final target requires dropped units."""
        assert self.plan is not None
        assert self.pruner is not None
        if not self.frozen:
            return
        targets = self.plan.targets(self.options.target_sparsity)
        dropped = self.pruner.result().dropped
        empty = [
            rc.name for rc in self.plan.clusters if not dropped[rc.name] and num_to_drop(targets[rc.name], rc.num_units)
        ]
        if empty:
            raise ValueError(
                f"CoupledPruningCallback: at step {self.progress.step} (after the final ramp step) clusters "
                f"{empty[:5]} have no dropped units although the target requires some; refusing to heal with an empty "
                "mask. Resume from a checkpoint of this run, or start a new run with a fresh Trainer."
            )

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
            ValueError: As for :meth:`start`; on every rank, if the teacher file's directories cannot hold it
                (:func:`~lightning_pat.training.teacher_file.check_directories`), a restored teacher does not fit the
                model, or a restored state's teacher file cannot be read or checked (see
                :meth:`~lightning_pat.training.distill.Distiller.restore_file`).
        """
        last = self._last_fit
        carry = last is not None and last[0]() is owner and last[1] == global_step
        if not self.restoring and not carry and global_step > 0 and self.shrunk is None:
            raise ConfigurationError(
                f"CoupledPruningCallback: the fit resumes at global step {global_step} from {ckpt_path!r}, which "
                f"holds no state under this callback's key {key!r} (the cluster declaration names identify it). "
                "Resume with the same cluster names, or, to start pruning from trained weights, load them into the "
                "module and fit with a fresh Trainer without `ckpt_path`."
            )
        if self.distiller is not None and not self.restoring and not carry:
            self.distiller.reset()  # a new schedule: a new teacher when pruning starts
        if self.distiller is not None:
            self._check_teacher(teacher_dirs)
        if self.distiller is not None and self.restoring:
            self._restore_teacher_file(ckpt_path, teacher_dirs)
        self.start(carry=carry, ckpt_path=ckpt_path, global_step=global_step)
        if self.shrunk is None:
            self.warn_short_fit(steps_left - global_step)

    def _check_teacher(self, directories: Sequence[str]) -> None:
        """At fit start, on every rank: the teacher file's directories are usable and a saved teacher fits the model.

        One agreement collective: if one rank fails, every rank raises.
        """
        assert self.distiller is not None
        with distributed.together("CoupledPruningCallback"):
            if self.options.distill_teacher_store == "file" and self.options.distill_teacher is None:
                teacher_file.check_directories(directories)
            self.distiller.check_saved()

    def _restore_teacher_file(self, ckpt_path: Any, directories: Sequence[str]) -> None:
        """Read and check a restored teacher file on every rank; if one rank fails, every rank raises (a collective)."""
        assert self.distiller is not None
        if not teacher_file.is_file_entry(self.distiller.saved):
            return
        where = [] if ckpt_path is None else [str(Path(ckpt_path).parent)]
        with distributed.together("CoupledPruningCallback"):
            self.distiller.restore_file(directories=[*where, *directories])

    def write_teacher(self, directories: Sequence[str]) -> None:
        """After a checkpoint save: write the teacher file (``distill_teacher_store="file"``) into ``directories``."""
        if self.distiller is not None:
            self.distiller.write_file(directories)

    def end_fit(self, *, owner: object, global_step: int) -> None:
        """A fit of ``owner`` ended at ``global_step``: keep what its next fit continues from (:meth:`finish_fit`)."""
        self._last_fit = (weakref.ref(owner), global_step)
        self.finish_fit()

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

    def warn_short_fit(self, steps_left: float) -> None:
        """Warn when a fit of ``steps_left`` more steps ends before the final ramp step (the target is never met)."""
        if steps_left == float("inf"):
            return
        schedule, end = self.schedule, self.progress.step + int(steps_left)
        if end < schedule.final_step:
            distributed.rank_zero_warn(
                f"CoupledPruningCallback: this fit ends after optimizer step {end}, before the final ramp step "
                f"{schedule.final_step} (warmup {schedule.warmup_steps} + ramp {schedule.ramp_steps}); the mask will "
                f"only reach {schedule.fraction(end):.0%} of the target and is not frozen. Raise max_steps/max_epochs "
                "or shorten the schedule."
            )

    def finish_fit(self) -> None:
        """Keep what a next :meth:`start` with ``carry=True`` continues from (this rank's own; no collective)."""
        self.release()
        if self.shrunk is not None:
            self._carry = self.progress.state_dict()  # only the step count goes on
            return
        assert self.pruner is not None
        latents = self.latents if self.latents is not None and self.latents.active else None
        entry = None if latents is None else state.latent_entry(latents.state_dict(), self._params, fmt="local")
        # this rank's own statistics at every index: each rank reads its own
        self._carry = self._state(latents=entry, scorers=self.scorers.state_dicts(gather=False))

    def release(self) -> None:
        """Remove the optimizer, scorer and distillation hooks (the state for a next fit is kept)."""
        self.tracker.detach()
        self.scorers.detach()
        if self.distiller is not None:
            self.distiller.release()

    # ------------------------------------------------------------------ per step
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
        with torch.no_grad():
            if action == "freeze":
                if self._fsdp1_root is None:  # FSDP1: grads live in flat shards; the weights are re-zeroed after
                    self.pruner.zero_grads()
            elif action != "none" and self.latents.active:
                self.latents.swap_in({id(p) for g in optimizer.param_groups for p in g["params"]})
            if self.scorers.taylor is not None and action != "freeze":  # the weights this update applies to
                self.scorers.taylor.observe()

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
        self.scorers.batch_open(False)
        stepped = self.tracker.consume()
        taylor = self.scorers.taylor
        if taylor is not None:  # only a real step's gradient counts (not an AMP-skipped one)
            taylor.commit() if stepped else taylor.discard()
        if self.shrunk is not None:  # healing on the shrunk model: the dropped units no longer exist
            if stepped:
                self.progress.tick()
                self.progress.add_lr(self.tracker.last_lr)
            return None
        if self.pruner is None or self.latents is None:
            return None
        latent = self.options.mode == "latent"
        with torch.no_grad():
            if not stepped:
                if self.latents.swapped:  # the scaler skipped the step: show the projection again
                    self.latents.commit()
                    with self._weights():
                        self.pruner.hold(rescale=latent)
                return None
            step = self.progress.tick()
            action = self.schedule.action(step, heal=self.options.heal)
            if action == "none":
                return None
            self.progress.add_lr(self.tracker.last_lr)
            if latent and action != "freeze":
                self.latents.commit()
            counted = count(step) if callable(count) else count
            with self._weights():
                if action == "select":
                    result = self._select(step, count=counted)
                else:
                    self.pruner.hold(rescale=latent and action == "hold")
                    result = self.pruner.result(count=True) if counted else None
            if self.schedule.freezes(step, heal=self.options.heal):
                self._freeze()
        return result

    def reproject(self) -> None:
        """Zero the dropped units again, e.g. after another callback copied averaged weights into the model."""
        if self.pruner is None or self.shrunk is not None:
            return
        with torch.no_grad(), self._weights():
            self.pruner.hold()

    def _select(self, step: int, *, count: bool) -> PruneResult:
        """A fresh selection at this step's targets (the final step always applies the exact hard target)."""
        assert self.pruner is not None
        opts = self.options
        method = "hard" if self.schedule.phase(step) in ("final", "healing") else opts.method
        scores = None
        if self.scorers.layers is not None:
            with prefixed("CoupledPruningCallback(layer_score='cosine')"):
                scores = self.scorers.layers.summed_scores()  # one collective when distributed
            if scores is None:
                distributed.rank_zero_warn(
                    f"CoupledPruningCallback: no layer saw a training forward before the selection at step {step}; "
                    "the layer units are ranked by the weight score (layer_score='weight') this time."
                )
        if scores is None and self.score == "activation" and self.scorers.act is None:  # only layer units: weights
            scores = {}
        threshold = opts.reg_lambda * self.progress.prox_step(latent=opts.mode == "latent")
        # a data-aware score's partials travel in the executors' one reduction (DDP: one sum of the statistics)
        used = repr(self.score) if opts.score != "auto" else f"'auto' -> {self.score!r}"
        with prefixed(f"CoupledPruningCallback(score={used})"):
            result = self.pruner.step(
                self.targets(step),
                method=method,
                threshold=threshold,
                count=count,
                scores=scores,
                evidence=self.scorers.evidence,
            )
        if self.scorers.taylor is not None:
            self.scorers.taylor.reset()  # the next selection sums the steps from here
        self.progress.mark_selection()
        if opts.debug_check_selection:  # the mask the pruner holds now, whatever produced it
            distributed.check_selection_agreement(self.dropped, step=step)
        return result

    def _freeze(self) -> None:
        """The mask is final: free the latents, stop collecting statistics, and shrink if asked to."""
        assert self.latents is not None
        self.latents.clear()
        self.scorers.detach()  # no per-forward cost during healing
        if not self.options.shrink_on_freeze:
            return
        assert self._module is not None
        dropped = self.dropped
        with prefixed("CoupledPruningCallback(shrink_on_freeze=True)"):
            shrink_for_training(self._module, self.resolved, dropped, optimizers=self._optimizers)
        self.shrunk, self.plan, self.pruner, self.latents, self.scorers = dropped, None, None, None, Collectors()
        self._info(
            f"CoupledPruningCallback: shrunk the model at step {self.progress.step} to "
            f"{sum(p.numel() for p in self._module.parameters()):,} parameters; healing runs on the small model."
        )

    # ------------------------------------------------------------------ state
    def _latent_format(self) -> str:
        return state.latent_format(
            self._params.values(), fsdp1=self._fsdp1_root is not None, sharded_ckpt=self._sharded_ckpt
        )

    def _state(self, *, latents: dict[str, Any] | None, scorers: Mapping[str, list[Any] | None]) -> dict[str, Any]:
        """A state from the latents' entry and the scorers' (``activation``, ``taylor``, ``layer_scores``)."""
        return state.build(
            self.progress,
            dropped=self.dropped,
            factors={} if self.pruner is None else self.pruner.factors(),
            clusters=self.resolved,
            options=self._resumable(),
            latents=latents,
            shrunk=self.shrunk is not None,
            **scorers,
        )

    def state_dict(self) -> dict[str, Any]:
        """The state (see :mod:`lightning_pat.training.state`); a collective where latents or statistics are gathered.

        Every rank must call this: FSDP1 latents, full DTensor latents and the activation statistics are gathered.
        """
        latents = None
        if self.latents is not None and self.latents.active:
            latents = state.latent_entry(self.latents.state_dict(), self._params, fmt=self._latent_format())
        saved = self._state(latents=latents, scorers=self.scorers.state_dicts())  # every rank's statistics: collective
        if self.distiller is not None:
            saved[DISTILL] = self.distiller.state_dict()
        return saved

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Keep a state (see :meth:`state_dict`); :meth:`start` checks and applies it once the model is bound.

        Raises:
            ValueError: If ``saved`` is not a mapping.
        """
        if not isinstance(saved, Mapping):
            raise ConfigurationError(
                f"{state.WHAT} must be a mapping, got {type(saved).__name__}; the checkpoint was edited or is not one "
                "of lightning_pat's."
            )
        pending, distill = split_distill(saved)
        if self.distiller is not None:
            self.distiller.load_state_dict(distill or {})
        self._pending = pending

    def sharded_latents(self) -> dict[str, Tensor]:
        """For a distributed checkpoint: the latents and a sharded teacher as model-state entries, else ``{}``."""
        entries = {} if self.distiller is None else self.distiller.sharded_state()
        if self.latents is None or not self.latents.active or self._latent_format() != "dcp":
            return entries
        return {**state.sharded_latents(self.latents.state_dict(), self._params), **entries}

    def teacher_bytes(self) -> Tensor:
        """This rank's bytes of the distillation teacher (float64 scalar; 0 without a teacher)."""
        size = 0 if self.distiller is None else self.distiller.teacher_bytes
        return torch.tensor(float(size), dtype=torch.float64)

    # ------------------------------------------------------------------ resuming a shrunk model
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
        body, distill = split_distill(saved or {})
        if self.distiller is not None and is_shrunk(body):  # a dense copy to rebuild the teacher into
            self.distiller.keep_skeleton(module, distill, self.options.distill_module)
        differ = _shape_mismatches(module, weights)
        if not differ:
            return
        if is_shrunk(body):  # a checkpoint written after the shrink: give the module its shapes
            with prefixed("CoupledPruningCallback: cannot resume the shrunk model"):
                small = read_saved(body, "the callback state")  # the schema, once
                restore_shrunk(module, small)
            if self.shrunk is None:
                self.resolved, self.shrunk = list(small.clusters), dict(small.dropped)
            return
        if self.shrunk is not None:  # this module was shrunk; the checkpoint holds the full-size weights
            name, (mine, theirs) = next(iter(differ.items()))
            raise ConfigurationError(
                f"CoupledPruningCallback(shrink_on_freeze=True): the checkpoint predates the shrink: it holds the "
                f"full-size weights ({name!r} of shape {theirs}), but this module was shrunk at the final ramp step "
                f"({name!r} is now {mine}; {len(differ)} tensor(s) differ). Evaluate that checkpoint on a fresh, "
                "full-size module (`trainer.validate(MyModule(), ckpt_path=...)`), pass a checkpoint written after the "
                "shrink, or omit `ckpt_path` to use the shrunk module's current weights."
            )


def _shape_mismatches(module: nn.Module, weights: Mapping[str, Any]) -> dict[str, tuple[tuple, tuple]]:
    """Name -> (the module's shape, the checkpoint's shape) of every tensor whose shapes differ."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        other = weights.get(name)
        if other is not None and hasattr(other, "shape") and tuple(other.shape) != tuple(tensor.shape):
            out[name] = (tuple(tensor.shape), tuple(other.shape))
    return out


def _warn_unoptimized(params: Mapping[str, Tensor], names: Sequence[str], optimizers: Sequence[Any]) -> None:
    """Warn about clustered parameters that are frozen or in no optimizer (they are masked but never updated)."""
    in_opt = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    frozen = [n for n in names if not params[n].requires_grad]
    orphan = [n for n in names if params[n].requires_grad and id(params[n]) not in in_opt]
    if frozen:
        distributed.rank_zero_warn(
            f"CoupledPruningCallback: clustered parameters {frozen[:5]} are frozen (requires_grad=False). Their "
            "dropped units are set to zero and stay zero, but they are never trained; unfreeze them or remove them "
            "from the clusters if they must not be pruned."
        )
    if orphan:
        distributed.rank_zero_warn(
            f"CoupledPruningCallback: clustered parameters {orphan[:5]} are in no optimizer. Their dropped units are "
            "set to zero but they are never updated; add them to `configure_optimizers` or remove them from the "
            "clusters."
        )
