"""Shrink rules for mixture-of-experts blocks: fused 3-D expert weights and their top-k router.

Hugging Face keeps a layer's routed experts as one module holding fused 3-D parameters (Mixtral, Qwen2/3-MoE, OLMoE):
``gate_up_proj`` of shape ``(E, 2 * I, H)`` (the gate rows ``[0, I)``, then the up rows ``[I, 2 * I)``) and
``down_proj`` of shape ``(E, H, I)``; the router next to it holds ``weight`` of shape ``(E, H)``. The shrink may cut

* whole experts: dim 0 of both fused weights and the router's rows, the same experts everywhere (``num_experts`` of
  the experts, the router and the block follow; ``top_k`` becomes ``min(top_k, experts kept)``);
* the intermediate channels of every expert: ``gate_up_proj`` dim 1 (the same channels in its gate and up halves)
  and ``down_proj`` dim 2 (``intermediate_dim`` follows);
* the residual: ``gate_up_proj`` dim 2, ``down_proj`` dim 1, the router's columns (``hidden_dim`` follows).

A model's config gets the expert count (``num_local_experts`` / ``num_experts``), ``num_experts_per_tok`` and the
experts' width (``moe_intermediate_size`` where the config has one, else ``intermediate_size``) where they are the
same in every layer, and a shared expert's width (``shared_expert_intermediate_size``). How a dropped expert is
routed around in the masked model: :mod:`lightning_pat.core.routing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pat.core.routing import is_router
from lightning_pat.shrink.cuts import Edit

#: (kind, attribute) -> dims that may be cut.
EXPERT_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("experts", "gate_up_proj"): (0, 1, 2),
    ("experts", "down_proj"): (0, 1, 2),
    ("router", "weight"): (0, 1),
}
#: The kinds this module rewrites.
EXPERT_KINDS: frozenset[str] = frozenset(kind for kind, _ in EXPERT_DIMS)


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused 3-D ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``."""
    params = module._parameters  # noqa: SLF001 - this module's own parameters only
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return False
    num, double, hidden = gate_up.shape
    return tuple(down.shape) == (num, hidden, double // 2) and double % 2 == 0 and "gate_up_proj_bias" not in params


def experts_kind(module: nn.Module) -> str | None:
    """``"experts"``, ``"router"`` or ``None``."""
    if is_fused_experts(module):
        return "experts"
    return "router" if is_router(module) else None


def _cut(edit: Edit | None, attr: str, dim: int, length: int) -> Tensor:
    if edit is not None and dim in edit.cuts.get(attr, {}):
        return edit.cuts[attr][dim].cpu()
    return torch.arange(length)


def check_experts(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Every MoE block must cut the same experts everywhere and the same channels in the gate and up halves.

    Raises:
        ValueError: Naming the block and what differs.
    """
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        router = getattr(block, "gate", None) if hasattr(block, "gate") else getattr(block, "router", None)
        if not isinstance(experts, nn.Module) or not is_fused_experts(experts):
            continue
        e_edit, r_edit = edits.get(id(experts)), edits.get(id(router)) if isinstance(router, nn.Module) else None
        if e_edit is None and r_edit is None:
            continue
        num, double, _ = cast(Tensor, experts.gate_up_proj).shape
        kept = {
            "experts.gate_up_proj": _cut(e_edit, "gate_up_proj", 0, num),
            "experts.down_proj": _cut(e_edit, "down_proj", 0, num),
        }
        if isinstance(router, nn.Module) and is_router(router):
            kept["router.weight"] = _cut(r_edit, "weight", 0, num)
        if any(not torch.equal(k, kept["experts.down_proj"]) for k in kept.values()):
            raise ValueError(
                f"Shrink: MoE block {name!r} would keep different experts in {sorted(kept)} "
                f"({ {k: v.numel() for k, v in kept.items()} }); list the router's rows and both fused expert weights "
                "(dim 0) in one cluster, so that an expert goes with its router row."
            )
        if min(v.numel() for v in kept.values()) == 0:
            raise ValueError(f"Shrink: MoE block {name!r} would keep no expert; keep at least one.")
        rows = _cut(e_edit, "gate_up_proj", 1, double)
        half = double // 2
        gate, up = rows[rows < half], rows[rows >= half] - half
        down = _cut(e_edit, "down_proj", 2, half)
        if not (torch.equal(gate, up) and torch.equal(gate, down)):
            raise ValueError(
                f"Shrink: MoE block {name!r} would cut different intermediate channels in the gate half, the up half "
                "of `experts.gate_up_proj` (dim 1) and `experts.down_proj` (dim 2); list `gate_up_proj@1[0/2]`, "
                "`gate_up_proj@1[1/2]` and `down_proj@2` in one cluster."
            )


def _set_int(module: nn.Module, attr: str, value: int) -> None:
    if isinstance(getattr(module, attr, None), int) and not isinstance(getattr(module, attr), bool):
        setattr(module, attr, value)


def rewrite_experts(edit: Edit, new_params: Mapping[int, Tensor]) -> None:
    """Give an experts module or a router its new data, and its sizes."""
    module = edit.module
    for attr in edit.cuts:
        param = module._parameters[attr]  # noqa: SLF001 - the registered tensor itself
        if param is not None and param.shape != new_params[id(param)].shape:
            param.data = new_params[id(param)]
    if edit.kind == "experts":
        num, double, hidden = cast(Tensor, module.gate_up_proj).shape
        _set_int(module, "num_experts", num)
        _set_int(module, "intermediate_dim", double // 2)
        _set_int(module, "hidden_dim", hidden)
    else:
        num, hidden = cast(Tensor, module.weight).shape
        _set_int(module, "num_experts", num)
        _set_int(module, "hidden_dim", hidden)
        _set_int(module, "top_k", min(cast(int, module.top_k), num))


def update_blocks(model: nn.Module) -> None:
    """A MoE block's own ``top_k`` / ``num_experts`` after its experts were cut."""
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module) and is_fused_experts(experts):
            num = cast(Tensor, experts.gate_up_proj).shape[0]
            _set_int(block, "num_experts", num)
            if isinstance(getattr(block, "top_k", None), int):
                _set_int(block, "top_k", min(cast(int, block.top_k), num))


def shared_experts(model: nn.Module) -> list[nn.Module]:
    """The shared experts (``shared_expert``, an MLP next to fused routed experts, as in Qwen2-MoE)."""
    return [
        cast(nn.Module, block.shared_expert)
        for block in model.modules()
        if isinstance(getattr(block, "shared_expert", None), nn.Module)
        and isinstance(getattr(block, "experts", None), nn.Module)
        and is_fused_experts(cast(nn.Module, block.experts))
    ]


def expert_config(model: nn.Module) -> dict[str, int | None]:
    """The config values of the experts' new sizes, ``None`` where layers differ (per-layer counts: our format)."""
    fused = [m for m in model.modules() if is_fused_experts(m)]
    if not fused:
        return {}
    counts = {cast(Tensor, m.gate_up_proj).shape[0] for m in fused}
    widths = {cast(Tensor, m.down_proj).shape[2] for m in fused}
    config: Any = getattr(model, "config", None)
    out: dict[str, int | None] = {}
    count = counts.pop() if len(counts) == 1 else None
    for attr in ("num_local_experts", "num_experts"):
        if isinstance(getattr(config, attr, None), int):
            out[attr] = count
    top_k = getattr(config, "num_experts_per_tok", None)
    if isinstance(top_k, int):
        out["num_experts_per_tok"] = min(top_k, min(cast(Tensor, m.gate_up_proj).shape[0] for m in fused))
    width_attr = "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size"
    out[width_attr] = widths.pop() if len(widths) == 1 else None
    shared = {m.down_proj.in_features for m in shared_experts(model) if isinstance(m.down_proj, nn.Linear)}
    if shared and isinstance(getattr(config, "shared_expert_intermediate_size", None), int):
        out["shared_expert_intermediate_size"] = shared.pop() if len(shared) == 1 else None
    return out
