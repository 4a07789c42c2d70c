"""Audit 2026-12b C11: a range with one bound reads "must be >= 0", not "must be in >= 0" (or "[0.0, None]")."""

from __future__ import annotations

import pytest

from lightning_pat.core.state_fields import FieldChecker, StateError


@pytest.mark.parametrize(
    ("read", "expected"),
    [(lambda c: c.integer(-5, "step"), "`step` must be >= 0, got -5;"),
     (lambda c: c.integer(9, "step", high=5), "`step` must be in [0, 5], got 9;"),
     (lambda c: c.real(-1.0, "gamma", low=0.0), "`gamma` must be >= 0.0, got -1.0;"),
     (lambda c: c.real(2.0, "gamma_prox", high=1.0), "`gamma_prox` must be <= 1.0, got 2.0;"),
     (lambda c: c.real(2.0, "target", low=0.0, high=1.0), "`target` must be in [0.0, 1.0], got 2.0;")],
)  # fmt: skip
def test_a_range_is_worded_by_its_bounds(read, expected):
    with pytest.raises(StateError) as err:
        read(FieldChecker("the state"))
    assert str(err.value).startswith(f"the state: {expected}")
