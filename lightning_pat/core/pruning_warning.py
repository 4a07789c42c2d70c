"""The base class of every warning lightning_pat emits.

Filter ours apart from everyone else's: ``warnings.simplefilter("error", lightning_pat.PruningWarning)`` turns them
into errors (the test suite does, so an unexpected warning fails the test that caused it), ``"ignore"`` silences
them. It subclasses ``UserWarning``, so filters written for that keep working.
"""

from __future__ import annotations

__all__ = ["PruningWarning"]


class PruningWarning(UserWarning):
    """A result the user should look at: what was asked, but maybe not what was meant.

    The message says why and what to do.

    Example::

        >>> import warnings
        >>> from lightning_pat import PruningWarning
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("shrink: ...", PruningWarning)
        >>> issubclass(seen[0].category, UserWarning)
        True
    """
