"""Optimizer-state slicing of the shrink: the state of a shrunk parameter keeps the same indices as the parameter.

:func:`optimizer_cuts` checks an optimizer's state before anything changes (called by
:func:`lightning_pat.shrink.edits.validate`); :func:`slice_optimizer_state` slices it (called by
:func:`lightning_pat.shrink.surgery.apply_plan`, or directly).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_pat.shrink.plan import ShrinkPlan


def optimizer_cuts(
    optimizer: torch.optim.Optimizer, plan: ShrinkPlan, params: Mapping[str, Tensor]
) -> list[tuple[Tensor, str]]:
    """``(parameter, plan name)`` of every shrunk parameter the optimizer holds; validates its state."""
    by_id = {id(params[n]): n for n in plan.keep if n in params}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != plan.shapes[name]:
                    raise ValueError(
                        f"Shrink: optimizer {type(optimizer).__name__} holds state {key!r} of shape "
                        f"{tuple(value.shape)} for parameter {name!r} of shape {plan.shapes[name]}; only state shaped "
                        "like its parameter (momentum, Adam moments) or scalars (step) can be sliced. Shrink before "
                        "creating this optimizer, or use SGD/Adam/AdamW."
                    )
            out.append((p, name))
    return out


def slice_optimizer_state(optimizer: torch.optim.Optimizer, plan: ShrinkPlan, params: Mapping[str, Tensor]) -> None:
    """Slice the optimizer state of shrunk parameters the same way as the parameters.

    State tensors shaped like the parameter (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) keep the kept indices; scalars (``step``) are kept as they are. The parameter objects are
    the same before and after :func:`apply_plan`, so ``params`` may be taken before or after it.

    Args:
        optimizer: The optimizer.
        plan: The plan being applied.
        params: Parameter name (as in the plan) -> parameter object.

    Raises:
        ValueError: If a state tensor is neither a scalar nor shaped like its parameter (nothing is changed then).
    """
    for param, name in optimizer_cuts(optimizer, plan, params):
        state = optimizer.state.get(param, {})
        for key, value in list(state.items()):
            if isinstance(value, Tensor) and value.dim() > 0:
                state[key] = plan.slice(name, value)
