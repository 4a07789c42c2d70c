"""Reading a saved pruning state: where it sits in a checkpoint, its ``"distill"`` entry, what it says (pure).

The checks themselves are :mod:`lightning_pat.core.state_schema`'s; this module is what training, the shrink and
``lightning-pat shrink`` call to get at a state, so that each of these facts has one place:

* :func:`callback_state`: the callback's state inside a Lightning checkpoint dict (under its ``state_key``, or the
  one ``CoupledPruningCallback`` state); :func:`is_checkpoint` tells a checkpoint dict from a state;
* :data:`DISTILL` and :func:`split_distill`: the distillation teacher's entry, next to the schema's keys;
* :func:`read_state`: a state checked against the schema, as a :class:`SavedState` (clusters rebuilt, the dropped
  units, the step, the saved options and their final ramp step, whether the model was shrunk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pat.core.schedule import final_step_of
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.state_schema import REQUIRED, StateContext, check_state

#: The state's entry for the distillation teacher (beside the schema's keys; see ``training/distill.py``).
DISTILL = "distill"
#: The prefix of the callback's ``state_key`` in a checkpoint's ``callbacks`` (a recipe subclass keeps it).
CALLBACK_PREFIX = "CoupledPruningCallback"


def is_checkpoint(source: Mapping[str, Any]) -> bool:
    """Whether ``source`` is a whole Lightning checkpoint dict rather than the callback's state.

    Example::

        >>> is_checkpoint({"state_dict": {}, "callbacks": {}}), is_checkpoint({"step": 0, "dropped": {}})
        (True, False)
    """
    return "callbacks" in source and "clusters" not in source


def callback_state(ckpt: Mapping[str, Any], *, key: str | None = None) -> Any:
    """The callback's state inside a Lightning checkpoint dict (the one place that looks it up).

    Args:
        ckpt: The checkpoint (``torch.load`` of a ``.ckpt`` file, or the dict Lightning restores from).
        key: The callback's ``state_key``: the state stored under it is returned (``None`` if there is none). Without
            it, the checkpoint must hold exactly one ``CoupledPruningCallback`` state, and it must be a mapping.

    Returns:
        The callback's state (what its ``state_dict()`` returned).

    Raises:
        ValueError: If ``callbacks`` is not a mapping; without ``key``, if the checkpoint holds no
            ``CoupledPruningCallback`` state, several, or one that is not a mapping.

    Example::

        >>> callback_state({"callbacks": {"CoupledPruningCallback{'clusters': ['h']}": {"step": 3}}})
        {'step': 3}
    """
    callbacks = ckpt.get("callbacks") or {}
    if not isinstance(callbacks, Mapping):
        who = "shrink" if key is None else CALLBACK_PREFIX
        raise ValueError(
            f"{who}: the checkpoint's 'callbacks' entry must be a mapping, got {type(callbacks).__name__}; it was "
            "edited or is not a Lightning checkpoint."
        )
    if key is not None:
        return callbacks.get(key)
    keys = [k for k in callbacks if str(k).startswith(CALLBACK_PREFIX)]
    if len(keys) != 1:
        found = "no CoupledPruningCallback state" if not keys else f"{len(keys)} CoupledPruningCallback states {keys}"
        raise ValueError(
            f"shrink: the checkpoint holds {found} under 'callbacks' (keys: {list(callbacks)[:5]}); pass the "
            "callback's state itself (ckpt['callbacks'][key]) or a checkpoint of a run with exactly one such callback."
        )
    state = callbacks[keys[0]]
    if not isinstance(state, Mapping):
        raise ValueError(
            f"shrink: the checkpoint's CoupledPruningCallback state is a {type(state).__name__}, not a mapping."
        )
    return state


def split_distill(state: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The state without its :data:`DISTILL` entry (what the schema checks), and that entry (``None`` if absent).

    Example::

        >>> split_distill({"step": 1, "distill": {"names": []}})
        ({'step': 1}, {'names': []})
    """
    body = dict(state)
    return body, body.pop(DISTILL, None)


def is_shrunk(state: Mapping[str, Any] | None) -> bool:
    """Whether a state records that the model was physically shrunk (``shrink_on_freeze``); checked by the reader."""
    return bool(state and state.get("shrunk"))


def saved_score(state: Mapping[str, Any] | None) -> str | None:
    """The score a state was written with (its ``options["score"]``), read before the state is checked; else ``None``.

    Example::

        >>> saved_score({"options": {"score": "rms"}}), saved_score({"options": [1]}), saved_score(None)
        ('rms', None, None)
    """
    options = None if state is None else state.get("options")
    score = options.get("score") if isinstance(options, Mapping) else None
    return score if isinstance(score, str) else None


@dataclass(frozen=True)
class SavedState:
    """A saved pruning state, checked against the schema (see :func:`read_state`).

    Attributes:
        clusters: The saved clusters, rebuilt (each checked against its fingerprint).
        dropped: Cluster name -> dropped unit indices of the saved mask.
        step: Completed real optimizer steps when it was saved.
        options: The saved options (:data:`lightning_pat.pruning.options.RESUMABLE`, with the score in use).
        shrunk: Whether the model was physically shrunk (``shrink_on_freeze``).
        state: The checked state itself (without :data:`DISTILL`).
    """

    clusters: list[ResolvedCluster]
    dropped: dict[str, list[int]]
    step: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    shrunk: bool = False
    state: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def final_step(self) -> int:
        """The final ramp step of the saved options (:func:`~lightning_pat.core.schedule.final_step_of`)."""
        return final_step_of(self.options)

    @property
    def is_final(self) -> bool:
        """Whether the state was saved at or after its final ramp step (the mask is final)."""
        return self.step >= self.final_step


def read_state(
    state: Mapping[str, Any],
    *,
    what: str,
    required: Sequence[str] = REQUIRED,
    context: StateContext | None = None,
) -> SavedState:
    """Check a saved state against the schema (its :data:`DISTILL` entry aside) and read it.

    Args:
        state: The callback's state (what its ``state_dict()`` returned).
        what: The state's name for messages.
        required: The entries the state must hold (a resume needs ``step``; a shrink only ``dropped``).
        context: What the run knows that the state must agree with.

    Returns:
        The state, read.

    Raises:
        StateError: As for :func:`~lightning_pat.core.state_schema.check_state`.

    Example::

        >>> read_state({"step": 4, "dropped": {}, "options": {"warmup_steps": 1, "ramp_steps": 3}}, what="s").is_final
        True
    """
    body, _ = split_distill(state)
    clusters = check_state(body, context=context, what=what, required=required)
    return SavedState(
        clusters=clusters,
        dropped={str(k): [int(i) for i in v] for k, v in body.get("dropped", {}).items()},
        step=int(body.get("step", 0)),
        options=dict(body.get("options") or {}),
        shrunk=bool(body.get("shrunk", False)),
        state=body,
    )


__all__ = [
    "CALLBACK_PREFIX",
    "DISTILL",
    "SavedState",
    "callback_state",
    "is_checkpoint",
    "is_shrunk",
    "read_state",
    "saved_score",
    "split_distill",
]
