"""Trace a model into an ATen graph for :mod:`lightning_pat.discovery.entry` (``torch.export``, on the meta device).

Supported ``nn.MultiheadAttention``, torchvision Swin V1/V2 window attention and MaxViT attention modules are traced as
the modules the shrink puts in their place (:mod:`lightning_pat.heads.replace`: the same parameters, the
head count and head dim explicit), so the walk sees their heads; the per-head parameters such a module uses directly
in its forward (Swin V2's ``logit_scale``) are listed in :attr:`Trace.per_head`, so the walk makes them members of the
heads.

A submodule whose forward computes a *data-dependent selection* (a boolean or integer tensor, such as the token mask
of a sparse-attention indexer that loops over ``nonzero``) stops ``torch.export``. Such a module is traced as an
opaque selection (:data:`OPAQUE_SELECTION`): its output, a selection, carries no channels (like a causal mask made
from the input), and everything it reads (its input channels, its own parameters) is left whole; its output's shape
and dtype come from one run of a CPU copy of the module (zero weights, zero inputs of the same shapes).

The model is never run on real data: a *meta twin* (a deep copy whose parameters and buffers are meta tensors of
the same global shapes, DTensors included) is exported non-strictly with meta example inputs, so tracing costs no
memory and no compute and leaves the model untouched.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_pat.core.forwards import map_tensors, tensors_of
from lightning_pat.heads import HeadsMultiheadAttention, WindowAttentionV2, replace_attention
from lightning_pat.shrink.model_meta import is_scale

log = logging.getLogger(__name__)

#: Module attributes a deep copy must not follow (a LightningModule's trainer, fabric, mesh).
_FOREIGN_ATTRS = ("_trainer", "_fabric", "_device_mesh", "_strategy")


@dataclass(frozen=True)
class Trace:
    """An exported graph and what its placeholders stand for.

    Attributes:
        graph: The ATen-level ``torch.fx.Graph``; every node's ``meta["val"]`` holds a (fake) value with its shape.
        params: Placeholder name -> parameter name in the model.
        buffers: Placeholder name -> buffer name.
        constants: Placeholder names of lifted tensor constants.
        refused: Module name -> why, for each ``nn.MultiheadAttention`` called in a way whose heads cannot be cut
            (cross-attention, masks: :meth:`~lightning_pat.heads.replace.HeadsMultiheadAttention.forward`).
        per_head: Parameter name -> its head axis, for each per-head parameter an attention module of ours uses
            directly in its forward (``WindowAttentionV2.per_head_parameters``).
        opaque: Module name -> why, for each module traced as an opaque selection (see the module docstring): its
            parameters are left whole.
    """

    graph: torch.fx.Graph
    params: dict[str, str]
    buffers: dict[str, str]
    constants: frozenset[str]
    refused: dict[str, str] = field(default_factory=dict)
    per_head: dict[str, int] = field(default_factory=dict)
    opaque: dict[str, str] = field(default_factory=dict)


#: The op a data-dependent selection module is traced as (``lightning_pat::opaque_selection``; the walk's handler in
#: :mod:`lightning_pat.discovery.tensor_ops` poisons its inputs and gives its output no channel labels).
OPAQUE_SELECTION = "opaque_selection"
#: A selection module is run on a CPU copy to learn its output's shape, up to this many parameters.
_MAX_PROBED_PARAMS = 1 << 26
#: Export attempts, at most, while standing in for data-dependent selections (a class, or new input shapes, each).
_MAX_ATTEMPTS = 6


@torch.library.custom_op(f"lightning_pat::{OPAQUE_SELECTION}", mutates_args=())
def _opaque_selection(inputs: list[torch.Tensor], shape: list[int], dtype: torch.dtype, module: str) -> torch.Tensor:
    """A selection of ``shape`` and ``dtype`` computed from ``inputs`` in a way discovery does not trace."""
    return torch.zeros(shape, dtype=dtype, device=inputs[0].device)


@_opaque_selection.register_fake
def _(inputs: list[torch.Tensor], shape: list[int], dtype: torch.dtype, module: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=inputs[0].device)


class TraceStop(ValueError):
    """torch.export could not trace the model (data-dependent control flow, unsupported Python), not a misfit input."""


def _global_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.shape  # a DTensor reports its global shape


def meta_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with meta parameters and buffers of the same global shapes (nothing allocated).

    Raises:
        ValueError: If the model cannot be deep-copied (the message names the error).
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(_global_shape(p), dtype=p.dtype, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(_global_shape(b), dtype=b.dtype, device="meta")
    for module in model.modules():
        for attr in _FOREIGN_ATTRS:
            value = module.__dict__.get(attr)
            if value is not None:
                memo[id(value)] = None
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # noqa: BLE001 - any copy failure is reported with the fix
        raise ValueError(
            f"discover: cannot make a meta copy of {type(model).__name__} to trace it ({type(err).__name__}: {err}); "
            "declare the clusters by hand."
        ) from err


def to_meta(value: Any) -> Any:
    """``value`` with every tensor replaced by a meta tensor of the same shape and dtype (nested lists/dicts)."""
    return map_tensors(value, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


class _TensorOutputs(nn.Module):
    """Exports ``inner`` with its output reduced to a tuple of tensors (parameter names gain the prefix ``inner.``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(tensors_of(self.inner(*args, **kwargs)))


def _strip(names: Mapping[str, str]) -> dict[str, str]:
    return {k: v.removeprefix("inner.") for k, v in names.items()}


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Silence torch's fake-tensor and symbolic-shape logs while exporting (a failure is reported as our error)."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


#: words of torch's messages for a forward that runs eagerly but depends on data (not a misfit of the input)
_DATA_DEPENDENT = ("meta", "data-dependent", "item()", "Could not guard", "GuardOnDataDependent", "symbolic")


def _input_misfit(twin: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the forward rejects the (meta) example input when run eagerly, or ``None`` if it runs or depends on data."""
    stack: list[str] = []
    names = {id(m): n for n, m in twin.named_modules()}
    handles = [m.register_forward_pre_hook(lambda m, _a: stack.append(names.get(id(m), ""))) for m in twin.modules()]

    def pop(*_: Any) -> None:
        if stack:
            stack.pop()

    handles += [m.register_forward_hook(pop) for m in twin.modules()]
    try:
        with torch.no_grad():
            twin(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the finding
        text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
        if any(word in text for word in _DATA_DEPENDENT):
            return None
        where = stack[-1].removeprefix("inner.").removeprefix("inner") if stack else ""
        return f"module {where!r} raised {text}" if where else text
    finally:
        for h in handles:
            h.remove()
    return None


class _NotSelection(Exception):
    """A module that stopped the trace is not a selection discovery can stand in for (the reason)."""


@dataclass(frozen=True)
class _Like:
    """A tensor's shape and dtype, kept from a traced call (the probe runs on zeros like it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _likes(value: Any) -> Any:
    return map_tensors(value, lambda t: _Like(tuple(int(s) for s in t.shape), t.dtype))


def _zeros(value: Any) -> Any:
    if isinstance(value, _Like):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, Mapping):
        return {k: _zeros(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_zeros(v) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def _key(value: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(int(s) for s in t.shape), t.dtype) for t in tensors_of(value))


class _Selection:
    """The ``forward`` of a data-dependent selection module in the meta twin: :data:`OPAQUE_SELECTION` of its inputs.

    The output's shape and dtype, per input shapes, come from running a CPU copy of the module on zeros like the
    inputs (:meth:`learn`, between two export attempts: a call on inputs not seen yet is kept in ``pending`` and
    stops the attempt).
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name
        self.outputs: dict[Any, tuple[list[int], torch.dtype]] = {}
        self.pending: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = _key((args, kwargs))
        if key not in self.outputs:
            self.pending = _likes((args, kwargs))
            raise _NotSelection(f"module {self.name!r} was called on inputs of shapes not seen yet")
        shape, dtype = self.outputs[key]
        tensors = tensors_of((args, kwargs))
        read = [t for t in tensors if t.is_floating_point()] or tensors
        return cast("torch.Tensor", torch.ops.lightning_pat.opaque_selection(read, shape, dtype, self.name))

    def learn(self, inputs: Any) -> None:
        """Run a CPU copy of the module (zero weights) on zeros like ``inputs``: its output's shape and dtype.

        Raises:
            _NotSelection: If the module is too large to copy, raises, or returns anything but one boolean or
                integer tensor.
        """
        self.pending = None
        count = sum(p.numel() for p in self.module.parameters())
        if count > _MAX_PROBED_PARAMS:
            raise _NotSelection(f"module {self.name!r} has {count} parameters, too many to run a CPU copy of")
        cpu = copy.deepcopy(self.module)
        vars(cpu).pop("forward", None)
        cpu = cpu.to_empty(device="cpu")
        args, kwargs = _zeros(inputs)
        with torch.no_grad():
            for t in (*cpu.parameters(), *cpu.buffers()):
                t.zero_()
            try:
                out = cpu(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any failure means: not a selection we can stand in for
                raise _NotSelection(f"a CPU copy of module {self.name!r} raised {type(err).__name__}: {err}") from err
        if not isinstance(out, torch.Tensor) or out.is_floating_point() or out.is_complex():
            raise _NotSelection(f"module {self.name!r} does not return one boolean or integer tensor (a selection)")
        self.outputs[_key((args, kwargs))] = (list(out.shape), out.dtype)


def _export(twin: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, _Selection]]:
    """``torch.export`` of ``twin``, standing in for the data-dependent selection modules that stop it.

    Each attempt tracks the modules whose forward is under way; where the export stops on data inside a module (not the
    model itself) that returns a selection, every module of its class is stood in for (:class:`_Selection`) and the
    export runs again.

    Raises:
        Exception: torch's error where the trace stops elsewhere, or a :class:`_NotSelection` (why the module where
            it stopped cannot be stood in for).
    """
    selections: dict[str, _Selection] = {}
    try:
        for _ in range(_MAX_ATTEMPTS):
            stack: list[tuple[str, nn.Module, Any]] = []
            handles = _track(twin, stack)
            try:
                with _quiet_fake_tensor_log(), torch.no_grad():
                    return torch.export.export(twin, args, kwargs=dict(kwargs), strict=False), selections
            except Exception as err:
                pending = next((sel for sel in selections.values() if sel.pending is not None), None)
                if pending is not None:
                    pending.learn(pending.pending)
                    continue
                name, module, inputs = stack[-1] if stack else ("", twin, None)
                name = name.removeprefix("inner.")
                data_dependent = any(word in f"{type(err).__name__}: {err}" for word in _DATA_DEPENDENT)
                if not data_dependent or name in ("", "inner") or name in selections:
                    raise
                for other, m in twin.named_modules():
                    if type(m) is type(module):
                        other = other.removeprefix("inner.")
                        selections[other] = _Selection(m, other)
                        m.forward = selections[other]  # the twin only, never the user's model
                selections[name].learn(inputs)
            finally:
                for h in handles:
                    h.remove()
        raise TraceStop(f"discover: the trace still stops after standing in for {sorted(selections)[:4]}")
    finally:
        for sel in selections.values():  # the twin as it was (its misfit check runs the stock forwards)
            vars(sel.module).pop("forward", None)


def _track(twin: nn.Module, stack: list[tuple[str, nn.Module, Any]]) -> list[Any]:
    """Hooks keeping ``stack``: the modules whose forward is under way, with their inputs' shapes (outermost first)."""
    names = {id(m): n for n, m in twin.named_modules()}

    def push(m: nn.Module, args: Any, kwargs: Any) -> None:
        stack.append((names.get(id(m), ""), m, _likes((args, kwargs))))

    def pop(*_: Any) -> None:
        if stack:
            stack.pop()

    handles = [m.register_forward_pre_hook(push, with_kwargs=True) for m in twin.modules()]
    return handles + [m.register_forward_hook(pop) for m in twin.modules()]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict of " + ", ".join(f"{k}: {_describe(v)}" for k, v in list(value.items())[:4])
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of (" + ", ".join(_describe(v) for v in value[:4]) + ")"
    return type(value).__name__


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``use_cache`` (a Hugging Face model's), by name."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def trace(model: nn.Module, example_input: Any) -> Trace:
    """Export ``model`` (its meta twin, in eval mode) on meta copies of ``example_input``.

    Args:
        model: The model.
        example_input: A tensor, a tuple of positional arguments, or a dict of keyword arguments.

    Returns:
        The trace.

    Raises:
        ValueError: If the example input does not fit the forward (run eagerly on meta copies: the message names
            the module that raised and what was passed), or the model cannot be copied or exported (data-dependent
            control flow, unsupported Python); the message carries torch's reason.
    """
    inner = meta_twin(model)
    replace_attention(inner)  # traced as the shrink will rewrite them (same parameter names)
    per_head: dict[str, int] = {}
    for name, m in inner.named_modules():
        if isinstance(m, WindowAttentionV2):
            m.traced = True  # the whole qkv bias in linear's bias slot (see WindowAttentionV2)
            per_head.update({f"{name}.{p}" if name else p: d for p, d in m.per_head_parameters.items()})
        elif is_scale(m):  # a module holding only a scale (Inkling 2's per-head ScaledL2Clip): its dim 0
            per_head[f"{name}.scale" if name else "scale"] = 0
    twin = _TensorOutputs(inner).eval()
    example = to_meta(example_input)
    args, kwargs = ((), example) if isinstance(example, Mapping) else (example, {})
    if not isinstance(args, tuple):
        args = (args,)
    if _takes_use_cache(inner) and "use_cache" not in kwargs:  # a Hugging Face model: no KV cache is made (Dory
        kwargs = {**kwargs, "use_cache": False}  # deep-copies its cache layers, which export cannot trace)
    try:
        # without grad: a forward that turns grad off around some blocks (HRM's recurrent cycles) then traces them
        # inline, not inside a `wrap_with_set_grad_enabled` subgraph that discovery does not see through
        program, selections = _export(twin, args, dict(kwargs))
    except Exception as err:  # noqa: BLE001 - torch raises many types; all mean "cannot trace"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        misfit = _input_misfit(twin, args, dict(kwargs))
        if misfit is not None:
            raise ValueError(
                f"discover: the example input does not fit {type(model).__name__}'s forward ({misfit}); pass the "
                "`example_input` forward takes (a tensor, a tuple of positional arguments or a dict of keyword "
                f"arguments), got {_describe(example_input)}."
            ) from err
        raise TraceStop(
            f"discover: torch.export could not trace {type(model).__name__} ({type(err).__name__}: {first[:300]}); "
            "data-dependent control flow or unsupported Python in forward. Declare the clusters by hand, or pass an "
            "`example_input` the forward accepts."
        ) from err
    sig = program.graph_signature
    refused = {
        name: str(m.__dict__["refused_call"])
        for name, m in inner.named_modules()
        if isinstance(m, HeadsMultiheadAttention) and "refused_call" in m.__dict__
    }
    return Trace(
        graph=program.graph,
        params=_strip(sig.inputs_to_parameters),
        buffers=_strip(sig.inputs_to_buffers),
        constants=frozenset(sig.inputs_to_lifted_tensor_constants),
        refused=refused,
        per_head=per_head,
        opaque=_opaque_reasons(selections),
    )


def _opaque_reasons(selections: Mapping[str, _Selection]) -> dict[str, str]:
    """Module name -> why it is left whole, for the selection modules stood in for; said once per class in the log."""
    by_class: dict[str, list[str]] = {}
    for name, sel in selections.items():
        if sel.outputs:  # called in the forward
            by_class.setdefault(type(sel.module).__name__, []).append(name)
    out: dict[str, str] = {}
    for cls, names in by_class.items():
        why = (
            f"{cls} computes a data-dependent selection (a boolean or integer tensor) that torch.export cannot "
            "trace; it is traced as an opaque selection, which carries no channels, so its own parameters and the "
            "channels it reads are left whole"
        )
        log.info(
            "discover: %s (%d modules: %s)", why, len(names), ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        )
        out.update(dict.fromkeys(names, why))
    return out
