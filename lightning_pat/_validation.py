"""Checks and warnings of :class:`~lightning_pat.CoupledPruningCallback` (kept out of the hook logic).

Static checks run at construction (options, declarations, preset names); environmental ones at ``setup`` and fit
start (strategy, optimization mode, frozen parameters, run length); resume checks compare the saved options with
the current ones. Every error is a ``MisconfigurationException`` naming the argument or cluster, what was expected,
what was found and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_pat import distributed as D
from lightning_pat import presets
from lightning_pat.discovery import discovered_clusters, prefers_discovery
from lightning_pat.schedule import Schedule
from lightning_pat.selection import num_to_drop
from lightning_pat.spec import Cluster, check_declaration

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pat.engine import Plan, Pruner

_FIELDS = tuple(f.name for f in dataclasses.fields(Cluster))


def check_choice(name: str, value: object, valid: Sequence[str]) -> None:
    """Raise unless ``value`` is one of ``valid``."""
    if value not in valid:
        raise MisconfigurationException(f"`{name}` must be one of {tuple(valid)}, got {value!r}.")


def check_number(name: str, value: object, *, low: float, high: float | None = None, integer: bool = False) -> None:
    """Raise unless ``value`` is a number (an int if ``integer``) in ``[low, high]``."""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        kind = "an int" if integer else "a number"
        raise MisconfigurationException(f"`{name}` must be {kind} {span}, got {value!r}.")


def _preset_name(name: str) -> str:
    try:
        presets.get(name)
    except ValueError as err:
        raise MisconfigurationException(f"`clusters`: {err}") from err
    return name


def _declaration(entry: object, index: int) -> Cluster:
    try:
        return check_declaration(_fields(entry, index))
    except (ValueError, TypeError) as err:
        raise MisconfigurationException(f"`clusters`: {err}") from err


def _fields(entry: object, index: int) -> Cluster:
    if isinstance(entry, Cluster):
        return entry
    if isinstance(entry, Mapping):
        label = entry.get("name", f"#{index}")
        unknown = sorted(str(k) for k in entry if k not in _FIELDS)
        if unknown:
            raise MisconfigurationException(
                f"Cluster {label!r}: unknown key(s) {unknown}; a cluster declaration has the fields {list(_FIELDS)}."
            )
        if "name" not in entry:
            raise MisconfigurationException(
                f"Cluster #{index}: the mapping {dict(entry)!r} has no `name`; every declaration needs one."
            )
        return Cluster(**entry)
    raise MisconfigurationException(
        f"`clusters` entry #{index} must be a Cluster, a mapping of its fields or a preset name, got "
        f"{type(entry).__name__} ({entry!r})."
    )


def normalize_clusters(clusters: object) -> str | list[Cluster | str]:
    """A preset name (checked), or a list of declarations and preset names (checked; mappings become Clusters).

    Raises:
        MisconfigurationException: If ``clusters`` is empty or of the wrong type, a preset name is unknown, or a
            mapping has an unknown key or no name.
    """
    if isinstance(clusters, str):
        return _preset_name(clusters)
    if isinstance(clusters, (Cluster, Mapping)):
        clusters = [clusters]
    if not isinstance(clusters, Sequence) or not clusters:
        raise MisconfigurationException(
            f"`clusters` must be a preset name or a non-empty list of Cluster declarations, got {clusters!r}."
        )
    return [_preset_name(c) if isinstance(c, str) else _declaration(c, i) for i, c in enumerate(clusters)]


@contextmanager
def user_error(prefix: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` of the enclosed code as a ``MisconfigurationException`` ``"{prefix}: {error}"``.

    Raises:
        MisconfigurationException: If the enclosed code raises a ``ValueError``.
    """
    try:
        yield
    except ValueError as err:
        raise MisconfigurationException(f"{prefix}: {err}") from err


def declarations(
    clusters: str | list[Cluster | str], pl_module: pl.LightningModule, *, preset_options: dict[str, Any]
) -> list[Cluster]:
    """The cluster declarations for ``pl_module``: the given ones, or the presets' (expanded from preset names).

    Raises:
        ValueError: If ``preset_options`` are given with declarations only, or a preset does not fit the module.
    """
    if not isinstance(clusters, str) and all(isinstance(c, Cluster) for c in clusters):
        if preset_options:
            raise ValueError(f"`preset_options` {preset_options} apply to preset names only; none was given.")
        return list(clusters)  # type: ignore[arg-type]
    if isinstance(clusters, str) and clusters.lower() == "auto" and prefers_discovery(pl_module):
        return _discovered(pl_module, preset_options, getattr(pl_module, "example_input_array", None))
    return presets.resolve_preset(clusters, pl_module, **preset_options)


def early_declarations(
    clusters: str | list[Cluster | str],
    pl_module: pl.LightningModule,
    trainer: pl.Trainer,
    *,
    preset_options: dict[str, Any],
) -> list[Cluster] | ValueError | None:
    """``clusters="auto"`` by tracing, in ``setup``: before ``configure_model`` shards the model.

    FSDP2 modules cannot be copied for tracing, so discovery runs before them. The example input is the module's
    ``example_input_array``, else the first training batch's inputs (:func:`first_batch_input`).

    Returns:
        The discovered declarations; the ``ValueError`` that discovery raised (the callback raises it at fit start,
        where every rank raises together); or ``None`` when discovery does not apply (declarations, a preset).
    """
    if not (isinstance(clusters, str) and clusters.lower() == "auto" and prefers_discovery(pl_module)):
        return None
    example = getattr(pl_module, "example_input_array", None)
    try:
        return _discovered(pl_module, preset_options, example if example is not None else first_batch_input(trainer))
    except ValueError as err:
        return err


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


def _discovered(pl_module: pl.LightningModule, preset_options: dict[str, Any], example: Any = None) -> list[Cluster]:
    """``clusters="auto"`` for a model no preset covers: trace ``example`` (see ``lightning_pat.discovery``)."""
    if example is None:
        raise ValueError(
            f"clusters='auto': no preset fits {type(pl_module).__name__}, and discovering the clusters by tracing "
            "needs an example input; set `self.example_input_array` in the LightningModule (what `forward` takes) "
            "or give `fit` training data, or declare the clusters (`lightning_pat.discover(model, example)` prints "
            "them)."
        )
    if preset_options:
        raise ValueError(
            f"`preset_options` {preset_options} apply to presets, but no preset fits {type(pl_module).__name__} and "
            "its clusters are discovered by tracing; remove `preset_options`."
        )
    return discovered_clusters(pl_module, example)


def check_options(
    *,
    target_sparsity: object,
    reg_lambda: object,
    method: object,
    methods: Sequence[str],
    score: object,
    scores: Sequence[str],
    mode: object,
    modes: Sequence[str],
    executor: object,
    executors: Sequence[str],
    group_count_ref: object,
    preset_options: object,
) -> None:
    """Static option checks (see the callback's ``Raises:``)."""
    check_number("target_sparsity", target_sparsity, low=0.0, high=1.0)
    check_number("reg_lambda", reg_lambda, low=0.0)
    check_choice("method", method, methods)
    check_choice("score", score, scores)
    check_choice("mode", mode, modes)
    check_choice("executor", executor, executors)
    if group_count_ref is not None:
        check_number("group_count_ref", group_count_ref, low=1, integer=True)
    if method == "group_lasso" and reg_lambda == 0.0:
        raise MisconfigurationException(
            "`method='group_lasso'` needs `reg_lambda` > 0 (got 0.0); set a strength such as 1e-3 or use 'hard'."
        )
    if preset_options is not None:
        bad = {k: v for k, v in dict(preset_options).items() if k not in presets.OPTIONS or not isinstance(v, bool)}
        if bad:
            raise MisconfigurationException(
                f"`preset_options` must map some of {presets.OPTIONS} to bools, got {bad}; e.g. {{'residual': True}}."
            )
    if target_sparsity == 1.0:
        rank_zero_warn(
            "CoupledPruningCallback: `target_sparsity=1.0` removes every unit of each cluster without its own target; "
            "the model's output will not depend on those weights at all. Use a value below 1 unless that is intended."
        )


def check_shrink_needs_heal(*, shrink_on_freeze: bool, heal: bool) -> None:
    """``shrink_on_freeze`` removes the frozen mask's units, so the mask must freeze.

    Raises:
        MisconfigurationException: If ``shrink_on_freeze`` is set without ``heal``.
    """
    if shrink_on_freeze and not heal:
        raise MisconfigurationException(
            "`shrink_on_freeze=True` needs `heal=True`: the mask must be frozen before units can be removed."
        )


def make_schedule(**kwargs: Any) -> Schedule:
    """A :class:`Schedule`, with its ``ValueError`` turned into a ``MisconfigurationException``."""
    try:
        return Schedule(**kwargs)
    except ValueError as err:
        raise MisconfigurationException(str(err)) from err


def check_strategy_and_optimization(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Refuse DeepSpeed and manual optimization at ``setup``, before any step.

    Raises:
        MisconfigurationException: On a DeepSpeed strategy or ``automatic_optimization = False``.
    """
    name = type(trainer.strategy).__name__
    if "DeepSpeed" in name:
        raise MisconfigurationException(
            f"CoupledPruningCallback does not support {name}: DeepSpeed partitions parameters into flat buffers "
            "that have no per-tensor structure. Use strategy='ddp', or ModelParallelStrategy with fully_shard."
        )
    if not getattr(pl_module, "automatic_optimization", True):
        raise MisconfigurationException(
            f"CoupledPruningCallback does not support manual optimization ({type(pl_module).__name__}."
            "automatic_optimization is False): it must see every optimizer step between the backward and the "
            "update (a raw optimizer bypasses Lightning's hooks, and with several optimizers the schedule could not "
            "tell which step counts). Use automatic optimization with one optimizer (param groups may differ), or "
            "call lightning_pat.prune_clusters yourself after your optimizer steps."
        )


def check_activation_strategy(trainer: pl.Trainer) -> None:
    """``score="activation"`` runs with plain parameters only: one device or DDP (the same on every rank).

    Raises:
        MisconfigurationException: Under ``FSDPStrategy`` (flat parameters) or ``ModelParallelStrategy`` (DTensor
            parameters).
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        raise MisconfigurationException(
            f"CoupledPruningCallback(score='activation') supports a single device and DDP (plain parameters), got "
            f"{type(trainer.strategy).__name__}: with sharded or flat parameters the readers' inputs and weights are "
            "split across ranks and the activation statistics are not collected there. Use a weight score "
            "(score='rms', the default) under FSDP and ModelParallelStrategy."
        )


def check_shrink_on_freeze(trainer: pl.Trainer) -> None:
    """``shrink_on_freeze`` runs on a single device only (for now).

    Raises:
        MisconfigurationException: Under any strategy but ``SingleDeviceStrategy``.
    """
    from lightning.pytorch.strategies import SingleDeviceStrategy

    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        raise MisconfigurationException(
            f"CoupledPruningCallback(shrink_on_freeze=True) runs on a single device, got "
            f"{type(trainer.strategy).__name__}: under DDP/FSDP/ModelParallelStrategy the wrapped or sharded "
            "parameters cannot be resized in place yet. Use shrink_on_freeze=False and shrink after fit "
            "(lightning_pat.shrink(model, callback)), or train on one device."
        )


def warn_unoptimized(params: Mapping[str, Tensor], names: Sequence[str], optimizers: Sequence[Any]) -> None:
    """Warn about clustered parameters that are frozen or in no optimizer (they are masked but never updated)."""
    in_opt = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    frozen = [n for n in names if not params[n].requires_grad]
    orphan = [n for n in names if params[n].requires_grad and id(params[n]) not in in_opt]
    if frozen:
        rank_zero_warn(
            f"CoupledPruningCallback: clustered parameters {frozen[:5]} are frozen (requires_grad=False). Their "
            "dropped units are set to zero and stay zero, but they are never trained; unfreeze them or remove them "
            "from the clusters if they must not be pruned."
        )
    if orphan:
        rank_zero_warn(
            f"CoupledPruningCallback: clustered parameters {orphan[:5]} are in no optimizer. Their dropped units are "
            "set to zero but they are never updated; add them to `configure_optimizers` or remove them from the "
            "clusters."
        )


def warn_short_fit(*, schedule: Schedule, step: int, steps_left: float) -> None:
    """Warn when the fit ends before the final ramp step (the final target would never be applied)."""
    if steps_left == float("inf"):
        return
    end = step + int(steps_left)
    if end < schedule.final_step:
        frac = schedule.fraction(end)
        rank_zero_warn(
            f"CoupledPruningCallback: this fit ends after optimizer step {end}, before the final ramp step "
            f"{schedule.final_step} (warmup {schedule.warmup_steps} + ramp {schedule.ramp_steps}); the mask will only "
            f"reach {frac:.0%} of the target and is not frozen. Raise max_steps/max_epochs or shorten the schedule."
        )


def check_resumed_options(saved: Mapping[str, Any], current: Mapping[str, Any], *, step: int, final: bool) -> None:
    """Compare the options a checkpoint was written with to the current ones (resume).

    Changed options apply from the saved step on (a warning lists them), except where they could not take effect.

    Raises:
        MisconfigurationException: If the saved step lies in the ramp but the new schedule's final step is already
            past (the final mask would never be applied), or the mask is frozen (healing) and an option that
            shapes it changed.
    """
    changed = {k: (saved[k], current.get(k)) for k in saved if k in current and saved[k] != current[k]}
    if not changed:
        return
    desc = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in changed.items()))
    new_final = int(current["warmup_steps"]) + int(current["ramp_steps"])
    if not final and step >= new_final:
        raise MisconfigurationException(
            f"CoupledPruningCallback: the checkpoint was taken at step {step} inside the ramp, but the changed options "
            f"({desc}) put the final ramp step at {new_final}, already past; the final mask would never be applied. "
            f"Keep warmup_steps + ramp_steps > {step}."
        )
    shaping = {"target_sparsity", "method", "score", "reg_lambda", "group_count_ref", "mode"}
    if final and current.get("heal", True) and shaping & set(changed):
        raise MisconfigurationException(
            f"CoupledPruningCallback: the checkpoint was taken at step {step}, after the final ramp step, so its mask "
            f"is frozen; the changed options ({desc}) cannot change it. Resume with the saved options "
            f"({ {k: saved[k] for k in shaping & set(changed)} }), or start a new run (a fresh Trainer) to prune again."
        )
    rank_zero_warn(
        f"CoupledPruningCallback: resuming at step {step} with changed options ({desc}); the schedule continues from "
        "the saved step with the new options."
    )


def agreed_plan(build: Callable[[], Plan], *, options: Mapping[str, Any]) -> Plan:
    """Build the plan on every rank and compare its clusters and routes (or this rank's error) across ranks.

    Raises:
        MisconfigurationException: If ``build`` raises a ``ValueError`` on any rank or the ranks disagree (every
            rank raises the same error, see :func:`check_rank_agreement`).
    """
    plan, error = None, None
    try:
        plan = build()
    except ValueError as err:
        error = f"CoupledPruningCallback: {err}"
    clusters = [rc.fingerprint() for rc in plan.clusters] if plan is not None else None
    routes = plan.routes if plan is not None else None
    check_rank_agreement({"clusters": clusters, "routes": routes, "options": options}, error)
    assert plan is not None
    return plan


def check_rank_agreement(digest: dict[str, Any], error: str | None) -> None:
    """Compare (clusters, routes, options) or a rank's local error across all ranks in one collective.

    Raises:
        MisconfigurationException: The same error on every rank if any rank failed to resolve its clusters (its
            message, naming the rank) or the digests differ (naming the parts and the ranks).
    """
    mine = error or hashlib.sha256(json.dumps(digest, sort_keys=True, default=str).encode()).hexdigest()
    everyone = D.gather_objects((error is not None, mine, digest), group=D.world_group())
    failed = [(r, m) for r, (bad, m, _) in enumerate(everyone) if bad]
    if failed:
        rank, msg = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise MisconfigurationException(f"{msg} [raised on rank {rank}{others}; all ranks stop here]")
    if len({m for _, m, _ in everyone}) > 1:
        ref = everyone[0][2]
        diff = sorted({k for _, _, d in everyone for k in d if d[k] != ref[k]})
        ranks = [r for r, (_, m, _) in enumerate(everyone) if m != everyone[0][1]]
        raise MisconfigurationException(
            f"CoupledPruningCallback: ranks disagree on {diff} (ranks {ranks} differ from rank 0). Every rank "
            "must build the same model and pass the same cluster declarations and options; check code that "
            "depends on the rank (e.g. `if trainer.global_rank == 0`)."
        )


def check_mask_not_empty(
    plan: Plan, pruner: Pruner, *, schedule: Schedule, step: int, heal: bool, target_sparsity: float
) -> None:
    """Never heal with an empty mask where the final target requires dropped units.

    Raises:
        MisconfigurationException: If, past the final ramp step with healing, a cluster whose target drops units
            has none dropped.
    """
    if schedule.phase(step) not in ("final", "healing") or not heal:
        return
    targets = plan.targets(target_sparsity)
    empty = [
        rc.name
        for rc in plan.clusters
        if not pruner.dropped(rc.name) and num_to_drop(targets[rc.name], rc.num_units) > 0
    ]
    if empty:
        raise MisconfigurationException(
            f"CoupledPruningCallback: at step {step} (after the final ramp step) clusters {empty[:5]} have no dropped "
            "units although the target requires some; refusing to heal with an empty mask. Resume from a checkpoint "
            "of this run, or start a new run with a fresh Trainer."
        )


def check_fresh_start(trainer: pl.Trainer, *, state_key: str) -> None:
    """Check that a fit without a saved or carried callback state really starts at step 0.

    Raises:
        MisconfigurationException: If the fit resumes from a checkpoint (global step > 0) that holds no state under
            ``state_key``.
    """
    if trainer.global_step > 0:
        raise MisconfigurationException(
            f"CoupledPruningCallback: the fit resumes at global step {trainer.global_step} from "
            f"{trainer.ckpt_path!r}, which holds no state under this callback's key {state_key!r} (the "
            "cluster declaration names identify it). Resume with the same cluster names, or, to start pruning "
            "from trained weights, load them into the module and fit with a fresh Trainer without `ckpt_path`."
        )


def check_restorable(
    state: Mapping[str, Any],
    *,
    fingerprints: Mapping[str, str],
    options: Mapping[str, Any],
    schedule: Schedule,
    latent_mode: bool,
    heal: bool,
) -> bool:
    """Check that a saved callback state can be continued exactly; return whether latent copies must be restored.

    Raises:
        MisconfigurationException: If the clusters' fingerprints differ, changed options cannot take effect (see
            :func:`check_resumed_options`), or latent mode must continue a ramp but the state has no latents.
    """
    saved = state.get("fingerprints", {})
    if saved and saved != fingerprints:
        changed = sorted(k for k in set(saved) | set(fingerprints) if saved.get(k) != fingerprints.get(k))
        raise MisconfigurationException(
            f"CoupledPruningCallback: the checkpoint was written for different clusters ({changed[:5]} differ); "
            "resume with the same cluster declarations and model, or start a new run."
        )
    step = int(state.get("step", 0))
    saved_options = state.get("options")
    if saved_options is not None:
        final = step >= int(saved_options["warmup_steps"]) + int(saved_options["ramp_steps"])
        check_resumed_options(saved_options, options, step=step, final=final)
    needs = latent_mode and schedule.phase(step) != "warmup"
    needs = needs and schedule.action(step + 1, heal=heal) in ("select", "hold")
    if needs and state.get("latent") is None:
        raise MisconfigurationException(
            f"CoupledPruningCallback: the checkpoint (state version {state.get('version', 1)}, step {step}, final "
            f"step {schedule.final_step}) holds no latent copies, so latent mode cannot continue the ramp exactly. "
            "Resume with mode='direct', or resume from a checkpoint written by this version."
        )
    return needs


def check_selection_agreement(dropped: Mapping[str, list[int]], *, step: int) -> None:
    """Debug check: compare a hash of the selection across all ranks (one small collective).

    Raises:
        RuntimeError: On every rank, if some rank selected different units than rank 0.
    """
    digest = hashlib.sha256(json.dumps(dropped, sort_keys=True).encode()).hexdigest()
    everyone = D.gather_objects(digest, group=D.world_group())
    if len(set(everyone)) > 1:
        ranks = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(
            f"CoupledPruningCallback (debug_check_selection): at step {step} ranks {ranks} selected different units "
            "than rank 0; the selection is not identical across the mesh."
        )
