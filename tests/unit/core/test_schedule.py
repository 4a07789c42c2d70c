"""Schedule: phases, ramp fractions, cadence, the forced final step and validation."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pat.core.schedule import Schedule


def _cubic(tau: float) -> float:
    return 1.0 - (1.0 - tau) ** 3


def test_phases():
    s = Schedule(warmup_steps=2, ramp_steps=4)
    assert s.final_step == 6
    assert [s.phase(t) for t in range(9)] == [
        "warmup",
        "warmup",
        "warmup",
        "ramp",
        "ramp",
        "ramp",
        "final",
        "healing",
        "healing",
    ]


def test_phases_without_warmup_and_one_ramp_step():
    s = Schedule()
    assert (s.warmup_steps, s.ramp_steps, s.every_n_steps, s.shape) == (0, 1, 1, "cubic")
    assert [s.phase(t) for t in range(3)] == ["warmup", "final", "healing"]
    assert [s.fraction(t) for t in range(3)] == [0.0, 1.0, 1.0]
    assert [s.is_due(t) for t in range(3)] == [False, True, False]


def test_cubic_fraction_values():
    s = Schedule(warmup_steps=2, ramp_steps=4, shape="cubic")
    assert [s.fraction(t) for t in range(9)] == [0.0, 0.0, 0.0, 0.578125, 0.875, 0.984375, 1.0, 1.0, 1.0]
    assert s.fraction(10_000) == 1.0


def test_linear_fraction_values():
    s = Schedule(warmup_steps=1, ramp_steps=4, shape="linear")
    assert [s.fraction(t) for t in range(8)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("shape", ["cubic", "linear"])
@pytest.mark.parametrize(("warmup", "ramp"), [(0, 1), (0, 7), (3, 10), (5, 3)])
def test_fraction_matches_formula_and_is_monotone(shape, warmup, ramp):
    s = Schedule(warmup_steps=warmup, ramp_steps=ramp, shape=shape)
    values = [s.fraction(t) for t in range(warmup + ramp + 3)]
    for t, v in enumerate(values):
        if t <= warmup:
            assert v == 0.0
        elif t >= warmup + ramp:
            assert v == 1.0
        else:
            tau = (t - warmup) / ramp
            assert v == pytest.approx(_cubic(tau) if shape == "cubic" else tau, abs=1e-15)
            assert 0.0 < v < 1.0
    assert values == sorted(values)
    if shape == "cubic" and ramp > 1:
        # cubic prunes faster early than linear
        assert s.fraction(warmup + 1) > (1 / ramp)


def test_every_n_steps_cadence_and_forced_final_step():
    s = Schedule(warmup_steps=3, ramp_steps=10, every_n_steps=4)
    due = [t for t in range(20) if s.is_due(t)]
    assert due == [7, 11, 13]  # (t - 3) % 4 == 0 in the ramp, and the final step 13 although off cadence
    assert s.phase(13) == "final"


def test_every_step_during_the_ramp():
    s = Schedule(warmup_steps=2, ramp_steps=3)
    assert [t for t in range(10) if s.is_due(t)] == [3, 4, 5]


def test_cadence_longer_than_the_ramp_still_prunes_at_the_final_step():
    s = Schedule(warmup_steps=0, ramp_steps=5, every_n_steps=100)
    assert [t for t in range(20) if s.is_due(t)] == [5]


def test_nothing_due_in_warmup_or_healing():
    s = Schedule(warmup_steps=4, ramp_steps=2, every_n_steps=1)
    assert not any(s.is_due(t) for t in range(5))
    assert not any(s.is_due(t) for t in range(7, 50))


def test_schedule_is_frozen():
    s = Schedule()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.warmup_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0, got -1"),
        ({"warmup_steps": 1.0}, r"`warmup_steps` must be an int >= 0, got 1\.0"),
        ({"warmup_steps": True}, r"`warmup_steps` must be an int >= 0, got True"),
        ({"ramp_steps": 0}, r"`ramp_steps` must be an int >= 1, got 0"),
        ({"ramp_steps": -3}, r"`ramp_steps` must be an int >= 1"),
        ({"ramp_steps": "4"}, r"`ramp_steps` must be an int >= 1, got '4'"),
        ({"every_n_steps": 0}, r"`every_n_steps` must be an int >= 1, got 0"),
        ({"every_n_steps": 2.5}, r"`every_n_steps` must be an int >= 1"),
        ({"every_n_steps": False}, r"`every_n_steps` must be an int >= 1"),
        ({"shape": "exponential"}, r"must be 'cubic' or 'linear', got 'exponential'"),
        ({"shape": "Cubic"}, r"must be 'cubic' or 'linear'"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)
