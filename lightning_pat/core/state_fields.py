"""The field readers of the pruning state's schema: typed, ranged, named errors (pure, no Lightning).

:class:`FieldChecker` reads one field of an untrusted saved state at a time (a mapping, a list, an int or a number in
a range, a finite floating-point tensor of a shape, names among known ones) and raises a :class:`StateError` that
names the state, the field, what was expected, what was found and the fix. The schema that uses them is
:mod:`lightning_pat.core.state_schema`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

#: The fix a message names when a field does not fit.
FIX = "the checkpoint was edited or not written by lightning_pat; use an unedited checkpoint of this run"


class StateError(ValueError):
    """A saved pruning state that does not fit the schema (or the run it is restored into)."""


def _range(low: float | None, high: float | None) -> str:
    """``must be in [low, high]``, ``must be >= low`` or ``must be <= high``: the words for a range."""
    if low is not None and high is not None:
        return f"must be in [{low}, {high}]"
    return f"must be >= {low}" if low is not None else f"must be <= {high}"


class FieldChecker:
    """Typed readers of a saved state's fields; each returns the value or raises a :class:`StateError` naming it.

    Args:
        what: The state's name, the first words of every message.

    Example::

        >>> FieldChecker("the state").integer(3, "step", high=5)
        3
        >>> try:
        ...     FieldChecker("the state").integer(9, "step", high=5)
        ... except StateError as err:
        ...     print(str(err).split(";")[0])
        the state: `step` must be in [0, 5], got 9
        >>> try:
        ...     FieldChecker("the state").integer(-5, "step")
        ... except StateError as err:
        ...     print(str(err).split(";")[0])
        the state: `step` must be >= 0, got -5
    """

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, where: str, problem: str, fix: str = FIX) -> StateError:
        """The error for field ``where``: ``problem`` and ``fix``, after the state's name."""
        return StateError(f"{self.what}: `{where}` {problem}; {fix}.")

    def mapping(self, value: object, where: str, *, allow_none: bool = False) -> Mapping[str, Any] | None:
        """``value`` as a mapping with str keys (``None`` passes with ``allow_none``)."""
        if value is None and allow_none:
            return None
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self.fail(where, f"must be a mapping with str keys, got {describe(value)}")
        return value

    def sequence(self, value: object, where: str) -> Sequence[Any]:
        """``value`` as a list (or tuple)."""
        if not isinstance(value, (list, tuple)):
            raise self.fail(where, f"must be a list, got {describe(value)}")
        return value

    def integer(self, value: object, where: str, *, low: int = 0, high: int | None = None) -> int:
        """``value`` as an int (not a bool) in ``[low, high]``."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"must be an int, got {describe(value)}")
        if value < low or (high is not None and value > high):
            raise self.fail(where, f"{_range(low, high)}, got {value}")
        return value

    def real(self, value: object, where: str, *, low: float | None = None, high: float | None = None) -> float:
        """``value`` as a finite number in ``[low, high]``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"must be a number, got {describe(value)}")
        if not math.isfinite(value):
            raise self.fail(where, f"must be finite, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise self.fail(where, f"{_range(low, high)}, got {value!r}")
        return float(value)

    def tensor(
        self,
        value: object,
        where: str,
        *,
        shape: tuple[int, ...] | None = None,
        nonnegative: bool = False,
        scan: bool = True,
    ) -> Tensor:
        """``value`` as a floating-point tensor (of ``shape``); ``scan``: finite (and ``nonnegative``) values."""
        if not isinstance(value, Tensor):
            raise self.fail(where, f"must be a tensor, got {describe(value)}")
        if not value.is_floating_point():
            raise self.fail(where, f"must be a floating-point tensor, got dtype {value.dtype}")
        if shape is not None and tuple(value.shape) != shape:
            raise self.fail(where, f"must have shape {shape}, got {tuple(value.shape)}")
        if scan and value.device.type != "meta" and value.numel():
            finite = bool(torch.isfinite(value).all())
            if not finite:
                raise self.fail(where, "holds non-finite values (NaN or inf)")
            if nonnegative and bool((value < 0).any()):
                raise self.fail(where, "holds negative values (it is a sum of squares)")
        return value

    def names(self, found: Collection[str], known: Collection[str] | None, where: str, what: str) -> None:
        """Every name in ``found`` is among ``known`` (``None``: not checked)."""
        if known is None:
            return
        unknown = sorted(set(found) - set(known))
        if unknown:
            raise self.fail(
                where, f"names {what} {unknown[:5]} that this run does not have (it has {sorted(known)[:5]})"
            )


def describe(value: object) -> str:
    """A value's type and (shortened) repr, for messages.

    Example::

        >>> describe([1, 2])
        'list [1, 2]'
    """
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def rank_entry(
    saved: Sequence[Mapping[str, Any]] | None,
    *,
    rank: int,
    world: int,
    split: str | None,
    who: str,
    entries: str,
    fix: str,
) -> Mapping[str, Any]:
    """This rank's entry of a per-rank list in a saved state (rank order); ``{}`` if there is none.

    Entries that every rank holds whole (data parallelism: the same sums, or sums any rank may continue) move to
    another number of ranks: a rank beyond the saved ones takes rank 0's. Entries that are pieces of a split (tensor
    parallelism) do not: they need the same number of ranks.

    Args:
        saved: The list, one entry per rank of the run that saved it (``None`` or empty: nothing saved).
        rank: This rank.
        world: This run's number of ranks.
        split: How the entries are pieces of one whole (e.g. ``"as partials of their sharded pieces"``), or ``None``
            when each entry is whole.
        who: The message's first words (e.g. ``"score='taylor'"``).
        entries: What the entries are, for the message (e.g. ``"the gradient sums"``).
        fix: The alternative a message offers besides resuming on the saved number of ranks.

    Raises:
        ValueError: If the entries are pieces (``split``) and ``world`` differs from the number saved.

    Example::

        >>> rank_entry([{"r": 0}, {"r": 1}], rank=1, world=2, split=None, who="x", entries="y", fix="z")
        {'r': 1}
        >>> rank_entry([{"r": 0}], rank=1, world=2, split=None, who="x", entries="y", fix="z")
        {'r': 0}
    """
    if not saved:
        return {}
    if split is not None and len(saved) != world:
        raise ValueError(
            f"{who}: the checkpoint holds {entries} of {len(saved)} rank(s) {split}, and this run "
            f"has {world} rank(s); they cannot be redistributed. Resume on {len(saved)} ranks with the same mesh, or "
            f"{fix}."
        )
    return saved[rank] if rank < len(saved) else saved[0]


__all__ = ["FIX", "FieldChecker", "StateError", "describe", "rank_entry"]
