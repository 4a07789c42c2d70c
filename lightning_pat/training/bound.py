"""A run bound to its model: what :meth:`PruningController.bind` builds once the model and optimizers are final.

:class:`BoundRun` is frozen: the module, its parameters, the plan, the latent copies, the size target's solution,
and from fit start the pruner, the data-aware scorers (:class:`~lightning_pat.training.collectors.Collectors`) and the
score in use. The controller (:mod:`lightning_pat.training.controller`) holds it; the per-step work
(:mod:`lightning_pat.training.per_step`) and the resume (:mod:`lightning_pat.training.resume`, the fit lifecycle and
the saved state) are functions on it, and neither imports the controller. :func:`bind_run` resolves, routes, agrees
across ranks and checks, but builds no pruner: the score is settled once, at fit start, when a restored state is
known under every strategy (:meth:`BoundRun.scored`, called by :func:`~lightning_pat.training.resume.start`); a
``shrink_on_freeze`` keeps only the module (:meth:`BoundRun.after_shrink`).

The score is settled by :func:`~lightning_pat.training.score_choice.resolve_score`. Errors are ``ValueError``
(:class:`~lightning_pat.training.errors.ConfigurationError` where the configuration caused them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.routing import route_around_dropped
from lightning_pat.core.spec import Cluster, ResolvedCluster
from lightning_pat.parallel import fsdp1
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.plan import Plan, make_plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.shrink import check_shrinkable
from lightning_pat.sizing.problem import SizeSolution
from lightning_pat.training import state
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.errors import WHO, prefixed
from lightning_pat.training.latent import LatentStore
from lightning_pat.training.score_choice import ScoreChoice, check_scores, scored
from lightning_pat.training.sharded_shrink import check_kept_counts, tensor_parallel_multiples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SizeBasis:
    """What a size target is solved from: the plan before sizing and the declarations (their families).

    Attributes:
        plan: The resolved, routed plan without the size's targets.
        declarations: The cluster declarations (the clusters of one keep one width).
    """

    plan: Plan
    declarations: tuple[Cluster, ...]


def first_selection(options: PruningOptions) -> int:
    """The step of the schedule's first fresh selection (where ``target_allocation="importance"`` is solved)."""
    schedule = options.schedule
    last = schedule.final_step + max(schedule.every_n_steps, 1)
    return next((t for t in range(1, last + 1) if schedule.action(t, heal=options.heal) == "select"), last)


@dataclass(frozen=True)
class BoundRun:
    """A run bound to its model (see the module docstring); built by :func:`bind_run`.

    Attributes:
        module: The model (under FSDP1, the LightningModule inside ``fsdp1_root``).
        optimizers: The optimizers whose steps count.
        params: Parameter name -> live parameter (duplicates included).
        options: The run's options.
        info: Where the run's informational messages go (rank zero): the routes, the size, the score, the shrink.
        fsdp1_root: The FSDP1-wrapped root module, if any.
        sharded_ckpt: Whether checkpoints are distributed checkpoints.
        clusters: The resolved clusters (empty once the model was shrunk).
        plan: The plan (``None`` once the model was shrunk); its score is the one in use once the fit started.
        pruner: The pruner, built at fit start with the score (``None`` before, and once the model was shrunk).
        latents: The latent copies (``None`` once the model was shrunk).
        collectors: The data-aware scorers in use (built with the pruner).
        score: The score in use (see :func:`~lightning_pat.training.score_choice.resolve_score`), settled at fit
            start (``None`` before).
        size: ``target_params`` / ``target_flops``: the solved widths and the achieved count.
        basis: With a size target: what it is solved from (the solve by importance happens at the first selection).
        solved_at: The step at which the size was solved by importance (``None``: not yet, or by fractions at bind).
    """

    module: nn.Module
    optimizers: Sequence[torch.optim.Optimizer]
    params: Mapping[str, Tensor]
    options: PruningOptions
    info: Callable[[str], None] = dataclasses.field(repr=False, compare=False)
    fsdp1_root: nn.Module | None = None
    sharded_ckpt: bool = False
    clusters: tuple[ResolvedCluster, ...] = ()
    plan: Plan | None = None
    pruner: Pruner | None = None
    latents: LatentStore | None = None
    collectors: Collectors = dataclasses.field(default_factory=Collectors)
    score: ScoreChoice | None = None
    size: SizeSolution | None = None
    basis: SizeBasis | None = None
    solved_at: int | None = None

    def allocation_due(self) -> bool:
        """Whether the size target waits to be solved by importance (at the next fresh selection)."""
        return (
            self.basis is not None
            and self.solved_at is None
            and self.plan is not None
            and self.score is not None
            and self.options.sizing.allocation(self.score.score) == "importance"
        )

    def retargeted(self, targets: Mapping[str, float | None], size: SizeSolution, *, solved_at: int) -> BoundRun:
        """This run with the clusters' ``targets`` of a size solved by importance at step ``solved_at``.

        The pruner is retargeted in place (its executors and the scorers bound to them are kept).

        Raises:
            ValueError: If ``targets`` does not name every cluster of the plan.
        """
        assert self.plan is not None
        assert self.pruner is not None
        missing = [rc.name for rc in self.plan.clusters if rc.name not in targets]
        if missing:
            raise ValueError(f"the solved size names no target for clusters {missing[:5]}.")
        clusters = tuple(dataclasses.replace(rc, target=targets[rc.name]) for rc in self.plan.clusters)
        plan = dataclasses.replace(self.plan, clusters=clusters)
        self.pruner.retarget(plan)
        return dataclasses.replace(self, clusters=clusters, plan=plan, size=size, solved_at=solved_at)

    @contextmanager
    def weights(self) -> Iterator[Mapping[str, Tensor]]:
        """The parameters the engine works on: the live ones, or FSDP1's summoned full ones (written back on exit)."""
        if self.fsdp1_root is None:
            yield self.params
            return
        with fsdp1.summoned_params(self.fsdp1_root, self.module) as params:
            if self.pruner is not None:
                self.pruner.rebind(params)
            yield params

    def latent_format(self) -> str:
        """How the latents are written to a checkpoint (see :func:`~lightning_pat.training.state.latent_format`)."""
        return state.latent_format(
            self.params.values(), fsdp1=self.fsdp1_root is not None, sharded_ckpt=self.sharded_ckpt
        )

    def scored(self, choice: ScoreChoice) -> BoundRun:
        """This run with its score settled: the pruner with ``choice``'s score and the collectors it needs.

        Raises:
            ConfigurationError: As for :func:`~lightning_pat.training.score_choice.scored`.
        """
        assert self.plan is not None
        with self.weights() as params:
            pruner, collectors = scored(
                self.plan, params, choice, module=self.module, layer_score=self.options.layer_score,
                expert_score=self.options.expert_score,
            )  # fmt: skip
        return dataclasses.replace(self, plan=pruner.plan, pruner=pruner, collectors=collectors, score=choice)

    def after_shrink(self) -> BoundRun:
        """The run once ``shrink_on_freeze`` cut the model: nothing is left to prune, only steps to count."""
        return dataclasses.replace(self, plan=None, pruner=None, latents=None, collectors=Collectors())


def bind_run(
    module: nn.Module,
    *,
    options: PruningOptions,
    optimizers: Sequence[torch.optim.Optimizer],
    declarations: Callable[[nn.Module], list[Cluster]],
    fsdp1_root: nn.Module | None = None,
    sharded_ckpt: bool = False,
    info: Callable[[str], None],
) -> BoundRun:
    """Resolve the clusters against ``module``'s final parameters, agree across ranks, check, build the run.

    The run has no pruner yet: the score is settled at fit start, once a restored state is known
    (:func:`~lightning_pat.training.resume.start`); what no checkpoint changes is refused here
    (:func:`~lightning_pat.training.score_choice.check_scores`). Nothing is mutated. Resolution and routing use
    global metadata only; their outcome (or a rank's error) is compared across ranks in one collective, so a rank
    with a different declaration or model makes every rank raise the same error instead of hanging in a later
    collective.

    Args:
        module: The model (under FSDP1, the LightningModule inside ``fsdp1_root``).
        options: The run's options.
        optimizers: The optimizers whose steps count.
        declarations: Returns the cluster declarations for ``module`` (or raises the discovery's error).
        fsdp1_root: The FSDP1-wrapped root module, if any.
        sharded_ckpt: Whether checkpoints are distributed checkpoints.
        info: Where the routes go (rank zero).

    Raises:
        ValueError: If the clusters do not resolve or route on some rank (or ``clusters="auto"`` could not be
            discovered), a target below 1 would drop every unit of a cluster, or ranks disagree; if an explicit
            score cannot score the clusters (``"activation"`` readers that are not ``nn.Linear`` weights,
            ``"taylor"`` on frozen members), or layer units share no module (``layer_score="cosine"``); if
            ``shrink_on_freeze`` could not shrink the model.
    """
    live = dict(module.named_parameters(remove_duplicate=False))
    run = BoundRun(module, list(optimizers), live, options, info, fsdp1_root=fsdp1_root, sharded_ckpt=sharded_ckpt)
    opts = options
    size, basis = None, None
    with run.weights() as params:
        plan, error = None, None
        try:
            found = declarations(module)
            plan = make_plan(
                params, found, score="rms", executor=opts.executor,  # the score is settled at fit start
                group_count_ref=opts.group_count_ref,
                sparsity=opts.target_sparsity if opts.sizing.value is None else None,  # else: checked when sized
            )  # fmt: skip
            if opts.sizing.value is not None:  # by fractions: the solve by importance waits for statistics
                if opts.shrink_on_freeze:  # sharded again at the freeze: whole units on every tensor-parallel rank
                    plan = _tensor_parallel_rounded(module, plan, info)
                basis = SizeBasis(plan, tuple(found))
                plan, size = plan.for_size(params, opts.sizing, declarations=found, model=module)
        except ValueError as err:
            error = f"{WHO}: {err}"
        digest = {
            "clusters": None if plan is None else [rc.fingerprint() for rc in plan.clusters],
            "routes": None if plan is None else plan.routes,
            "options": opts.resumable(),
        }
        ranks.check_rank_agreement(digest, error, who=WHO)
        assert plan is not None
        clusters = tuple(plan.clusters)
        check_scores(opts, module=module, plan=plan, params=params, fsdp1=fsdp1_root is not None)
        route_around_dropped(module, clusters)  # the masked model routes around dropped experts
        if opts.shrink_on_freeze:  # refuse now what the shrink at the final step could not rewrite
            with prefixed(f"{WHO}(shrink_on_freeze=True)"):
                check_shrinkable(module, clusters)
                sparsity = opts.target_sparsity if opts.target_sparsity is not None else 0.0
                check_kept_counts(module, clusters, plan.targets(sparsity))  # sharded: whole units per TP rank
                if any(is_layer_cluster(rc) for rc in clusters):
                    raise ValueError(
                        "layer units (preset_options={'layers': True}) are removed by `lightning_pat.shrink` "
                        "after fit, not during training; use shrink_on_freeze=False."
                    )
    clustered = sorted({n for rc in clusters for n in rc.param_names})
    # FSDP1 keeps parameters in flat shards between steps: the latent is a copy of every local shard.
    latents = LatentStore(run.params, list(run.params) if fsdp1_root is not None else clustered)
    _warn_unoptimized(run.params, clustered, optimizers)
    info(routes_message(plan.routes))
    return dataclasses.replace(run, clusters=clusters, plan=plan, latents=latents, size=size, basis=basis)


def _tensor_parallel_rounded(module: nn.Module, plan: Plan, info: Callable[[str], None]) -> Plan:
    """``plan`` with every cluster cut along a tensor-parallel dim kept at a multiple of that axis's size.

    A size target (``target_params``, ``target_flops``) is then solved over those multiples (the cluster's own
    ``multiple_of`` combined by least common multiple), so that the sharded shrink at the freeze can give every
    tensor-parallel rank whole units (:func:`~lightning_pat.training.sharded_shrink.tensor_parallel_multiples`).
    What was rounded is reported once to ``info``.
    """
    multiples = tensor_parallel_multiples(module, plan.clusters)
    if not multiples:
        return plan
    by_value: dict[int, list[str]] = {}
    for name, multiple in multiples.items():
        by_value.setdefault(multiple, []).append(name)
    shown = "; ".join(
        f"{len(names)} cluster(s) ({', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''}) "
        f"to multiples of {multiple}"
        for multiple, names in sorted(by_value.items())
    )
    info(
        f"{WHO}(shrink_on_freeze=True): the size target keeps whole units on every tensor-parallel rank: kept counts "
        f"rounded for {shown} (a cluster cut along a dim split over a tensor-parallel mesh axis)."
    )
    clusters = tuple(
        dataclasses.replace(rc, multiple_of=multiples[rc.name]) if rc.name in multiples else rc for rc in plan.clusters
    )
    return dataclasses.replace(plan, clusters=clusters)


def choice_message(run: BoundRun) -> list[str]:
    """What the log says once the score is settled: the size target's solution and rule, and ``"auto"``'s score."""
    assert run.score is not None
    options = run.options
    lines, choice, which = [], run.score, options.sizing.option
    if run.size is not None and options.sizing.allocation(choice.score) == "importance":
        lines.append(
            f"{WHO} {which}: provisional (by fractions, only to check that the size is "
            f"reachable; the widths are allocated by importance at the first selection, step "
            f"{first_selection(options)}, from the run's {choice.score!r} scores, and logged then): "
            f"{run.size.describe()}"
        )
    elif run.size is not None:
        lines.append(f"{WHO} {which}: {run.size.describe()}")
    if options.score == "auto":
        lines.append(f"{WHO}: score='auto' scores units by {choice.score!r} ({choice.reason}).")
    return lines


def routes_message(routes: Mapping[str, tuple[str, str]]) -> str:
    """The routes as the log says them: one line when every cluster takes the same path for the same reason.

    That is the usual case (one device: SmolLM2's 60 clusters all materializing on plain tensors); otherwise one line
    per path and reason, naming its clusters, so that what differs stands out.

    Example::

        >>> print(routes_message({"mlp.0": ("materializing", "plain"), "mlp.1": ("materializing", "plain")}))
        CoupledPruningCallback routes 2 cluster(s): all materializing (plain)
        >>> print(routes_message({"mlp.0": ("sharded", "Shard(0)"), "mlp.1": ("materializing", "a norm")}))
        CoupledPruningCallback routes 2 cluster(s):
          sharded (Shard(0)): mlp.0
          materializing (a norm): mlp.1
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for name, route in routes.items():
        groups.setdefault(route, []).append(name)
    head = f"{WHO} routes {len(routes)} cluster(s)"
    if len(groups) == 1:
        (kind, reason), _ = next(iter(groups.items()))
        return f"{head}: all {kind} ({reason})"
    lines = [f"  {kind} ({reason}): {', '.join(names)}" for (kind, reason), names in groups.items()]
    return f"{head}:\n" + "\n".join(lines)


def _warn_unoptimized(params: Mapping[str, Tensor], names: Sequence[str], optimizers: Sequence[Any]) -> None:
    """Warn about clustered parameters that are frozen or in no optimizer (they are masked but never updated)."""
    in_opt = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    frozen = [n for n in names if not params[n].requires_grad]
    orphan = [n for n in names if params[n].requires_grad and id(params[n]) not in in_opt]
    if frozen:
        ranks.rank_zero_warn(
            f"{WHO}: clustered parameters {frozen[:5]} are frozen (requires_grad=False). Their "
            "dropped units are set to zero and stay zero, but they are never trained; unfreeze them or remove them "
            "from the clusters if they must not be pruned."
        )
    if orphan:
        ranks.rank_zero_warn(
            f"{WHO}: clustered parameters {orphan[:5]} are in no optimizer. Their dropped units are "
            "set to zero but they are never updated; add them to `configure_optimizers` or remove them from the "
            "clusters."
        )
