"""The callback's state across fits: build a checkpoint entry or a carried state, and apply one (no Lightning here).

* :func:`key_names`, :func:`legacy_state_key`: what identifies the callback's entry in a checkpoint.
* :func:`checkpoint_state`: the callback's ``state_dict`` (format version :data:`STATE_VERSION`): progress, mask,
  group-lasso factors, fingerprints and resolved clusters, options, latent copies, whether the model was shrunk, and
  every rank's activation statistics.
* :func:`carry_state`: what the same Trainer's next ``fit`` continues from, kept in memory (the latents only during
  the ramp).
* :func:`apply_state`: set the engine (mask, latents, activation statistics) from either, and return the progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_pat import distributed as D
from lightning_pat._state import Progress

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_pat.activation import ActivationStats
    from lightning_pat.engine import Pruner
    from lightning_pat.latent import LatentStore
    from lightning_pat.spec import Cluster, ResolvedCluster

#: Version 1 had no ``options``, no ``gamma_prox`` and a state key that included ``target_sparsity``.
STATE_VERSION = 2


def key_names(clusters: str | Sequence[Cluster | str]) -> str:
    """The state key's ``clusters`` value: the preset name, or the declarations' names joined by commas."""
    if isinstance(clusters, str):
        return clusters
    return ",".join(c if isinstance(c, str) else c.name for c in clusters)


def legacy_state_key(state_key: str, *, qualname: str, target_sparsity: float) -> str:
    """The key state version 1 used for the same callback (it included ``target_sparsity``).

    Example::

        >>> legacy_state_key("Cb{'clusters': 'llama'}", qualname="Cb", target_sparsity=0.5)
        "Cb{'clusters': 'llama', 'target_sparsity': 0.5}"
    """
    names = state_key[len(qualname) :]
    return qualname + names[:-1] + f", 'target_sparsity': {target_sparsity!r}}}"


def checkpoint_state(
    progress: Progress,
    *,
    pruner: Pruner | None,
    dropped: Mapping[str, list[int]],
    resolved: Sequence[ResolvedCluster],
    options: Mapping[str, Any],
    latent: dict[str, Any] | None,
    shrunk: bool,
    act: ActivationStats | None,
) -> dict[str, Any]:
    """The checkpoint entry (plain types and CPU tensors; gathers the activation statistics, a collective).

    Args:
        progress: Steps and group-lasso step sizes.
        pruner: The engine holding the mask and group-lasso factors (``None`` before fit start or once shrunk).
        dropped: Cluster name -> dropped unit indices.
        resolved: The resolved clusters (their fingerprints and full definitions are saved).
        options: The options that may change on resume.
        latent: The latent copies' entry (see :mod:`lightning_pat._state`), or ``None`` outside the ramp.
        shrunk: Whether the model was physically shrunk.
        act: The activation statistics (``score="activation"``), or ``None``.
    """
    factors = {} if pruner is None else {k: v.detach().cpu() for k, v in pruner.factors().items()}
    return {
        "version": STATE_VERSION,
        **progress.state_dict(),
        "dropped": dropped,
        "factors": factors,
        "fingerprints": {rc.name: rc.fingerprint() for rc in resolved},
        "clusters": [rc.to_dict() for rc in resolved],
        "options": dict(options),
        "latent": latent,
        "shrunk": shrunk,
        "activation": None if act is None else D.gather_objects(act.state_dict(), group=D.world_group()),
    }


def carry_state(
    progress: Progress,
    *,
    pruner: Pruner,
    dropped: Mapping[str, list[int]],
    latents: LatentStore | None,
    act: ActivationStats | None,
) -> dict[str, Any]:
    """The in-memory state the same Trainer's next ``fit`` continues from (this rank's own; no collective)."""
    return {
        **progress.state_dict(),
        "dropped": dropped,
        "factors": pruner.factors(),
        "latents": latents.state_dict() if latents is not None and latents.active else {},
        "activation": None if act is None else act.state_dict(),
    }


def rank_activation(saved: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
    """This rank's saved activation statistics (rank 0's if the checkpoint has fewer ranks); ``None`` if none."""
    if not saved:
        return None
    rank = D.world_rank()
    return saved[rank] if rank < len(saved) else saved[0]


def apply_state(
    state: Mapping[str, Any],
    *,
    pruner: Pruner,
    latents: LatentStore,
    act: ActivationStats | None,
    saved_latents: Mapping[str, Tensor] | None,
    activation: Mapping[str, Any] | None,
) -> Progress:
    """Set the mask, latents and activation statistics from a checkpoint or carried state; return its progress.

    Nothing is applied to the weights (the caller projects them with ``pruner.hold()``).

    Args:
        state: A :func:`checkpoint_state` or :func:`carry_state` (``dropped``, ``factors`` and the progress).
        pruner: The engine; its mask and factors are replaced.
        latents: The latent store; loaded from ``saved_latents``, or cleared when that is ``None``.
        act: The activation statistics, if any; loaded from ``activation`` (``None``: start empty, e.g. the score
            was changed on resume, and statistics are collected from here on).
        saved_latents: This rank's latent copies, or ``None``.
        activation: This rank's activation statistics, or ``None``.

    Raises:
        ValueError: If the latents or the activation statistics do not match the model.
    """
    progress = Progress.from_state(state)
    pruner.load_dropped(state.get("dropped", {}), state.get("factors", {}))
    if saved_latents is None:
        latents.clear()
    else:
        latents.load_state_dict(saved_latents)
    if act is not None:
        act.load_state_dict(activation or {})
    return progress
