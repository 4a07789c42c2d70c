"""The option checkers (``core/checks.py``): what each accepts and the message of what it refuses.

References written here: the accepted values listed by hand (ends of the range included) and the exact messages,
each naming the option, what was expected and what was found.
"""

from __future__ import annotations

import math
import re

import pytest

from lightning_pat.core.checks import check_bool, check_choice, check_number


def test_check_choice_accepts_a_listed_value_and_names_the_choices():
    check_choice("method", "hard", ["hard", "group_lasso"])
    with pytest.raises(ValueError, match=re.escape("`method` must be one of ('hard', 'group_lasso'), got 'Hard'.")):
        check_choice("method", "Hard", ["hard", "group_lasso"])


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0, 0, 1])
def test_check_number_accepts_the_closed_range(value):
    check_number("sparsity", value, low=0.0, high=1.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-0.1, "`sparsity` must be a number [0.0, 1.0], got -0.1."),
        (1.5, "`sparsity` must be a number [0.0, 1.0], got 1.5."),
        (True, "`sparsity` must be a number [0.0, 1.0], got True."),  # a bool is not a number here
        ("0.5", "`sparsity` must be a number [0.0, 1.0], got '0.5'."),
        (math.nan, "`sparsity` must be a finite number [0.0, 1.0], got nan."),
    ],
)
def test_check_number_refuses_outside_the_range_bools_strings_and_nan(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_number("sparsity", value, low=0.0, high=1.0)


def test_check_number_with_one_bound_and_integers():
    check_number("every", 10**9, low=1, integer=True)
    with pytest.raises(ValueError, match=re.escape("`every` must be an int >= 1, got 2.0.")):
        check_number("every", 2.0, low=1, integer=True)
    with pytest.raises(ValueError, match=re.escape("`every` must be a finite number >= 1, got inf.")):
        check_number("every", math.inf, low=1)


@pytest.mark.parametrize("value", [True, False])
def test_check_bool_accepts_bools(value):
    check_bool("shrink_on_freeze", value)


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_check_bool_refuses_truthy_and_falsy_stand_ins(value):
    with pytest.raises(ValueError, match=re.escape(f"`flag` must be a bool (True or False), got {value!r}.")):
        check_bool("flag", value)
