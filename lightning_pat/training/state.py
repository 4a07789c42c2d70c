"""The pruning state: one schema, built and read here, for checkpoints and for the same Trainer's next fit.

A state is a dict of plain types and CPU tensors::

    step, gamma, gamma_prox   progress (real optimizer steps, sums of learning rates for the group-lasso prox step)
    dropped                   cluster name -> dropped unit indices of the current mask
    factors                   cluster name -> group-lasso factors of the current mask
    fingerprints, clusters    the resolved clusters (fingerprints to refuse another model, definitions to shrink)
    options                   the options that may change on resume (:data:`lightning_pat.pruning.options.RESUMABLE`)
    latents                   the latent copies during the ramp (``None`` otherwise), ``{"format": ..., ...}``
    shrunk                    whether the model was physically shrunk (``shrink_on_freeze``)
    activation                the ranks' activation statistics in rank order (``score="activation"``), else ``None``;
                              a list shorter than the world gives every missing rank the first entry
    taylor                    ``score="taylor"``: the ``|w * g|`` sums since the last selection, per rank (sharded
                              partials) or one entry (plain parameters), else ``None``
    layer_scores              the ranks' layer-score sums since the last selection, in rank order (layer units with
                              ``layer_score="cosine"``), else ``None``; read like ``activation``
    expert_scores             the ranks' per-expert token counts and router-weighted output norms since the last
                              selection, in rank order (only in a run with expert clusters and a data
                              ``expert_score``; absent otherwise, as in states written before it existed)
    allocation                a size target solved by importance at the first selection: ``{"rule": "importance",
                              "step", "options", "size"}`` (the clusters' targets are in ``clusters``); else ``None``
                              (not solved yet, or solved by fractions at fit start, which a resume solves again)

Latent formats, by layout: ``local`` (this rank's live tensors, only kept in memory for the next fit), ``tensors``
(plain parameters, identical on every rank: DDP, one device), ``per_rank`` (FSDP1 flat shards: every rank's pieces,
gathered), ``full`` (DTensors in a full checkpoint: gathered into full tensors, each rank slices its piece back on
restore) and ``dcp`` (DTensors in a distributed checkpoint). A ``dcp`` state holds only the names: Lightning writes
the callbacks' states with rank 0's metadata, so the sharded latents travel as model-state entries under
:data:`DCP_PREFIX` (each rank writes its own shards, resharding on load works) and are read back with the torch
distributed checkpoint reader. No Lightning here; errors are ``ValueError``.

The scorers' entries (``activation``, ``taylor``, ``layer_scores``, ``expert_scores``) are their own
(:class:`~lightning_pat.scoring.collector.Collector`): the run's
:class:`~lightning_pat.training.collectors.Collectors` build, check and read them. In the same process's next fit
(the in-memory state) each holds this rank's own state, a mapping, instead of the ranks' list.

A restored state is checked before any of it is applied (:func:`check_saved`, on every rank): against the one schema
of :mod:`lightning_pat.core.state_schema` (in ``core`` so that ``lightning-pat shrink`` and the shrink floor use the
same one) and against the run (:func:`restore_context`: the trainer's ``global_step``, the clusters, the latents'
shapes and dtypes, and the scorers' checks of their entries).

Why not the optimizer state (``optimizer.state[p]["pat_latent"]``, which torch's distributed optimizer state dict
saves sharded)? Lightning's sharded load (``lightning.fabric.strategies.model_parallel._load_checkpoint``) reads each
optimizer through a template from the live optimizer, built after the callback's ``on_fit_start`` but from a fresh
optimizer: a saved extra key is dropped without an error. Adding template entries in ``on_fit_start`` makes torch
skip its own state initialization (``_init_optim_state`` returns for a non-empty state), so Adam's moments vanish
from the template and the load fails; it works only by calling that private torch function first, and only if the
checkpoint holds latents (a warmup or healing checkpoint has none, and a template key the checkpoint lacks is an
error), which would mean reading the checkpoint's metadata before Lightning does. ``tests/unit/training/test_state.py``
(``test_optimizer_state_cannot_carry_latents_through_lightnings_sharded_load``) pins this behaviour down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pat.core.saved_state import read_state
from lightning_pat.core.schedule import Schedule, final_step_of
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.state_schema import EntryCheck, StateContext, check_state
from lightning_pat.parallel.comm import dcp, dtensor, ranks
from lightning_pat.pruning.options import MASK_SHAPING
from lightning_pat.training import latent
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.errors import WHO
from lightning_pat.training.progress import Progress

SIDE_PREFIX = "_lightning_pat."  # model-state keys that carry pruning state in a distributed checkpoint (not weights)
DCP_PREFIX = SIDE_PREFIX + "latent."  # the sharded latents
#: How a restored state is named in the messages of :func:`check_saved`.
WHAT = f"{WHO}: the checkpoint's pruning state"
TEACHER_PREFIX = SIDE_PREFIX + "teacher."  # the sharded distillation teacher (see lightning_pat.training.distill)


def build(
    progress: Progress,
    *,
    dropped: Mapping[str, list[int]],
    factors: Mapping[str, Tensor],
    clusters: Sequence[Any],
    options: Mapping[str, Any],
    latents: dict[str, Any] | None,
    shrunk: bool,
    collectors: Collectors,
    gather: bool = True,
    allocation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A state (see the module docstring); ``clusters`` are resolved clusters (fingerprints and definitions).

    The scorers' entries are the ``collectors``' own (:meth:`~lightning_pat.training.collectors.Collectors.state_dicts`:
    with ``gather`` the ranks' states, a collective; else this rank's own).
    """
    return {
        **progress.state_dict(),
        "dropped": {k: list(v) for k, v in dropped.items()},
        "factors": {k: v.detach().cpu() for k, v in factors.items()},
        "fingerprints": {rc.name: rc.fingerprint() for rc in clusters},
        "clusters": [rc.to_dict() for rc in clusters],
        "options": dict(options),
        "latents": latents,
        "shrunk": shrunk,
        **collectors.state_dicts(gather=gather),
        "allocation": allocation,
    }


# ---------------------------------------------------------------------- latents
def latent_format(params: Iterable[Tensor], *, fsdp1: bool, sharded_ckpt: bool) -> str:
    """How latents of these parameters are written to a checkpoint (see the module docstring)."""
    if fsdp1:
        return "per_rank"
    if any(dtensor.is_dtensor(p) for p in params):
        return "dcp" if sharded_ckpt else "full"
    return "tensors"


def latent_entry(local: Mapping[str, Tensor], params: Mapping[str, Tensor], *, fmt: str) -> dict[str, Any]:
    """The ``latents`` entry for rank-local latents ``local`` (a collective for ``per_rank`` and ``full``)."""
    if fmt == "local":
        return {"format": fmt, "tensors": dict(local)}
    if fmt == "tensors":
        return {"format": fmt, "tensors": {n: t.detach().cpu().clone() for n, t in local.items()}}
    if fmt == "per_rank":
        mine = {n: t.detach().cpu().clone() for n, t in local.items()}
        return {"format": fmt, "tensors": ranks.gather_objects(mine, group=ranks.world_group())}
    if fmt == "full":
        full = {n: dtensor.full_tensor(dtensor.as_dtensor(t, params[n])).cpu() for n, t in local.items()}
        return {"format": fmt, "tensors": full}
    return {"format": fmt, "names": sorted(local)}


def sharded_latents(
    local: Mapping[str, Tensor], params: Mapping[str, Tensor], *, prefix: str = DCP_PREFIX
) -> dict[str, Tensor]:
    """Model-state entries (DTensors laid out like their parameters, keys under ``prefix``) for a ``dcp`` checkpoint."""
    return {prefix + n: dtensor.as_dtensor(t, params[n]) for n, t in local.items()}


def read_latents(
    entry: Mapping[str, Any], params: Mapping[str, Tensor], *, ckpt_path: Any, prefix: str = DCP_PREFIX
) -> dict[str, Tensor]:
    """Rank-local tensors from a ``latents`` entry (a ``dcp`` entry reads the keys under ``prefix`` at ``ckpt_path``).

    The same formats carry the sharded distillation teacher (``prefix`` :data:`TEACHER_PREFIX`).
    """
    fmt = entry["format"]
    if fmt in ("local", "tensors"):
        return dict(entry["tensors"])
    if fmt == "per_rank":
        return dict(entry["tensors"][ranks.world_rank()])
    if fmt == "full":
        return {n: dtensor.shard_like(t, params[n]) for n, t in entry["tensors"].items()}
    like = {n: params[n] for n in entry["names"]}
    holders = {prefix + n: dtensor.as_dtensor(torch.empty_like(dtensor.local_tensor(p)), p) for n, p in like.items()}
    dcp.load_sharded_({"state_dict": holders}, ckpt_path)
    return {n: dtensor.local_tensor(holders[prefix + n]) for n in like}


# ---------------------------------------------------------------------- resume checks
def restore_context(
    *,
    global_step: int | None,
    clusters: Sequence[ResolvedCluster] | None = None,
    params: Mapping[str, Tensor] | None = None,
    latent_names: Sequence[str] = (),
    entries: Mapping[str, EntryCheck] | None = None,
) -> StateContext:
    """What a run restoring a state knows (see :class:`~lightning_pat.core.state_schema.StateContext`).

    Args:
        global_step: The trainer's optimizer steps so far (``None``: not known).
        clusters: The run's resolved clusters.
        params: Parameter name -> live parameter (for the latents' shapes and dtypes).
        latent_names: The parameters that get a latent copy.
        entries: The scorers' checks of their entries (:meth:`~lightning_pat.training.collectors.Collectors.checks`).
    """
    facts = None
    if params is not None:
        facts = {
            n: latent.TensorFacts(tuple(params[n].shape), tuple(dtensor.local_tensor(params[n]).shape), params[n].dtype)
            for n in latent_names
        }
    world, rank = ranks.world_size(), ranks.world_rank()

    def latents(raw: object, what: str) -> None:
        latent.check_entry(raw, what, facts=facts, world=world, rank=rank)

    return StateContext(global_step=global_step, clusters=clusters, entries={"latents": latents, **(entries or {})})


def check_saved(saved: Mapping[str, Any], context: StateContext) -> None:
    """Check a restored state against the schema and the run, before anything of it is applied.

    Raises:
        ValueError: Naming the field, what was expected and what was found (see
            :func:`~lightning_pat.core.state_schema.check_state`).
    """
    check_state(saved, context=context, what=WHAT)


def check_resumed_options(saved: Mapping[str, Any], current: Mapping[str, Any], *, step: int, final: bool) -> None:
    """Compare the options a state was written with to the current ones (resume).

    Changed options apply from the saved step on (a warning lists them), except where they could not take effect.

    Raises:
        ValueError: If the saved step lies in the ramp but the new schedule's final step is already past (the final
            mask would never be applied), or the mask is frozen (healing) and an option that shapes it changed.
    """
    changed = {k: (saved[k], current.get(k)) for k in saved if k in current and saved[k] != current[k]}
    if not changed:
        return
    desc = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in changed.items()))
    new_final = final_step_of(current)
    if not final and step >= new_final:
        raise ValueError(
            f"{WHO}: the checkpoint was taken at step {step} inside the ramp, but the changed options "
            f"({desc}) put the final ramp step at {new_final}, already past; the final mask would never be applied. "
            f"Keep warmup_steps + ramp_steps > {step}."
        )
    shaping = MASK_SHAPING & set(changed)
    if final and current.get("heal", True) and shaping:
        raise ValueError(
            f"{WHO}: the checkpoint was taken at step {step}, after the final ramp step, so its mask "
            f"is frozen; the changed options ({desc}) cannot change it. Resume with the saved options "
            f"({ {k: saved[k] for k in shaping} }), or start a new run (a fresh Trainer) to prune again."
        )
    ranks.rank_zero_warn(
        f"{WHO}: resuming at step {step} with changed options ({desc}); the schedule continues from "
        "the saved step with the new options."
    )


def check_restorable(
    state: Mapping[str, Any],
    *,
    fingerprints: Mapping[str, str],
    options: Mapping[str, Any],
    schedule: Schedule,
    latent_mode: bool,
    heal: bool,
    context: StateContext | None = None,
) -> bool:
    """Check that a saved state can be continued exactly; return whether latent copies must be restored.

    The state is first checked against its schema and ``context`` (:func:`check_saved`).

    Raises:
        ValueError: If the state does not fit the schema or the run, the clusters' fingerprints differ, changed
            options cannot take effect (see :func:`check_resumed_options`), or latent mode must continue a ramp but
            the state has no latents.
    """
    read = read_state(state, context=context if context is not None else StateContext(), what=WHAT)
    saved = state.get("fingerprints", {})
    if saved != fingerprints:
        changed = sorted(k for k in set(saved) | set(fingerprints) if saved.get(k) != fingerprints.get(k))
        raise ValueError(
            f"{WHO}: the checkpoint was written for different clusters ({changed[:5]} differ); "
            "resume with the same cluster declarations and model, or start a new run."
        )
    step, saved_options = read.step, read.options
    check_resumed_options(saved_options, options, step=step, final=read.is_final)
    needs = latent_mode and schedule.phase(step) != "warmup"
    needs = needs and schedule.action(step + 1, heal=heal) in ("select", "hold")
    if needs and state.get("latents") is None:
        raise ValueError(
            f"{WHO}: the checkpoint (step {step}, final step {schedule.final_step}, mode "
            f"{saved_options.get('mode')!r}) holds no latent copies, so latent mode cannot continue the ramp exactly. "
            "Resume with mode='direct', or resume from a checkpoint written in latent mode."
        )
    return needs


# ---------------------------------------------------------------------- a resume reads the state once
@dataclass(frozen=True)
class Restored:
    """A saved state as a resume applies it: checked (schema, run, continuation) and read, latents included.

    Attributes:
        progress: The saved step and sums of learning rates.
        dropped: Cluster name -> dropped unit indices of the saved mask.
        factors: Cluster name -> group-lasso factors of the saved mask.
        latents: This rank's latent copies, if the schedule needs them (else ``None``: they are dropped).
        state: The state itself (the scorers read their ``activation``, ``taylor`` and ``layer_scores`` entries).
    """

    progress: Progress
    dropped: Mapping[str, Sequence[int]]
    factors: Mapping[str, Tensor]
    latents: Mapping[str, Tensor] | None
    state: Mapping[str, Any]

    @classmethod
    def carried(cls, carry: Mapping[str, Any]) -> Restored:
        """The in-memory state a previous fit of the same Trainer kept (this process's own: nothing to check)."""
        entry = carry.get("latents")
        return cls(
            Progress.from_state(carry), carry.get("dropped", {}), carry.get("factors", {}),
            entry["tensors"] if entry else None, carry,
        )  # fmt: skip


@dataclass(frozen=True)
class ReadContext:
    """What a resume checks a saved state against and reads it with (``resume`` builds it from the bound run).

    Attributes:
        checks: What the schema checks the state against (:func:`restore_context`: the trainer's ``global_step``,
            the run's clusters, whose fingerprints must match, the latents' shapes and dtypes, the scorers' readers
            and layers).
        params: Parameter name -> live parameter (the latents are read like them).
        options: The run's resumable options, the score in use included (compared with the saved ones).
        schedule: The run's schedule.
        latent_mode: Whether the run is in latent mode (a ramp it continues needs the saved latents).
        heal: Whether the mask freezes after the final ramp step.
    """

    checks: StateContext
    params: Mapping[str, Tensor]
    options: Mapping[str, Any]
    schedule: Schedule
    latent_mode: bool
    heal: bool


def read(
    saved: Mapping[str, Any],
    context: ReadContext,
    ckpt_path: Any,
    before_latents: Callable[[Mapping[str, Sequence[int]]], None] | None = None,
) -> Restored:
    """Check a restored state against the schema, the run and its continuation, then read it (on every rank).

    The local checks run under :func:`~lightning_pat.parallel.ranks.together`: a rank-local failure (a latent's
    local shape) stops every rank. ``before_latents`` (the dropped units' zero check, a reduction) runs after them and
    before the latents are read (a distributed checkpoint's are a collective read).

    Args:
        saved: The state (without ``"distill"``).
        context: What the run checks it against and reads it with.
        ckpt_path: The checkpoint (a ``dcp`` latent entry is read there).
        before_latents: Called with the saved dropped units once the checks passed.

    Raises:
        ValueError: As for :func:`check_restorable`, and whatever ``before_latents`` raises.
    """
    clusters = context.checks.clusters
    assert clusters is not None
    needs_latents = False
    with ranks.together():
        needs_latents = check_restorable(
            saved,
            fingerprints={rc.name: rc.fingerprint() for rc in clusters},
            options=context.options,
            schedule=context.schedule,
            latent_mode=context.latent_mode,
            heal=context.heal,
            context=context.checks,
        )
    dropped = saved["dropped"]
    if before_latents is not None:
        before_latents(dropped)
    entry = saved.get("latents")
    latents = read_latents(entry, context.params, ckpt_path=ckpt_path) if needs_latents and entry else None
    return Restored(Progress.from_state(saved), dropped, saved.get("factors", {}), latents, saved)


def read_progress(saved: Mapping[str, Any], *, global_step: int | None) -> Progress:
    """The progress of a restored state for a model that is already shrunk (the state is checked first).

    Raises:
        ValueError: If the state does not fit the schema (see :func:`check_saved`).
    """
    check_saved(saved, restore_context(global_step=global_step))
    return Progress.from_state(saved)
