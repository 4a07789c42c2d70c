"""Routing around dropped experts: what a masked mixture-of-experts model computes.

Dropping expert ``e`` of a layer removes its slices of the fused expert weights and row ``e`` of the router, so the
shrunk router's softmax and top-k run over the kept experts only. Zeros cannot express that (a zero router row gives
logit 0, which top-k may still pick), so the masked model routes with a forward hook on each router
(:func:`route_around_dropped`): an expert whose router row is exactly zero (a dropped expert; a trained router row is
never all zeros) gets the lowest logit, so that it is never picked while ``top_k`` experts are kept, and gets weight
exactly 0 otherwise. The hook recomputes the router's scores from those logits as the stock router does (softmax,
top-k, the top-k weights renormalized where the router does so; GraniteMoE: top-k of the logits, then their softmax).
Hence the masked model computes what the shrunk one computes, and no state beyond the weights is needed (a resumed
run or a reloaded masked checkpoint routes the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.spec import ResolvedCluster

#: Top-k routers whose scores are ``softmax(logits)``, top-k, then (``norm_topk_prob``, or always) renormalized.
SOFTMAX_TOPK_ROUTERS: tuple[str, ...] = (
    "MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter",
)  # fmt: skip
#: Top-k routers whose scores are the softmax of the top-k logits (GraniteMoE).
TOPK_SOFTMAX_ROUTERS: tuple[str, ...] = ("GraniteMoeTopKRouter",)
_HOOK_ATTR = "_lightning_pat_routing_hook"


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` is a top-k router this module can route around dropped experts for."""
    weight = module._parameters.get("weight")  # noqa: SLF001 - this module's own parameter
    return (
        type(module).__name__ in (*SOFTMAX_TOPK_ROUTERS, *TOPK_SOFTMAX_ROUTERS)
        and weight is not None
        and weight.dim() == 2
        and isinstance(getattr(module, "top_k", None), int)
    )


def _renormalizes(router: nn.Module) -> bool:
    return bool(getattr(router, "norm_topk_prob", True))  # Mixtral (no attribute) always renormalizes


def _route_hook(router: nn.Module, _inputs: Any, output: Any) -> Any:
    weight: Tensor = router._parameters["weight"]  # type: ignore[assignment]  # noqa: SLF001 - is_router checked it
    top_k: int = router.__dict__["top_k"]
    dropped_E = torch.eq(weight, 0).all(dim=1)
    if not bool(dropped_E.any()):
        return output
    logits, scores = output[0], output[1]
    logits = logits.masked_fill(dropped_E, torch.finfo(logits.dtype).min)
    if type(router).__name__ in TOPK_SOFTMAX_ROUTERS:
        top_logits, top_index = torch.topk(logits, top_k, dim=-1)
        return (logits, torch.softmax(top_logits, dim=-1).to(scores.dtype), top_index, *output[3:])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_value, top_index = torch.topk(probs, top_k, dim=-1)
    if _renormalizes(router):
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return (logits, top_value.to(scores.dtype), top_index, *output[3:])


def route_around_dropped(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> int:
    """Put the routing hook (see the module docs) on every router whose rows are units of one of ``clusters``.

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
        weight = f"{name}.weight" if name else "weight"
        if weight in rows and is_router(module) and getattr(module, _HOOK_ATTR, None) is None:
            setattr(module, _HOOK_ATTR, module.register_forward_hook(_route_hook))
            count += 1
    return count
