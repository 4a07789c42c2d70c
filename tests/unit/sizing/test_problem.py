"""Size targets read without the model (``sizing/problem.py``: ``parse_size``, ``size_value``): one rule for counts,
fractions, suffixes and percentages, and the messages of what is refused.

References written here: the counts each form spells, worked out by hand for a model of 10**10 parameters.
"""

from __future__ import annotations

import pytest

from lightning_pat.sizing.problem import parse_size, size_value


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4B", 4 * 10**9), ("350M", 350 * 10**6), ("1.5k", 1500), ("2e9", 2 * 10**9), (4e9, 4 * 10**9), (0.5, 5 * 10**9),
     ("50%", 5 * 10**9), ("0.25", 2_500_000_000), (123, 123)],
)  # fmt: skip
def test_parse_size(value, expected):
    assert parse_size(value, total=10**10) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [("4X", "must look like"), (-1, "positive"), (float("nan"), "finite"), (True, "must be a count"),
     ("20B", "above the model's size"), (None, "must be a count")],
)  # fmt: skip
def test_parse_size_refuses(value, match):
    with pytest.raises(ValueError, match=match):
        parse_size(value, total=10**10)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1), (2, 2), (1.0, 10**10), (0.999, 9_990_000_000), (2.0, 2), ("1", 1), ("1.0", 10**10), ("2000", 2000),
     ("1.1M", 1_100_000), ("0.1B", 10**8), ("100%", 10**10), ("1e3", 1000), ("4e9", 4 * 10**9)],
)  # fmt: skip
def test_one_rule_for_counts_and_fractions(value, expected):
    """Issue 23 (C5): an int is always a count; a float (or a string without a suffix that spells one) <= 1 is a
    fraction, above 1 a whole count; suffixes are counts, percentages fractions. Decimal suffixes are exact."""
    assert parse_size(value, total=10**10) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [(1.5, r"`target_params` = 1.5 is a count \(above 1\) but not a whole number"),
     ("1.5", r"= '1.5' is a count \(above 1\) but not a whole"), ("1.2345k", r"not a whole number"),
     ("1e999", r"`target_params` = '1e999' is not a finite size"), (float("inf"), r"must be a finite count"),
     ("150%", r"`target_params` = '150%' is above 100%"), ("0%", r"must be positive")],
)  # fmt: skip
def test_sizes_that_are_not_a_count_or_a_fraction_are_refused_without_the_model(value, match):
    with pytest.raises(ValueError, match=match):
        size_value(value)


def test_flops_targets_speak_of_flops():
    with pytest.raises(ValueError, match=r"`target_flops` = '2G' \(2,000,000,000 FLOPs per token\) is above the "
                       r"model's FLOPs per token \(1,000\)"):  # fmt: skip
        parse_size("2G", total=1000, name="target_flops")
    with pytest.raises(ValueError, match=r"`target_flops` must be a finite count or fraction, got nan"):
        parse_size(float("nan"), total=1000, name="target_flops")
