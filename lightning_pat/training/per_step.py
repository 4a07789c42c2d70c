"""The per-step pruning work on a bound run: what the weights go through around one optimizer step (no Lightning here).

Every function takes the run and its progress first: a :class:`~lightning_pat.training.bound.BoundRun` (what
:meth:`~lightning_pat.training.controller.PruningController.bind` built; it carries the options and where messages
go) and its :class:`~lightning_pat.training.progress.Progress`, then plain values, and returns what changed; the
controller's per-step verbs call it and keep the results. In the order of a step:

1. :func:`after_backward`: between the backward and the update, the latents are swapped in (latent mode, ramp) or
   the dropped units' gradients zeroed (healing); a Taylor score observes the gradient;
2. :func:`after_step`: after a real optimizer step, the schedule's action: a fresh selection (:func:`select`, with
   the data-aware scores of the run's collectors; at the first one, a size target allocated by importance is solved
   from them, :func:`allocate`), or the current mask held; after a skipped step (AMP), the projection shown again;
3. :func:`freeze` at the final ramp step with healing: the latents freed, the statistics detached, and with
   ``shrink_on_freeze`` the model cut (a new bound run that only counts steps).

Timing (``pat-algorithm.md`` §10): nothing here restores dense weights before a forward; the latents are swapped in
only after the backward and committed after the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_pat.parallel.comm import dtensor, ranks
from lightning_pat.pruning.api import importance_costs
from lightning_pat.pruning.pruner import PruneResult
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.collector import summed_over_ranks
from lightning_pat.shrink import shrink_for_training
from lightning_pat.sizing.targets import declaration_labels
from lightning_pat.training.bound import BoundRun
from lightning_pat.training.errors import WHO, prefixed
from lightning_pat.training.progress import Progress
from lightning_pat.training.sharded_shrink import check_kept_counts, shrink_sharded


def after_backward(run: BoundRun, progress: Progress, optimizer: torch.optim.Optimizer) -> None:
    """After the backward, before ``optimizer`` updates: swap latents in (ramp) or zero dropped grads (healing).

    Args:
        run: The bound run (nothing happens once the model was shrunk).
        progress: The run's progress (the schedule's action is the one after the step this update completes).
        optimizer: The optimizer about to update (its parameters' latents are swapped in).
    """
    pruner, latents = run.pruner, run.latents
    if pruner is None or latents is None:
        return
    action = run.options.schedule.action(progress.step + 1, heal=run.options.heal)
    with torch.no_grad():
        if action == "freeze":
            if run.fsdp1_root is None:  # FSDP1: grads in flat shards; weights re-zeroed after
                pruner.zero_grads()
        elif action != "none" and latents.active:
            latents.swap_in({id(p) for g in optimizer.param_groups for p in g["params"]})
        taylor = run.collectors.taylor
        if taylor is not None and action != "freeze":  # the weights this update applies to
            taylor.observe()


def after_step(
    run: BoundRun,
    progress: Progress,
    *,
    stepped: bool,
    lr: float | None,
    count: bool | Callable[[int], bool],
) -> tuple[PruneResult | None, BoundRun]:
    """After a batch of a run that still prunes: if ``stepped``, count the step in ``progress`` and act.

    A size target allocated by importance is solved at the first fresh selection (:func:`allocate`), which gives
    another run (its clusters' targets).

    Args:
        run: The bound run (its pruner and latents are bound).
        progress: The run's progress (ticked and given ``lr`` when a real step happened and pruning has started).
        stepped: Whether a real optimizer step happened (not accumulation, not an AMP skip).
        lr: The step's learning rate (``None`` if unknown).
        count: Whether to return a result with literal-zero counts: a bool, or a function of the new step.

    Returns:
        The current mask with its literal-zero counts, when counted and the schedule acted (else ``None``), and the
        run (``run`` itself unless the size was solved now).

    Raises:
        ConfigurationError: If ``score="activation"`` statistics cannot score the clusters, or the size cannot be
            solved by importance.
        ValueError: If a score is not finite (see :func:`~lightning_pat.core.selection.check_finite`).
    """
    pruner, latents, options = run.pruner, run.latents, run.options
    assert pruner is not None
    assert latents is not None
    latent = options.mode == "latent"
    with torch.no_grad():
        if not stepped:
            if latents.swapped:  # the scaler skipped the step: show the projection again
                latents.commit()
                with run.weights():
                    pruner.hold(rescale=latent)
            return None, run
        step = progress.tick()
        action = options.schedule.action(step, heal=options.heal)
        if action == "none":
            return None, run
        progress.add_lr(lr)
        if latent and action != "freeze":
            latents.commit()
        counted = count(step) if callable(count) else count
        with run.weights() as params:
            if action == "select":
                if run.allocation_due():
                    run = allocate(run, params, step=step)
                return select(run, progress, step=step, count=counted), run
            pruner.hold(rescale=latent and action == "hold")
            return (pruner.result(count=True) if counted else None), run


def allocate(run: BoundRun, params: Mapping[str, Tensor], *, step: int) -> BoundRun:
    """Solve the size target by importance from the run's own statistics (``target_allocation="importance"``).

    The unit scores are reduced as for a selection (the data-aware score's partials in the executors' one reduction,
    or the weights' unit norms), so every rank solves from bitwise-identical costs and gets the same widths. The costs
    and the solver are :func:`~lightning_pat.prune_clusters`' (:func:`~lightning_pat.pruning.api.importance_costs`,
    :meth:`~lightning_pat.pruning.plan.Plan.sized`), from the plan before sizing.

    Args:
        run: The bound run, its weights in hand (``params``).
        params: The parameters the engine works on (:meth:`~lightning_pat.training.bound.BoundRun.weights`).
        step: The completed optimizer step (the first selection); the solution is reported to ``run.info``.

    Returns:
        The run with the solved targets and size (its pruner retargeted in place).

    Raises:
        ConfigurationError: If a score is not finite or the size cannot be reached by importance.
    """
    assert run.pruner is not None
    assert run.plan is not None
    assert run.basis is not None
    assert run.score is not None
    evidence, options = run.collectors.evidence, run.options
    score = run.score.score
    which = options.sizing.option
    with prefixed(f"{WHO}({which}, target_allocation={options.sizing.target_allocation!r})"):
        q, scores = run.pruner.reduced(None, evidence)
        declared = declaration_labels(params, run.basis.declarations)
        costs = importance_costs(
            run.plan, q, scores, declared=declared, comparable=isinstance(evidence, ActivationStats)
        )
        sized, size = run.basis.plan.for_size(
            params, options.sizing, declarations=run.basis.declarations, model=run.module, importance=costs
        )
    run = run.retargeted({rc.name: rc.target for rc in sized.clusters}, size, solved_at=step)
    if options.shrink_on_freeze:  # the widths are known now: refuse what the freeze could not shard again
        with prefixed(f"{WHO}(shrink_on_freeze=True)"):
            check_kept_counts(run.module, run.clusters, {rc.name: rc.target or 0.0 for rc in sized.clusters})
    source = "statistics" if evidence is not None else "weights"
    run.info(
        f"{WHO} {which}: {size.describe()}; solved at step {step} (the first selection) from the "
        f"run's {score!r} {source}."
    )
    return run


def select(run: BoundRun, progress: Progress, *, step: int, count: bool) -> PruneResult:
    """A fresh selection at this step's targets (the final step always applies the exact hard target).

    The run's weights must be in hand (:meth:`~lightning_pat.training.bound.BoundRun.weights`). A data-aware score's
    partials travel in the executors' one reduction (DDP: one sum of the statistics); the layer units' cosines and
    the routed experts' statistics (``expert_score``) are summed together in one collective and rank those clusters.

    Args:
        run: The bound run (its pruner is bound).
        progress: The run's progress (the prox step is sized from it; the selection is marked in it).
        step: The completed optimizer step.
        count: Whether the result carries literal-zero counts (which may communicate).

    Returns:
        The new mask.

    Raises:
        ConfigurationError: If ``score="activation"`` statistics cannot score the clusters.
        ValueError: If a score is not finite (see :func:`~lightning_pat.core.selection.check_finite`).
    """
    pruner, plan, scorers, options = run.pruner, run.plan, run.collectors, run.options
    schedule = options.schedule
    assert pruner is not None
    assert plan is not None
    sparsity = options.target_sparsity
    assert sparsity is not None  # PruningOptions fills in its default
    method = "hard" if schedule.phase(step) in ("final", "healing") else options.method
    scores = None
    layers, experts = scorers.layers, scorers.experts
    summed_layers, summed_experts = summed_over_ranks(layers, experts)  # one collective for both when distributed
    if layers is not None:
        with prefixed(f"{WHO}(layer_score='cosine')"):
            scores = layers.take_scores(summed_layers)
        if scores is None:
            ranks.rank_zero_warn(
                f"{WHO}: no layer saw a training forward before the selection at step {step}; "
                "the layer units are ranked by the weight score (layer_score='weight') this time."
            )
    assert run.score is not None
    score = run.score.score
    if scores is None and score == "activation" and scorers.act is None:  # only layer units: weights
        scores = {}
    if experts is not None:
        with prefixed(f"{WHO}(expert_score={options.expert_score!r})"):
            by_expert = experts.take_scores(summed_experts)
        if by_expert is None:
            ranks.rank_zero_warn(
                f"{WHO}: no routed expert saw a training token before the selection at step {step}; "
                "the experts are ranked by the weight score (expert_score='weight') this time."
            )
        else:
            scores = {**(scores or {}), **by_expert}
    threshold = options.reg_lambda * progress.prox_step(latent=options.mode == "latent")
    used = repr(score) if options.score != "auto" else f"'auto' -> {score!r}"
    with prefixed(f"{WHO}(score={used})"):
        targets = plan.targets(sparsity, fraction=schedule.fraction(step))
        result = pruner.step(
            targets, method=method, threshold=threshold, count=count, scores=scores, evidence=scorers.evidence
        )
    if scorers.taylor is not None:
        scorers.taylor.reset()  # the next selection sums the steps from here
    progress.mark_selection()
    if options.debug_check_selection:  # the mask the pruner holds now, whatever produced it
        ranks.check_selection_agreement(pruner.result().dropped, step=step, who=f"{WHO} (debug_check_selection)")
    return result


def freeze(run: BoundRun, progress: Progress) -> tuple[dict[str, list[int]], BoundRun] | None:
    """The mask is final: free the latents, stop collecting statistics, and shrink if asked to.

    Args:
        run: The bound run (its pruner and latents are bound); ``shrink_on_freeze`` cuts its clusters.
        progress: The run's progress (its step names the shrink in the message to ``run.info``).

    Returns:
        With ``shrink_on_freeze``: the dropped units and the run on the shrunk model (it only counts steps); else
        ``None``.

    Raises:
        ConfigurationError: If the model cannot be shrunk (``shrink_on_freeze``).
    """
    assert run.pruner is not None
    assert run.latents is not None
    with torch.no_grad():
        run.latents.clear()
        run.collectors.detach()  # no per-forward cost during healing
        if not run.options.shrink_on_freeze:
            return None
        dropped = run.pruner.result().dropped
        with prefixed(f"{WHO}(shrink_on_freeze=True)"):
            if any(dtensor.is_dtensor(p) for p in run.module.parameters()):  # FSDP2 (x TP): cut and sharded again
                params: Mapping[str, Tensor] = shrink_sharded(
                    run.module, run.clusters, dropped, optimizers=run.optimizers
                )
            else:
                shrink_for_training(run.module, run.clusters, dropped, optimizers=run.optimizers)
                params = dict(run.module.named_parameters(remove_duplicate=False))
    run.info(
        f"{WHO}: shrunk the model at step {progress.step} to "
        f"{sum(p.numel() for p in run.module.parameters()):,} parameters; healing runs on the small model."
    )
    return dropped, dataclasses.replace(run.after_shrink(), params=params)
