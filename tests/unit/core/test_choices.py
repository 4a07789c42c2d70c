"""The options' vocabularies and ranges are spelled once (core/choices.py), and every reader agrees with them.

The options' types, the options' checks, the callback's signature, the schedule, the routing and the saved state's
schema are each asked directly (not through core.choices), so that a second spelling anywhere fails here.
"""

from __future__ import annotations

import math
import typing

import pytest

from lightning_pat.core import choices, norms
from lightning_pat.core.choices import CHOICES, RANGES, SWITCHES
from lightning_pat.core.schedule import Schedule
from lightning_pat.core.state_schema import StateError, check_state
from lightning_pat.pruning.options import RESUMABLE, PruningOptions, StepOptions

PAIRS = [
    (choices.Mode, choices.MODES), (choices.Method, choices.METHODS), (choices.RampShape, choices.RAMP_SHAPES),
    (choices.TrainingScore, choices.TRAINING_SCORES), (choices.LayerScore, choices.LAYER_SCORES),
    (choices.ExecutorKind, choices.EXECUTOR_KINDS), (choices.TeacherStore, choices.TEACHER_STORES),
    (choices.Allocation, choices.ALLOCATIONS), (choices.TrainingAllocation, choices.TRAINING_ALLOCATIONS),
    (choices.Side, choices.SIDES), (choices.Widths, choices.WIDTHS),
]  # fmt: skip
WRONG = "no-such-choice"


def saved(**options: object) -> dict[str, object]:
    return {"step": 0, "dropped": {}, "options": options}


def build(name: str, value: object) -> PruningOptions:
    extra = {"reg_lambda": 1e-3} if (name, value) == ("method", "group_lasso") else {}
    if (name, value) == ("target_sparsity", 1.0):
        with pytest.warns(UserWarning, match="removes every unit"):
            return PruningOptions(clusters="linear_chain", **{name: value})
    return PruningOptions(clusters="linear_chain", **{name: value, **extra})


@pytest.mark.parametrize(("literal", "words"), PAIRS)
def test_each_literal_and_its_tuple_hold_the_same_words(literal, words):
    assert typing.get_args(literal) == words
    assert len(set(words)) == len(words)


def test_the_scores_are_the_norms_scores_and_auto():
    assert ("auto", *norms.SCORE_TYPES) == choices.TRAINING_SCORES
    assert typing.get_args(norms.ScoreType) == norms.SCORE_TYPES


@pytest.mark.parametrize("cls", [PruningOptions, StepOptions])
def test_the_options_fields_are_typed_with_the_vocabularies(cls):
    hints = typing.get_type_hints(cls)
    checked = {"target_allocation": choices.ALLOCATIONS} if cls is StepOptions else {}
    for name, hint in hints.items():
        if name in CHOICES:
            assert typing.get_args(hint) == checked.get(name, CHOICES[name]), name


def test_the_callbacks_signature_spells_the_same_vocabularies():
    from lightning_pat import CoupledPruningCallback

    hints = typing.get_type_hints(CoupledPruningCallback.__init__)
    found = {name: typing.get_args(hint) for name, hint in hints.items() if name in CHOICES}
    assert found == {name: CHOICES[name] for name in found}
    assert {"mode", "method", "ramp", "score", "layer_score", "executor", "target_side"} <= set(found)


def test_every_saved_option_has_a_rule_in_the_schema():
    assert all(key in CHOICES or key in RANGES or key in SWITCHES for key in RESUMABLE)


@pytest.mark.parametrize("name", [k for k in RESUMABLE if k in CHOICES])
def test_the_options_and_the_schema_take_exactly_the_same_words(name):
    for word in CHOICES[name]:
        build(name, word)
        check_state(saved(**{name: word}))
    with pytest.raises(ValueError, match=rf"`{name}`.* must be"):
        build(name, WRONG)
    with pytest.raises(StateError, match=rf"options\['{name}'\].* must be one of"):
        check_state(saved(**{name: WRONG}))


@pytest.mark.parametrize("name", [k for k in RESUMABLE if k in RANGES])
def test_the_options_and_the_schema_take_exactly_the_same_ranges(name):
    bounds = RANGES[name]
    step = 1 if bounds.integer else 1e-9
    inside = [bounds.low] + ([bounds.high] if bounds.high is not None else [bounds.low + 7])
    outside = [bounds.low - step, math.nan] + ([bounds.high + step] if bounds.high is not None else [])
    if bounds.integer:
        outside.append(bounds.low + 0.5)
    for value in inside:
        build(name, value)
        check_state(saved(**{name: value}))
    for value in outside:
        with pytest.raises(ValueError, match=rf"`{name}` must be"):
            build(name, value)
        with pytest.raises(StateError, match=rf"options\['{name}'\]"):
            check_state(saved(**{name: value}))
    if bounds.none_ok:
        build(name, None)
        check_state(saved(**{name: None}))


@pytest.mark.parametrize("name", [k for k in RESUMABLE if k in SWITCHES])
def test_the_options_and_the_schema_take_only_bools_for_switches(name):
    for value in (True, False):
        build(name, value)
        check_state(saved(**{name: value}))
    with pytest.raises(ValueError, match=rf"`{name}` must be a bool"):
        build(name, "false")
    with pytest.raises(StateError, match=rf"options\['{name}'\].* must be a bool"):
        check_state(saved(**{name: "false"}))


def test_the_schedule_takes_the_ramp_shapes_and_the_step_ranges():
    for shape in choices.RAMP_SHAPES:
        Schedule(shape=shape)
    with pytest.raises(ValueError, match=r"`ramp` \(the ramp shape\) must be 'cubic' or 'linear'"):
        Schedule(shape=WRONG)  # type: ignore[arg-type]
    for key in ("warmup_steps", "ramp_steps", "every_n_steps"):
        low = int(RANGES[key].low)
        Schedule(**{key: low})
        with pytest.raises(ValueError, match=rf"`{key}` must be an int >= {low}, got {low - 1}"):
            Schedule(**{key: low - 1})


def test_the_routing_takes_the_executor_kinds():
    import torch
    from torch import nn

    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.parallel.executors import EXECUTOR_KINDS, route

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    params = dict(model.named_parameters())
    clusters = resolve_clusters(model, [Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])])
    assert EXECUTOR_KINDS == choices.EXECUTOR_KINDS
    for kind in ("auto", "materializing"):  # "sharded" needs DTensors: its refusal names the cluster instead
        assert route(clusters, params, executor=kind)["h"][0] == "materializing"
    with pytest.raises(ValueError, match=r"`executor` must be one of \('auto', 'materializing', 'sharded'\)"):
        route(clusters, params, executor=WRONG)  # type: ignore[arg-type]
    assert torch.is_tensor(params["0.weight"])
