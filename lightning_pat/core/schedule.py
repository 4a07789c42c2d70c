"""Step schedule: warmup, ramp (cubic or linear), forced final mask, healing (pure).

Steps count real optimizer steps: ``t`` is the number of completed steps, evaluated right after step ``t``.

* ``t <= warmup_steps``: warmup, nothing is pruned.
* ``warmup_steps < t < final_step``: ramp; the fraction of the final target is ``1 - (1 - tau)^3`` (cubic) or
  ``tau`` (linear) with ``tau = (t - warmup_steps) / ramp_steps``; a fresh selection every ``every_n_steps``.
* ``t == final_step = warmup_steps + ramp_steps``: the final target, always applied (even off cadence).
* ``t > final_step``: healing (mask frozen) or, without healing, re-selection at the final target on cadence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_pat.core.choices import RAMP_SHAPES, RANGES, RampShape

Phase = Literal["warmup", "ramp", "final", "healing"]
Action = Literal["none", "select", "hold", "freeze"]


@dataclass(frozen=True)
class Schedule:
    """When and how much to prune.

    Args:
        warmup_steps: Optimizer steps before any pruning.
        ramp_steps: Steps over which the target ramps up to its final value (>= 1; 1 prunes at once).
        every_n_steps: Cadence of fresh selections during the ramp (the final step always selects).
        shape: ``"cubic"`` (fast early, gentle late) or ``"linear"``.

    Raises:
        ValueError: If a count is negative, ``ramp_steps`` < 1, ``every_n_steps`` < 1, or the shape is unknown.

    Example::

        >>> s = Schedule(warmup_steps=2, ramp_steps=4)
        >>> [s.phase(t) for t in range(1, 8)]
        ['warmup', 'warmup', 'ramp', 'ramp', 'ramp', 'final', 'healing']
        >>> round(s.fraction(4), 4)
        0.875
    """

    warmup_steps: int = 0
    ramp_steps: int = 1
    every_n_steps: int = 1
    shape: RampShape = "cubic"

    def __post_init__(self) -> None:
        for key in ("warmup_steps", "ramp_steps", "every_n_steps"):
            value, low = getattr(self, key), RANGES[key].low
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"`{key}` must be an int >= {low}, got {value!r}.")
        if self.shape not in RAMP_SHAPES:
            raise ValueError(f"`ramp` (the ramp shape) must be 'cubic' or 'linear', got {self.shape!r}.")

    @property
    def final_step(self) -> int:
        """The step at which the final target is applied."""
        return self.warmup_steps + self.ramp_steps

    def phase(self, step: int) -> Phase:
        """Phase of completed optimizer step ``step``."""
        if step <= self.warmup_steps:
            return "warmup"
        if step < self.final_step:
            return "ramp"
        if step == self.final_step:
            return "final"
        return "healing"

    def fraction(self, step: int) -> float:
        """Fraction of the final target in force after step ``step`` (0 in warmup, 1 from the final step)."""
        if step <= self.warmup_steps:
            return 0.0
        if step >= self.final_step:
            return 1.0
        tau = (step - self.warmup_steps) / self.ramp_steps
        return 1.0 - (1.0 - tau) ** 3 if self.shape == "cubic" else tau

    def action(self, step: int, *, heal: bool = True) -> Action:
        """What to do right after completed step ``step``.

        ``"none"`` (warmup: dense training), ``"select"`` (a fresh selection), ``"hold"`` (re-apply the current
        mask between selections), ``"freeze"`` (healing: the mask is final and gradients of dropped units are
        zeroed). Without healing (``heal=False``) the final target keeps being re-selected on cadence.

        Example::

            >>> s = Schedule(warmup_steps=1, ramp_steps=4, every_n_steps=2)
            >>> [s.action(t) for t in range(1, 8)]
            ['none', 'hold', 'select', 'hold', 'select', 'freeze', 'freeze']
            >>> [s.action(t, heal=False) for t in range(6, 9)]
            ['hold', 'select', 'hold']
        """
        phase = self.phase(step)
        if phase == "warmup":
            return "none"
        if phase == "healing":
            if heal:
                return "freeze"
            return "select" if (step - self.final_step) % self.every_n_steps == 0 else "hold"
        return "select" if self.is_due(step) else "hold"

    def frozen(self, step: int, *, heal: bool = True) -> bool:
        """Whether the mask is frozen after step ``step``: healing is on and the final ramp step is reached.

        Example::

            >>> s = Schedule(warmup_steps=1, ramp_steps=2)
            >>> [s.frozen(t) for t in range(1, 5)], s.frozen(4, heal=False)
            ([False, False, True, True], False)
        """
        return heal and step >= self.final_step

    def freezes(self, step: int, *, heal: bool = True) -> bool:
        """Whether step ``step`` is the freeze transition (the final ramp step, with healing).

        From here on nothing is selected again: the latent copies and activation statistics are no longer needed,
        and a model may be shrunk.
        """
        return heal and step == self.final_step

    def is_due(self, step: int) -> bool:
        """Whether a fresh selection happens after step ``step`` (ramp cadence, or the forced final step)."""
        phase = self.phase(step)
        if phase == "final":
            return True
        if phase == "ramp":
            return (step - self.warmup_steps) % self.every_n_steps == 0
        return False


def final_step_of(options: Mapping[str, Any]) -> int:
    """The final ramp step of a state's saved options: ``warmup_steps + ramp_steps``.

    :class:`Schedule`'s defaults stand in for a missing key; the resume checks and ``lightning-pat shrink`` share this
    one rule (``lightning-pat shrink`` used to default ``ramp_steps`` to 0).

    Example::

        >>> final_step_of({"warmup_steps": 2, "ramp_steps": 5}), final_step_of({})
        (7, 1)
    """
    default = Schedule()
    warmup = int(options.get("warmup_steps", default.warmup_steps))
    return Schedule(warmup_steps=warmup, ramp_steps=int(options.get("ramp_steps", default.ramp_steps))).final_step
