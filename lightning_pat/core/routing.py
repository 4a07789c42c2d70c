"""Routing around dropped experts: what a masked mixture-of-experts model computes.

Dropping expert ``e`` of a layer removes its slices of the fused expert weights and row ``e`` of the router, so the
shrunk router scores and picks among the kept experts only. Zeros cannot express that (a zero router row gives
logit 0, which top-k may still pick), so the masked model routes with hooks on each router
(:func:`route_around_dropped`): while the router runs, its logits (the output of ``F.linear(x, router.weight)`` or
``x @ router.weight.T``, in any dtype the router casts its weight to; the weight of its one ``nn.Linear`` where it
holds none itself) get the lowest finite value for every expert
whose router row is exactly zero (a dropped expert; a trained router row is never all zeros), and a per-expert
selection bias passed to the router or held by it (MiniMax-M2's and DeepSeek-V3's ``e_score_correction_bias``) the
same (a router whose last rows score shared experts, Inkling's, holds a bias of its routed experts only). The
router's own code then runs on those logits, whatever it does with them (softmax then top-k, top-k then softmax,
a sigmoid, PhiMoE's sparsemixer, DeepSeek's group-limited top-k): a dropped expert is never picked while
``top_k`` experts are kept (DeepSeek: in the groups it picks), and weighs exactly 0 otherwise, as in the shrunk model.
No state beyond the weights is needed (a resumed run or a reloaded masked checkpoint routes the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812 - the usual name
from torch.overrides import TorchFunctionMode

from lightning_pat.core.spec import ResolvedCluster

_HOOK_ATTR = "_lightning_pat_routing_hook"
_MODE_ATTR = "_lightning_pat_routing_mode"
#: Buffers (or parameters) of a router holding one selection bias per expert (masked like the logits while the
#: router runs).
SELECTION_BIASES = ("e_score_correction_bias",)
#: Tensor methods whose result is the router's weight in another dtype, device or memory layout.
_SAME = frozenset(
    (torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
     torch.Tensor.double, torch.Tensor.contiguous, torch.Tensor.detach, torch.Tensor.type_as)
)  # fmt: skip
#: Those whose result is its transpose, ``(H, E)``.
_TRANSPOSED = frozenset((torch.Tensor.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.t))  # type: ignore[attr-defined]


def router_weight(module: nn.Module) -> tuple[str, Tensor] | None:
    """``(name relative to module, tensor)`` of a router's ``(E, H)`` weight: its own, or its one ``nn.Linear``'s.

    AFMoE's router holds a ``gate`` Linear, Hunyuan-MoE's a ``wg``; most routers hold the weight themselves.
    """
    own = module._parameters.get("weight")  # noqa: SLF001 - this module's own parameter
    if own is not None:
        return ("weight", own) if own.dim() == 2 else None
    linears = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
    if len(linears) == 1 and not any(True for _ in linears[0][1].children()):
        return f"{linears[0][0]}.weight", linears[0][1].weight
    return None


def is_router(module: nn.Module, *, own_top_k: bool = True) -> bool:
    """Whether ``module`` is a top-k router: a ``*Router`` (or ``*Gate``) class, an ``(E, H)`` weight, an int ``top_k``.

    The weight is the router's own or that of its one ``nn.Linear`` (:func:`router_weight`). With ``own_top_k``
    false, a ``*Router`` class without a ``top_k`` of its own (DBRX's: its block picks the top k) is one too, and a
    ``*Gating`` class with one (JetMoE's).
    """
    kind = type(module).__name__.lower()
    top_k = getattr(module, "top_k", None)
    if not own_top_k and top_k is None and "router" in kind:
        return router_weight(module) is not None
    if not own_top_k and kind.endswith("gating"):  # JetMoE's top-k gating
        return router_weight(module) is not None and isinstance(top_k, int) and not isinstance(top_k, bool)
    return (
        ("router" in kind or kind.endswith("gate"))
        and router_weight(module) is not None
        and isinstance(top_k, int)
        and not isinstance(top_k, bool)
    )


class _MaskLogits(TorchFunctionMode):
    """Fills the dropped experts' logits with the lowest finite value wherever the router's weight makes logits."""

    def __init__(self, weight: Tensor, dropped: Tensor) -> None:
        super().__init__()
        self.dropped = dropped
        self.rows: dict[int, Tensor] = {id(weight): weight}  # the weight as (E, H), in any dtype
        self.cols: dict[int, Tensor] = {}  # its transpose (H, E)

    def _mask(self, out: Any) -> Any:
        if isinstance(out, Tensor) and out.dtype.is_floating_point and out.shape[-1:] == self.dropped.shape:
            return out.masked_fill(self.dropped.to(out.device), torch.finfo(out.dtype).min)
        return out

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        first = args[0] if args else None
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            return self._mask(out) if weight is not None and id(weight) in self.rows else out
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) > 1:
            return self._mask(out) if id(args[1]) in self.cols else out
        if isinstance(out, Tensor) and isinstance(first, Tensor):
            for same, other in ((self.rows, self.cols), (self.cols, self.rows)):
                if id(first) in same and func in _SAME:
                    same[id(out)] = out
                elif id(first) in same and func in _TRANSPOSED:
                    other[id(out)] = out
        return out


def _dropped(router: nn.Module) -> Tensor | None:
    weight = cast(tuple[str, Tensor], router_weight(router))[1]  # is_router checked it
    dropped = torch.eq(weight.detach(), 0).all(dim=1)
    return dropped if bool(dropped.any()) else None


def _before(router: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dropped = _dropped(router)
    if dropped is None:
        return None
    mode = _MaskLogits(cast(tuple[str, Tensor], router_weight(router))[1], dropped)

    def bias(a: Any) -> Any:  # a per-expert selection bias (MiniMax-M2: passed in; DeepSeek-V3: the router's own)
        if isinstance(a, Tensor) and a.dtype.is_floating_point and a.shape == dropped.shape:
            return a.masked_fill(dropped.to(a.device), torch.finfo(a.dtype).min)
        return a

    def own_bias(a: Tensor) -> Any:  # the router's own: also over its routed rows only (Inkling's, see below)
        n = a.shape[0] if a.dim() == 1 else 0
        if a.dtype.is_floating_point and 0 < n < dropped.shape[0] and not bool(dropped[n:].any()):
            return a.masked_fill(dropped[:n].to(a.device), torch.finfo(a.dtype).min)
        return bias(a)

    saved = []  # the router's own selection biases (a buffer, or a parameter: Laguna's), put back by the post-hook
    for store in (router._buffers, router._parameters):  # noqa: SLF001 - its own tensors
        for k in SELECTION_BIASES:
            if (held := store.get(k)) is not None:
                saved.append((store, k, held))
                store[k] = own_bias(held)  # a tensor while the router runs
    mode.__enter__()  # type: ignore[no-untyped-call]  # left in the post-hook (always called)
    router.__dict__[_MODE_ATTR] = (mode, saved)

    return (args[0], *(bias(a) for a in args[1:])), {k: bias(v) for k, v in kwargs.items()}


def _after(router: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
    state = router.__dict__.pop(_MODE_ATTR, None)
    if state is not None:
        mode, saved = state
        mode.__exit__(None, None, None)
        for store, k, held in saved:  # the tensors _before swapped
            store[k] = held
    return output


def route_around_dropped(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> int:
    """Put the routing hooks (see the module docs) on every router whose rows are units of one of ``clusters``.

    Idempotent: a router hooked already is left as it is.

    Args:
        model: The module the clusters were resolved against.
        clusters: The resolved clusters.

    Returns:
        The number of routers hooked now.
    """
    rows = {name for rc in clusters for m in rc.members if m.dim == 0 for name in (m.name, *m.aliases)}
    count = 0
    for name, module in model.named_modules():
        found = router_weight(module)
        weight = (f"{name}.{found[0]}" if name else found[0]) if found is not None else ""
        if weight in rows and is_router(module, own_top_k=False) and getattr(module, _HOOK_ATTR, None) is None:
            handles = (
                module.register_forward_pre_hook(_before, with_kwargs=True),
                module.register_forward_hook(_after, with_kwargs=True, always_call=True),
            )
            setattr(module, _HOOK_ATTR, handles)
            count += 1
    return count
