"""The training floor's errors: the configuration error type, its prefixing, and the one name messages start with.

No Lightning here. Every message of the Lightning-free training modules starts with :data:`WHO` (the callback the
user configured), so a loop of one's own that drives :class:`~lightning_pat.training.controller.PruningController`
reads one spelling; the callback turns :class:`ConfigurationError` (and any ``ValueError``) into
``MisconfigurationException`` at one boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: The name the training floor's messages start with (the user-facing callback).
WHO = "CoupledPruningCallback"


class ConfigurationError(ValueError):
    """A ``ValueError`` during training that the run's configuration caused (the callback reports it as such)."""


@contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` of the enclosed code as ``ConfigurationError(f"{prefix}: {error}")``.

    Example::

        >>> with prefixed(f"{WHO}(score='taylor')"):
        ...     raise ValueError("no gradient")
        Traceback (most recent call last):
        ...
        lightning_pat.training.errors.ConfigurationError: CoupledPruningCallback(score='taylor'): no gradient

    Raises:
        ConfigurationError: If the enclosed code raises a ``ValueError``.
    """
    try:
        yield
    except ValueError as err:
        raise ConfigurationError(f"{prefix}: {err}") from err
