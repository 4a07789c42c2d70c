"""The per-step pruning work on a bound run: what the weights go through around one optimizer step (no Lightning here).

Everything here works on a :class:`~lightning_pat.training.bound.BoundRun` (what
:meth:`~lightning_pat.training.controller.PruningController.bind` built), the run's
:class:`~lightning_pat.training.state.Progress` and plain values, and returns what changed; the controller's per-step
verbs call it and keep the results. In the order of a step:

1. :func:`after_backward`: between the backward and the update, the latents are swapped in (latent mode, ramp) or
   the dropped units' gradients zeroed (healing); a Taylor score observes the gradient;
2. :func:`after_step`: after a real optimizer step, the schedule's action: a fresh selection (:func:`select`, with
   the data-aware scores of the run's collectors), or the current mask held; after a skipped step (AMP), the
   projection shown again;
3. :func:`freeze` at the final ramp step with healing: the latents freed, the statistics detached, and with
   ``shrink_on_freeze`` the model cut (a new bound run that only counts steps).

Timing (``pat-algorithm.md`` §10): nothing here restores dense weights before a forward; the latents are swapped in
only after the backward and committed after the update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_pat.core.schedule import Action
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.pruner import PruneResult
from lightning_pat.shrink import shrink_for_training
from lightning_pat.training.bound import BoundRun, prefixed
from lightning_pat.training.state import Progress


def after_backward(run: BoundRun, optimizer: torch.optim.Optimizer, *, action: Action) -> None:
    """After the backward, before ``optimizer`` updates: swap latents in (ramp) or zero dropped grads (healing).

    Args:
        run: The bound run (nothing happens once the model was shrunk).
        optimizer: The optimizer about to update (its parameters' latents are swapped in).
        action: The schedule's action after the step this update completes.
    """
    pruner, latents = run.pruner, run.latents
    if pruner is None or latents is None:
        return
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
    options: PruningOptions,
    count: bool | Callable[[int], bool],
) -> PruneResult | None:
    """After a batch of a run that still prunes: if ``stepped``, count the step in ``progress`` and act.

    Args:
        run: The bound run (its pruner and latents are bound).
        progress: The run's progress (ticked and given ``lr`` when a real step happened and pruning has started).
        stepped: Whether a real optimizer step happened (not accumulation, not an AMP skip).
        lr: The step's learning rate (``None`` if unknown).
        options: The run's options.
        count: Whether to return a result with literal-zero counts: a bool, or a function of the new step.

    Returns:
        The current mask with its literal-zero counts, when counted and the schedule acted; else ``None``.

    Raises:
        ConfigurationError: If ``score="activation"`` statistics cannot score the clusters.
        ValueError: If a score is not finite (see :func:`~lightning_pat.core.selection.check_finite`).
    """
    pruner, latents = run.pruner, run.latents
    assert pruner is not None
    assert latents is not None
    latent = options.mode == "latent"
    with torch.no_grad():
        if not stepped:
            if latents.swapped:  # the scaler skipped the step: show the projection again
                latents.commit()
                with run.weights():
                    pruner.hold(rescale=latent)
            return None
        step = progress.tick()
        action = options.schedule.action(step, heal=options.heal)
        if action == "none":
            return None
        progress.add_lr(lr)
        if latent and action != "freeze":
            latents.commit()
        counted = count(step) if callable(count) else count
        with run.weights():
            if action == "select":
                return select(run, progress, step=step, options=options, count=counted)
            pruner.hold(rescale=latent and action == "hold")
            return pruner.result(count=True) if counted else None


def select(run: BoundRun, progress: Progress, *, step: int, options: PruningOptions, count: bool) -> PruneResult:
    """A fresh selection at this step's targets (the final step always applies the exact hard target).

    The run's weights must be in hand (:meth:`~lightning_pat.training.bound.BoundRun.weights`). A data-aware score's
    partials travel in the executors' one reduction (DDP: one sum of the statistics); the layer units' cosines are
    summed in one collective of their own.

    Args:
        run: The bound run (its pruner is bound).
        progress: The run's progress (the prox step is sized from it; the selection is marked in it).
        step: The completed optimizer step.
        options: The run's options.
        count: Whether the result carries literal-zero counts (which may communicate).

    Returns:
        The new mask.

    Raises:
        ConfigurationError: If ``score="activation"`` statistics cannot score the clusters.
        ValueError: If a score is not finite (see :func:`~lightning_pat.core.selection.check_finite`).
    """
    pruner, plan, scorers, schedule = run.pruner, run.plan, run.collectors, options.schedule
    assert pruner is not None
    assert plan is not None
    sparsity = options.target_sparsity
    assert sparsity is not None  # PruningOptions fills in its default
    method = "hard" if schedule.phase(step) in ("final", "healing") else options.method
    scores = None
    if scorers.layers is not None:
        with prefixed("CoupledPruningCallback(layer_score='cosine')"):
            scores = scorers.layers.summed_scores()  # one collective when distributed
        if scores is None:
            ranks.rank_zero_warn(
                f"CoupledPruningCallback: no layer saw a training forward before the selection at step {step}; "
                "the layer units are ranked by the weight score (layer_score='weight') this time."
            )
    score = run.score.score
    if scores is None and score == "activation" and scorers.act is None:  # only layer units: weights
        scores = {}
    threshold = options.reg_lambda * progress.prox_step(latent=options.mode == "latent")
    used = repr(score) if options.score != "auto" else f"'auto' -> {score!r}"
    with prefixed(f"CoupledPruningCallback(score={used})"):
        targets = plan.targets(sparsity, fraction=schedule.fraction(step))
        result = pruner.step(
            targets, method=method, threshold=threshold, count=count, scores=scores, evidence=scorers.evidence
        )
    if scorers.taylor is not None:
        scorers.taylor.reset()  # the next selection sums the steps from here
    progress.mark_selection()
    if options.debug_check_selection:  # the mask the pruner holds now, whatever produced it
        ranks.check_selection_agreement(
            pruner.result().dropped, step=step, who="CoupledPruningCallback (debug_check_selection)"
        )
    return result


def freeze(
    run: BoundRun,
    *,
    options: PruningOptions,
    clusters: Sequence[ResolvedCluster],
    step: int,
    info: Callable[[str], None],
) -> tuple[dict[str, list[int]], BoundRun] | None:
    """The mask is final: free the latents, stop collecting statistics, and shrink if asked to.

    Args:
        run: The bound run (its pruner and latents are bound).
        options: The run's options (``shrink_on_freeze``).
        clusters: The resolved clusters the shrink cuts.
        step: The completed optimizer step (for the message).
        info: Where the shrink's message goes (rank zero).

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
        if not options.shrink_on_freeze:
            return None
        dropped = run.pruner.result().dropped
        with prefixed("CoupledPruningCallback(shrink_on_freeze=True)"):
            shrink_for_training(run.module, clusters, dropped, optimizers=run.optimizers)
    info(
        f"CoupledPruningCallback: shrunk the model at step {step} to "
        f"{sum(p.numel() for p in run.module.parameters()):,} parameters; healing runs on the small model."
    )
    return dropped, run.after_shrink()
