"""Check that a shrunk model runs and computes what the masked model computed (``shrink(..., example_input=)``).

:func:`record` runs the masked model once on the example input (eval mode, no gradient, the global RNG state
restored afterwards) and keeps its outputs and, for locating a difference, the output of every module call whose
output is one tensor. :func:`compare` runs the shrunk model the same way; if a module raises, the error names the
innermost module that was running; if the outputs differ by more than the tolerance of their dtype (relative error
of all output tensors together: 1e-4 in float32/float64, 2e-2 in float16/bfloat16), it names the first module call
(in call order) whose output has the same shape in both runs but other values. The same two functions serve
discovery's trial shrink (:mod:`lightning_pat.discovery.trial`), on a copy with random weights.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.forwards import map_tensors, tensors_of

#: relative tolerance of the output check, by the outputs' dtype
TOLERANCE: dict[torch.dtype, float] = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEFAULT_TOLERANCE = 1e-4
#: at most this many output elements of module calls are kept to locate a difference
_KEEP_ELEMENTS = 1 << 24


class ShrinkCheckError(ValueError):
    """The shrunk model does not run, or does not compute what the masked model computed.

    Attributes:
        module: The module named by the message (``""``: the model itself), or ``None`` if no module could be named.
    """

    def __init__(self, message: str, module: str | None) -> None:
        super().__init__(message)
        self.module = module


@dataclass
class Run:
    """One recorded forward: the output tensors and the per-module outputs (call order)."""

    outputs: list[Tensor]
    calls: list[tuple[str, Tensor]] = field(default_factory=list)


def move(value: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """``value`` with every tensor moved to ``device`` (floating tensors cast to ``float_dtype`` if given)."""

    def moved(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=float_dtype if float_dtype is not None and t.is_floating_point() else t.dtype)

    return map_tensors(value, moved)


def _call(model: nn.Module, example_input: Any) -> Any:
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, tuple):
        return model(*example_input)
    return model(example_input)


@contextlib.contextmanager
def _quiet_eval(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradient, the global RNG untouched; the modules' training flags restored afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def _watch(model: nn.Module, run: Run | None, stack: list[str]) -> Iterator[None]:
    """Hooks that keep the running modules' names on ``stack`` and record single-tensor outputs into ``run``."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    budget = [_KEEP_ELEMENTS]

    def pre(module: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(module), type(module).__name__))

    def post(module: nn.Module, _args: Any, out: Any) -> None:
        name = stack.pop() if stack else names.get(id(module), "")
        if run is not None and isinstance(out, Tensor) and out.numel() <= budget[0]:
            budget[0] -= out.numel()
            run.calls.append((name, out.detach().to("cpu", copy=True)))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record(model: nn.Module, example_input: Any, *, locate: bool = True) -> Run:
    """Run ``model`` (the masked model) on ``example_input`` and keep what :func:`compare` needs.

    Raises:
        ValueError: If the model does not run on the example input (before anything changed).
    """
    run = Run(outputs=[])
    stack: list[str] = []
    with _quiet_eval(model), _watch(model, run if locate else None, stack):
        try:
            out = _call(model, example_input)
        except Exception as err:  # noqa: BLE001 - any error means "this input does not fit forward"
            where = f" (in module {stack[-1]!r})" if stack else ""
            raise ValueError(
                f"shrink: the example input does not fit the model's forward before the shrink{where}: "
                f"{type(err).__name__}: {err}; pass the `example_input` forward takes (a tensor, a tuple of "
                "positional arguments or a dict of keyword arguments)."
            ) from err
    run.outputs = [t.detach().to("cpu", copy=True) for t in tensors_of(out)]
    return run


def _rel(a: list[Tensor], b: list[Tensor]) -> float:
    num = sum(float((x.double() - y.double()).norm() ** 2) for x, y in zip(a, b, strict=True))
    den = sum(float(y.double().norm() ** 2) for y in b)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float((num / den) ** 0.5)  # float ** float is typed Any (a negative base gives a complex)


def tolerance(outputs: list[Tensor]) -> float:
    """The relative tolerance for these outputs (the loosest of their dtypes)."""
    return max((TOLERANCE.get(t.dtype, DEFAULT_TOLERANCE) for t in outputs if t.is_floating_point()), default=0.0)


def compare(model: nn.Module, example_input: Any, before: Run, *, values: bool = True) -> float:
    """Run the shrunk ``model`` and compare it with ``before``; the relative error (``values=False``: shapes only).

    Raises:
        ShrinkCheckError: If the shrunk model raises (naming the innermost running module), returns outputs of other
            shapes, or differs by more than :func:`tolerance` (naming the first module call whose output differs).
    """
    after = Run(outputs=[])
    stack: list[str] = []
    with _quiet_eval(model), _watch(model, after if before.calls else None, stack):
        try:
            out = _call(model, example_input)
        except Exception as err:  # noqa: BLE001 - the shrunk model cannot run: that is the finding
            where = stack[-1] if stack else None
            raise ShrinkCheckError(
                f"the shrunk model does not run: module {where!r} raised {type(err).__name__}: "
                f"{str(err).strip()[:300]}",
                where,
            ) from err
    outputs = [t.detach().to("cpu") for t in tensors_of(out)]
    shapes = ([tuple(t.shape) for t in outputs], [tuple(t.shape) for t in before.outputs])
    if shapes[0] != shapes[1]:
        raise ShrinkCheckError(f"the shrunk model's outputs have shapes {shapes[0]}, the masked ones {shapes[1]}", "")
    error = _rel(outputs, before.outputs)
    if values and not error <= tolerance(before.outputs):  # NaN fails too
        where = _first_difference(before.calls, after.calls)
        at = f"; the first module whose output differs is {where!r}" if where is not None else ""
        raise ShrinkCheckError(
            f"the shrunk model's outputs differ from the masked model's by {error:.2e} (relative, tolerance "
            f"{tolerance(before.outputs):.0e}){at}",
            where,
        )
    return error


def _first_difference(before: list[tuple[str, Tensor]], after: list[tuple[str, Tensor]]) -> str | None:
    """The first module call (in the order they returned) with same-shaped outputs that differ."""
    for (name, a), (name_after, b) in zip(before, after, strict=False):
        if name != name_after:
            return None  # the calls no longer line up
        if a.shape == b.shape and a.is_floating_point() and _rel([b], [a]) > tolerance([a]):
            return name
    return None


# ---------------------------------------------------------------------------------------------------- meta dry run
class MetaCopyError(ValueError):
    """:func:`meta_copy` could not deep-copy the model (a module FSDP2 has sharded already, for one)."""


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same shapes (nothing allocated).

    Raises:
        MetaCopyError: If the model cannot be deep-copied (a ``ValueError``).
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for module in model.modules():
        for attr in ("_trainer", "_fabric", "_device_mesh", "_strategy"):
            if module.__dict__.get(attr) is not None:
                memo[id(module.__dict__[attr])] = None
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # noqa: BLE001 - reported with the fix
        raise MetaCopyError(f"cannot make a meta copy of {type(model).__name__} ({type(err).__name__}: {err})") from err


def runs_on_meta(model: nn.Module, example_input: Any) -> tuple[str, str] | None:
    """``None`` if ``model`` (a meta copy) runs on a meta copy of ``example_input``, else ``(module, error)``."""
    stack: list[str] = []
    with _quiet_eval(model), _watch(model, None, stack):
        try:
            _call(model, move(example_input, torch.device("meta")))
        except Exception as err:  # noqa: BLE001 - the finding
            where = stack[-1] if stack else ""
            return where, f"module {where!r} raised {type(err).__name__}: {str(err).strip()[:300]}"
    return None
