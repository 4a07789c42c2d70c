"""The checkers every option goes through: a choice, a number in a range, a bool (pure, no torch).

:func:`check_option` checks an option against its vocabulary or range in :mod:`lightning_pat.core.choices`.

Each raises ``ValueError`` naming the option, what was expected and what was found, so that the messages of
:class:`~lightning_pat.pruning.options.PruningOptions`, :func:`~lightning_pat.prune_clusters` and the other entry
points read alike.

Example::

    >>> check_number("sparsity", 0.5, low=0.0, high=1.0)
    >>> check_choice("method", "lasso", ("hard", "group_lasso"))
    Traceback (most recent call last):
    ...
    ValueError: `method` must be one of ('hard', 'group_lasso'), got 'lasso'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_pat.core.choices import CHOICES, RANGES


def check_choice(name: str, value: object, valid: Sequence[str]) -> None:
    """Raise unless ``value`` is one of ``valid``.

    Raises:
        ValueError: If ``value`` is not in ``valid``.
    """
    if value not in valid:
        raise ValueError(f"`{name}` must be one of {tuple(valid)}, got {value!r}.")


def check_number(name: str, value: object, *, low: float, high: float | None = None, integer: bool = False) -> None:
    """Raise unless ``value`` is a number (an int if ``integer``) in ``[low, high]``.

    Raises:
        ValueError: If ``value`` is a bool, not a number (not an int), not finite (NaN, inf) or out of range.
    """
    span = f"[{low}, {high}]" if high is not None else f">= {low}"
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"`{name}` must be {kind} {span}, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number {span}, got {value!r}.")
    if value < low or (high is not None and value > high):
        raise ValueError(f"`{name}` must be {kind} {span}, got {value!r}.")


def check_bool(name: str, value: object) -> None:
    """Raise unless ``value`` is ``True`` or ``False`` (a string such as ``"false"`` would be truthy).

    Raises:
        ValueError: If ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool (True or False), got {value!r}.")


def check_option(name: str, value: object, *, rule: str | None = None) -> None:
    """Raise unless ``value`` is in the vocabulary or the range of :mod:`lightning_pat.core.choices` for ``name``.

    Args:
        name: The option, as the message names it.
        value: Its value.
        rule: The option whose vocabulary or range applies, if not ``name`` (``sparsity`` is checked as
            ``target_sparsity``).

    Raises:
        ValueError: As :func:`check_choice` or :func:`check_number` (``None`` passes where the range allows it).
        KeyError: If no vocabulary or range has that name (a bug, not a user error).
    """
    key = rule or name
    if key in CHOICES:
        check_choice(name, value, CHOICES[key])
        return
    bounds = RANGES[key]
    if value is None and bounds.none_ok:
        return
    check_number(name, value, low=bounds.low, high=bounds.high, integer=bounds.integer)
