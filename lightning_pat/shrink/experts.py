"""Shrink rules for mixture-of-experts blocks: fused 3-D expert weights and their top-k router.

Hugging Face keeps a layer's routed experts as one module holding fused 3-D parameters. Most families (Mixtral,
Qwen2/3-MoE, OLMoE, GraniteMoE, PhiMoE, FlexOlmo, MiniMax-M2, Cohere2-MoE) hold ``gate_up_proj`` of shape
``(E, 2 * I, H)`` (the gate rows ``[0, I)``, then the up rows ``[I, 2 * I)``) and ``down_proj`` of shape
``(E, H, I)``; gpt-oss holds them transposed (``(E, H, 2 * I)`` and ``(E, I, H)``, the module's ``is_transposed``),
gate and up interleaved (gate ``2c``, up ``2c + 1``: ``is_concatenated`` false) and with biases
``gate_up_proj_bias`` ``(E, 2 * I)`` and ``down_proj_bias`` ``(E, H)``. Gate-less experts (Nemotron-H, Ergo: an
activation of one up projection, ``has_gate`` false) hold ``up_proj`` ``(E, I, H)`` instead, or transposed
``(E, H, I)`` (Ergo), and may hold per-expert tensors in a child (Ergo's ``post_expert_norm``, a norm weight
``(E, H)`` per expert). :func:`fused_layout` reads which from the shapes (and the module's flags). The
router next to it holds ``weight`` of shape ``(E, H)`` (and gpt-oss a ``bias`` ``(E,)``). The shrink may cut

* whole experts: dim 0 of every fused weight and bias and the router's rows, the same experts everywhere
  (``num_experts`` of the experts, the router and the block follow; ``top_k`` becomes ``min(top_k, experts kept)``;
  a block's per-expert ``e_score_correction_bias`` buffer, MiniMax-M2's, keeps the kept experts' entries; a
  per-expert norm's rows, Ergo's);
* the intermediate channels of every expert: ``gate_up_proj``'s channel dim (the same channels in its gate and up
  parts; ``up_proj``'s in gate-less experts) with its bias, and ``down_proj``'s (``intermediate_dim`` /
  ``intermediate_size`` follows);
* the residual: the hidden dims, the router's columns (``hidden_dim`` follows).

Shared experts held as 3-D ``gate_proj``/``up_proj`` ``(S, I, H)`` and ``down_proj`` ``(S, H, I)`` next to the routed
ones (Inkling's, :func:`fused_shared`) have their channels cut; a router that also scores them (``E + S`` rows, the
shared experts' last: :func:`shared_router_rows`) loses only routed experts' rows.

A model's config gets the expert count (``num_local_experts`` / ``num_experts``, Aria's ``moe_num_experts``),
``num_experts_per_tok`` (Aria's ``moe_topk``) and the
experts' width (``moe_intermediate_size`` where the config has one, else ``intermediate_size``) where they are the
same in every layer, and a shared expert's width (``shared_expert_intermediate_size``, GraniteMoE-shared's
``shared_intermediate_size``). How a dropped expert is routed around in the masked model:
:mod:`lightning_pat.core.routing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pat.core.routing import is_router, router_weight
from lightning_pat.shrink.cuts import Edit
from lightning_pat.shrink.layer_config import config_value, has_field

#: (kind, attribute) -> dims that may be cut.
EXPERT_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("experts", "gate_up_proj"): (0, 1, 2),
    ("experts", "down_proj"): (0, 1, 2),
    ("experts", "gate_up_proj_bias"): (0, 1),
    ("experts", "down_proj_bias"): (0, 1),
    ("experts", "up_proj"): (0, 1, 2),  # gate-less experts (Nemotron-H, Ergo)
    ("experts", "up_proj_bias"): (0, 1),
    # a per-expert norm inside an experts module (Ergo's ``post_expert_norm``: one ``(E, H)`` weight)
    ("expert_norm", "weight"): (0, 1),
    ("router", "weight"): (0, 1),
    ("router", "bias"): (0,),
    ("router", "e_score_correction_bias"): (0,),  # a parameter in Laguna (a buffer elsewhere: PER_EXPERT_BUFFERS)
    # a block's own per-expert selection bias, passed to its router (AFMoE's ``expert_bias``)
    ("moe_block", "expert_bias"): (0,),
    ("moe_block", "e_score_correction_bias"): (0,),
    # DBRX: experts stacked as 2-D ``(E * F, H)`` rows (see :func:`stacked_experts`)
    ("stacked_experts", "w1"): (0,),
    ("stacked_experts", "v1"): (0,),
    ("stacked_experts", "w2"): (0,),
    # JetMoE: one 3-D ``weight`` ``(E, out, in)`` per projection (see :func:`parallel_experts`)
    ("parallel_experts", "weight"): (0, 1, 2),
    # Inkling: shared experts as 3-D ``gate_proj``/``up_proj`` ``(S, I, H)`` and ``down_proj`` ``(S, H, I)``
    # (see :func:`fused_shared`): their channels (and the residual) are cut, never a shared expert
    **{("fused_shared", a): (1, 2) for a in ("gate_proj", "up_proj", "down_proj")},
}
#: The kinds this module rewrites.
EXPERT_KINDS: frozenset[str] = frozenset(kind for kind, _ in EXPERT_DIMS)
#: Buffers of a MoE block holding one entry per expert (cut with the experts).
PER_EXPERT_BUFFERS = ("e_score_correction_bias",)
#: Config fields holding the routed expert count (Aria: ``moe_num_experts``) and the experts per token.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk")
#: The weights of a stacked experts module (DBRX's ``DbrxExpertGLU``): gate, up and down, each ``(E * F, H)``.
STACKED = ("w1", "v1", "w2")
#: Attributes holding a stacked experts module's expert count and width, and the config fields that build them.
STACKED_COUNTS = ("moe_num_experts", "num_experts")
STACKED_WIDTHS = ("ffn_hidden_size",)
STACKED_TOP_K = ("moe_top_k", "top_k")
#: Config fields holding the routed experts' width, the first the config has (else ``intermediate_size``).
EXPERT_WIDTH_FIELDS = ("moe_intermediate_size", "expert_ffn_hidden_size")
#: Config fields holding a shared expert's own width (Qwen2-MoE, GraniteMoE-shared, Ergo, Nemotron-H, Dots3).
SHARED_WIDTH_FIELDS = (
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_experts_intermediate_size",
)


@dataclass(frozen=True)
class FusedLayout:
    """How a fused experts module stores its weights.

    Attributes:
        transposed: ``gate_up_proj`` is ``(E, H, 2I)`` and ``down_proj`` ``(E, I, H)`` (gpt-oss), not ``(E, 2I, H)``
            and ``(E, H, I)``.
        interleaved: Gate and up channels alternate (gate ``2c``, up ``2c + 1``), not two halves.
        bias: The module holds ``gate_up_proj_bias`` ``(E, 2I)`` and ``down_proj_bias`` ``(E, H)``.
        gated: The in-projection holds a gate and an up part (``gate_up_proj``, ``2I`` channels); else it is
            ``up_proj`` alone (``I`` channels: Nemotron-H's and Ergo's gate-less experts).
    """

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    gated: bool = True

    @property
    def up(self) -> str:
        """The name of the in-projection: ``gate_up_proj``, or ``up_proj`` in gate-less experts."""
        return "gate_up_proj" if self.gated else "up_proj"

    @property
    def parts(self) -> int:
        """How many channels of the in-projection one intermediate channel holds: 2 (gate and up), or 1."""
        return 2 if self.gated else 1

    @property
    def gate_up_channels(self) -> int:
        """The dim of the in-projection (:attr:`up`) that holds the gate and up channels."""
        return 2 if self.transposed else 1

    @property
    def down_channels(self) -> int:
        """The dim of ``down_proj`` that holds the intermediate channels."""
        return 1 if self.transposed else 2

    @property
    def gate_up_hidden(self) -> int:
        """The hidden (residual) dim of the in-projection (:attr:`up`)."""
        return 1 if self.transposed else 2

    @property
    def down_hidden(self) -> int:
        """The hidden (residual) dim of ``down_proj``."""
        return 2 if self.transposed else 1


def fused_layout(module: nn.Module) -> FusedLayout | None:
    """The layout of a fused experts module (``gate_up_proj`` or ``up_proj``, and ``down_proj``, 3-D), or ``None``.

    Which dim holds the experts (0), the hidden size and the channels is read from the shapes: ``down_proj`` is
    ``(E, H, I)`` or, transposed, ``(E, I, H)``, and the in-projection reads the same ``H`` and writes ``2I``
    (``gate_up_proj``) or ``I`` (``up_proj``, gate-less experts: then the module holds nothing else but biases).
    ``is_transposed`` / ``is_concatenated`` are read from the module where it has them (transformers' experts
    decorator sets them); a module without ``is_transposed`` (Llama 4's experts) is transposed when only that reading
    fits the shapes.
    """
    params = module._parameters  # noqa: SLF001 - this module's own parameters only
    name = "gate_up_proj" if params.get("gate_up_proj") is not None else "up_proj"
    gate_up, down = params.get(name), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return None
    gated = name == "gate_up_proj"
    if not gated and set(params) - {"up_proj", "down_proj", "up_proj_bias", "down_proj_bias"}:
        return None  # a gate of its own (Inkling's shared experts: gate_proj, up_proj, down_proj), not gate-less
    parts = 2 if gated else 1
    interleaved = gated and getattr(module, "is_concatenated", True) is False
    num, a, b = gate_up.shape
    flag = getattr(module, "is_transposed", None)  # transformers' experts decorator; else read from the shapes
    for transposed in (True, False) if flag is None else (flag is True,):
        hidden, double = (a, b) if transposed else (b, a)
        want = (num, double // parts, hidden) if transposed else (num, hidden, double // parts)
        if double % parts == 0 and tuple(down.shape) == want:
            break
    else:
        return None
    gate_up_bias, down_bias = params.get(f"{name}_bias"), params.get("down_proj_bias")
    bias = gate_up_bias is not None or down_bias is not None
    if bias and (
        gate_up_bias is None
        or down_bias is None
        or tuple(gate_up_bias.shape) != (num, double)
        or tuple(down_bias.shape) != (num, hidden)
    ):
        return None
    return FusedLayout(transposed=transposed, interleaved=interleaved, bias=bias, gated=gated)


def expert_norms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, child)`` of a fused experts module's per-expert norms: children holding one ``(E, H)`` ``weight``.

    Ergo's ``post_expert_norm`` (an RMSNorm scale per expert, applied to each expert's output): its rows go with
    whole experts, its columns with the hidden size.
    """
    layout = fused_layout(module)
    if layout is None:
        return []
    num = cast(Tensor, module._parameters["down_proj"]).shape[0]  # noqa: SLF001 - its own parameter
    hidden = cast(Tensor, module._parameters["down_proj"]).shape[layout.down_hidden]  # noqa: SLF001
    return [(n, c) for n, c in module.named_children() if is_expert_norm(c) and _shape(c, "weight") == (num, hidden)]


def is_expert_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm holding one 2-D ``weight`` of scales per expert and nothing else (Ergo's)."""
    own = module._parameters  # noqa: SLF001 - this module's own parameters only
    weight = own.get("weight")
    return (
        type(module).__name__.endswith("Norm")
        and set(own) == {"weight"}
        and weight is not None
        and weight.dim() == 2
        and not any(True for _ in module.children())
    )


def stacked_experts(module: nn.Module) -> tuple[int, int] | None:
    """``(E, F)`` of a module holding its experts stacked as 2-D ``w1``, ``v1``, ``w2`` of ``(E * F, H)``, or ``None``.

    DBRX's ``DbrxExpertGLU``: expert ``e``'s gate, up and (transposed) down weights are rows ``[e * F, (e + 1) * F)``
    of ``w1``, ``v1`` and ``w2``; the module's int ``moe_num_experts`` (or ``num_experts``) is ``E``.
    """
    params = [module._parameters.get(a) for a in STACKED]  # noqa: SLF001 - this module's own parameters only
    if any(p is None or p.dim() != 2 for p in params):
        return None
    shapes = {tuple(cast(Tensor, p).shape) for p in params}
    num = next((v for a in STACKED_COUNTS if isinstance(v := getattr(module, a, None), int) and v > 0), None)
    if len(shapes) != 1 or num is None or isinstance(num, bool):
        return None
    rows = shapes.pop()[0]
    return (num, rows // num) if rows % num == 0 else None


def parallel_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds one projection of its experts as a 3-D ``weight`` ``(E, out, in)`` and nothing else.

    JetMoE's ``JetMoeParallelExperts`` (its int ``num_experts``, ``output_size`` and ``input_size`` follow a cut).
    """
    own = module._parameters  # noqa: SLF001 - this module's own parameters only
    weight = own.get("weight")
    num = getattr(module, "num_experts", None)
    return (
        set(own) == {"weight"}
        and weight is not None
        and weight.dim() == 3
        and isinstance(num, int)
        and num == weight.shape[0]
        and (getattr(module, "output_size", None), getattr(module, "input_size", None)) == tuple(weight.shape[1:])
    )


def parallel_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, bool]]:
    """``(name, block, router weight holder, gated)`` of every block of parallel experts with its router.

    A block holds ``input_linear`` and ``output_linear`` (:func:`parallel_experts`, ``(E, A, H)`` and ``(E, H, B)``)
    and a ``router`` whose weight has one row per expert. ``gated``: ``A == 2 * B``, gate and up halves (JetMoE's
    MLP experts); else ``A == B`` (its attention experts: a query projection and an output projection per expert).
    """
    out = []
    for name, block in model.named_modules():
        inp, outp, router = (block._modules.get(a) for a in ("input_linear", "output_linear", "router"))  # noqa: SLF001
        if inp is None or outp is None or router is None or not (parallel_experts(inp) and parallel_experts(outp)):
            continue
        a, b = cast(Tensor, inp.weight), cast(Tensor, outp.weight)
        weight = router_weight(router)
        if weight is None or weight[1].shape[0] != a.shape[0] or b.shape[0] != a.shape[0] or a.shape[2] != b.shape[1]:
            continue
        if a.shape[1] in (b.shape[2], 2 * b.shape[2]):
            out.append((name, block, _router_holder(router), a.shape[1] == 2 * b.shape[2]))
    return out


def fused_shared(module: nn.Module) -> tuple[int, int] | None:
    """``(S, I)`` of shared experts held as 3-D ``gate_proj``/``up_proj`` ``(S, I, H)`` and ``down_proj`` ``(S, H, I)``.

    Inkling's ``shared_experts``: ``S`` experts of the routed experts' width ``I`` (its config builds both from
    ``moe_intermediate_size``), each computing ``down @ (act(gate @ x) * up @ x)``. ``None`` for any other module.
    """
    params = [module._parameters.get(a) for a in ("gate_proj", "up_proj", "down_proj")]  # noqa: SLF001 - its own
    if any(p is None or p.dim() != 3 for p in params):
        return None
    gate, up, down = cast("list[Tensor]", params)
    num, width, hidden = gate.shape
    if tuple(up.shape) != (num, width, hidden) or tuple(down.shape) != (num, hidden, width):
        return None
    return int(num), int(width)


def shared_router_rows(block: nn.Module) -> int:
    """How many rows a MoE block's router has after its routed experts', scoring its 3-D shared experts; else 0.

    Inkling's router scores ``E`` routed experts and then its ``S`` shared experts (their weights in the same softmax,
    ``shared_expert_sink``): ``E + S`` rows, the block's ``shared_experts`` holding ``S`` (:func:`fused_shared`). A
    whole routed expert is its row ``e < E``; the last ``S`` rows stay.
    """
    experts, shared = getattr(block, "experts", None), getattr(block, "shared_experts", None)
    router = block_router(block)
    found = router_weight(router) if router is not None else None
    if not isinstance(experts, nn.Module) or not is_fused_experts(experts) or found is None:
        return 0
    num = _shape(experts)[0]
    extra = found[1].shape[0] - num
    counts = fused_shared(shared) if isinstance(shared, nn.Module) else None
    return extra if counts is not None and extra == counts[0] > 0 else 0


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused 3-D ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` (:func:`fused_layout`)."""
    return fused_layout(module) is not None


def experts_kind(module: nn.Module) -> str | None:
    """The expert rule of ``module``, or ``None``.

    ``"experts"``, ``"router"``, ``"moe_block"`` (a block holding per-expert parameters itself), ``"expert_norm"``
    (:func:`is_expert_norm`), ``"stacked_experts"``, ``"parallel_experts"``.
    """
    if is_fused_experts(module):
        return "experts"
    if fused_shared(module) is not None:
        return "fused_shared"
    if stacked_experts(module) is not None:
        return "stacked_experts"
    if parallel_experts(module):
        return "parallel_experts"
    if is_expert_norm(module):
        return "expert_norm"
    if is_router(module):
        return "router"
    experts = getattr(module, "experts", None)
    own = any(module._parameters.get(a) is not None for k, a in EXPERT_DIMS if k == "moe_block")  # noqa: SLF001
    if own and isinstance(experts, nn.Module) and is_fused_experts(experts) and block_router(module) is not None:
        return "moe_block"
    return None


def _router_holder(router: nn.Module) -> nn.Module:
    """The module that holds the router's ``(E, H)`` weight as ``weight``: the router, or its one ``nn.Linear``."""
    found = router_weight(router)
    if found is None or found[0] == "weight":
        return router
    return router.get_submodule(found[0].rsplit(".", 1)[0])


def block_router(block: nn.Module) -> nn.Module | None:
    """The router of a MoE block (its ``gate`` or ``router`` child), or ``None``."""
    for name in ("gate", "router"):
        child = getattr(block, name, None)
        if isinstance(child, nn.Module) and is_router(child):
            return child
    return None


def _cut(edit: Edit | None, attr: str, dim: int, length: int) -> Tensor:
    if edit is not None and dim in edit.cuts.get(attr, {}):
        return edit.cuts[attr][dim].cpu()
    return torch.arange(length)


def _gate_and_up(rows: Tensor, half: int, interleaved: bool, *, gated: bool = True) -> tuple[Tensor, Tensor]:
    """The intermediate channels kept in the gate part and in the up part of ``gate_up_proj`` (``up_proj``: both)."""
    if not gated:
        return rows, rows
    if interleaved:
        return rows[rows % 2 == 0] // 2, rows[rows % 2 == 1] // 2
    return rows[rows < half], rows[rows >= half] - half


def stacked_blocks(model: nn.Module) -> list[tuple[str, list[nn.Module], nn.Module | None]]:
    """Per stacked experts module (:func:`stacked_experts`): its name, its owners up to its block, its router.

    The router is the weight holder of the block's ``router`` or ``gate`` child with one row per expert, or ``None``.
    The block is the nearest of the module's parent and grandparent holding such a router (DBRX: ``ffn``, holding
    ``router`` and ``experts``, whose ``mlp`` holds the weights).
    """
    modules = dict(model.named_modules())
    out = []
    for name, module in modules.items():
        found = stacked_experts(module)
        if found is None:
            continue
        chain, holder, parts = [module], None, name.split(".")
        for up in (1, 2):
            if len(parts) < up:
                break
            owner = modules[".".join(parts[:-up])]
            chain.append(owner)
            for attr in ("router", "gate"):
                child = owner._modules.get(attr)  # noqa: SLF001 - a direct child
                weight = router_weight(child) if child is not None else None
                if weight is not None and weight[1].shape[0] == found[0]:
                    holder = _router_holder(child)
            if holder is not None:
                break
        out.append((name, chain, holder))
    return out


def _check_stacked(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """A stacked experts module must keep the same rows in its three weights and as many in every kept expert.

    A dropped expert loses all its rows and its router row.
    """
    for name, chain, holder in stacked_blocks(model):
        module = chain[0]
        edit = edits.get(id(module))
        r_edit = edits.get(id(holder)) if holder is not None else None
        if edit is None and r_edit is None:
            continue
        num, width = cast(tuple[int, int], stacked_experts(module))
        rows = {a: _cut(edit, a, 0, num * width) for a in STACKED}
        per_expert = torch.bincount(rows["w1"] // width, minlength=num)
        experts = torch.nonzero(per_expert).flatten()
        router = _cut(r_edit, "weight", 0, num) if holder is not None else experts
        same = all(torch.equal(r, rows["w1"]) for r in rows.values())
        if not same or not torch.equal(router, experts) or len(set(per_expert[experts].tolist())) > 1:
            raise ValueError(
                f"Shrink: stacked experts {name!r} (w1, v1, w2: {num} experts x {width} rows) would keep "
                f"{'different rows in w1, v1 and w2' if not same else f'{per_expert.tolist()} rows per expert'} "
                f"(router rows kept: {router.tolist()}); every kept expert must keep the same number of rows, the "
                "same in the three weights, and a dropped expert its router row too. Declare the experts' channels "
                "with unit_groups=E, or whole experts with the router's rows, as presets.moe does."
            )
        if experts.numel() == 0:
            raise ValueError(f"Shrink: stacked experts {name!r} would keep no expert; keep at least one.")


def _check_parallel(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """A block of parallel experts must keep the same experts in its projections and router, and the same channels.

    The gate and up halves of ``input_linear`` (dim 1) and ``output_linear``'s columns (dim 2) go together.
    """
    for name, block, holder, gated in parallel_blocks(model):
        inp, outp = block.get_submodule("input_linear"), block.get_submodule("output_linear")
        e_in, e_out, e_r = (edits.get(id(m)) for m in (inp, outp, holder))
        if e_in is None and e_out is None and e_r is None:
            continue
        num, double, _ = _shape(inp, "weight")
        kept = [_cut(e_in, "weight", 0, num), _cut(e_out, "weight", 0, num), _cut(e_r, "weight", 0, num)]
        rows = _cut(e_in, "weight", 1, double)
        gate, up = _gate_and_up(rows, double // 2, False) if gated else (rows, rows)
        same = torch.equal(gate, up) and torch.equal(gate, _cut(e_out, "weight", 2, _shape(outp, "weight")[2]))
        if not all(torch.equal(k, kept[0]) for k in kept) or not same or kept[0].numel() == 0:
            raise ValueError(
                f"Shrink: block {name!r} would keep different experts in `input_linear`, `output_linear` and its "
                "router (dim 0), different channels in the gate and up halves of `input_linear` (dim 1) and "
                "`output_linear` (dim 2), or no expert; declare them together as presets.moe does."
            )


def check_experts(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Every MoE block must cut the same experts everywhere and the same channels in the gate and up parts.

    Raises:
        ValueError: Naming the block and what differs.
    """
    _check_stacked(model, edits)
    _check_parallel(model, edits)
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        layout = fused_layout(experts) if isinstance(experts, nn.Module) else None
        if experts is None or layout is None:
            continue
        router = block_router(block)
        holder = _router_holder(router) if router is not None else None
        e_edit, r_edit = edits.get(id(experts)), edits.get(id(holder)) if holder is not None else None
        if e_edit is None and r_edit is None:
            continue
        up = layout.up
        num = _shape(experts, up)[0]
        double = _shape(experts, up)[layout.gate_up_channels]
        attrs = (up, "down_proj", *((f"{up}_bias", "down_proj_bias") if layout.bias else ()))
        kept = {f"experts.{a}": _cut(e_edit, a, 0, num) for a in attrs}
        for norm_name, norm in expert_norms(experts):
            kept[f"experts.{norm_name}.weight"] = _cut(edits.get(id(norm)), "weight", 0, num)
        if holder is not None:
            extra = shared_router_rows(block)
            kept["router.weight"] = _routed_rows(name, _cut(r_edit, "weight", 0, num + extra), num, extra)
            if holder._parameters.get("bias") is not None:  # noqa: SLF001 - its own parameter
                kept["router.bias"] = _routed_rows(name, _cut(r_edit, "bias", 0, num + extra), num, extra)
        if any(not torch.equal(k, kept["experts.down_proj"]) for k in kept.values()):
            raise ValueError(
                f"Shrink: MoE block {name!r} would keep different experts in {sorted(kept)} "
                f"({ {k: v.numel() for k, v in kept.items()} }); list the router's rows (and bias) and every fused "
                "expert weight and bias (dim 0) in one cluster, so that an expert goes with its router row."
            )
        if min(v.numel() for v in kept.values()) == 0:
            raise ValueError(f"Shrink: MoE block {name!r} would keep no expert; keep at least one.")
        if router is not None:
            check_groups(name, router, kept["experts.down_proj"], num)
        rows = _cut(e_edit, up, layout.gate_up_channels, double)
        gate, up_rows = _gate_and_up(rows, double // 2, layout.interleaved, gated=layout.gated)
        down = _cut(e_edit, "down_proj", layout.down_channels, double // layout.parts)
        same = torch.equal(gate, up_rows) and torch.equal(gate, down)
        if layout.bias:
            same = same and torch.equal(rows, _cut(e_edit, f"{up}_bias", 1, double))
            hidden = experts.down_proj.shape[layout.down_hidden]
            same = same and torch.equal(
                _cut(e_edit, "down_proj", layout.down_hidden, hidden), _cut(e_edit, "down_proj_bias", 1, hidden)
            )
        if not same:
            where = f"{up}@{layout.gate_up_channels}"
            parts = f"`{where}` (block 2)" if layout.interleaved else f"`{where}[0/2]`, `{where}[1/2]`"
            parts = parts if layout.gated else f"`{where}`"  # gate-less: channel c of up_proj alone
            raise ValueError(
                f"Shrink: MoE block {name!r} would cut different intermediate channels in the gate and up parts of "
                f"`experts.{up}` (dim {layout.gate_up_channels}), its bias and `experts.down_proj` (dim "
                f"{layout.down_channels}); list {parts}, `down_proj@{layout.down_channels}` (and the biases) in one "
                "cluster."
            )


def _routed_rows(name: str, rows: Tensor, num: int, extra: int) -> Tensor:
    """The routed experts' rows among a router's kept ``rows``; its ``extra`` last rows (shared experts') all kept.

    Raises:
        ValueError: If a shared expert's row would be cut.
    """
    if extra and not torch.equal(rows[rows >= num].cpu(), torch.arange(num, num + extra)):
        raise ValueError(
            f"Shrink: MoE block {name!r}'s router scores its {extra} shared experts in its last rows ({num} to "
            f"{num + extra - 1}), which must stay; list only its first {num} rows (`weight[0:{num}]`) with the "
            "experts."
        )
    return rows[rows < num]


def expert_groups(router: nn.Module) -> int:
    """How many consecutive groups of experts a group-limited router picks from (DeepSeek's ``n_group``), else 1."""
    groups = getattr(router, "num_group", None)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 1:
        return 1
    return 1 if getattr(router, "topk_method", "group_limited_greedy") == "greedy" else groups


def check_groups(name: str, router: nn.Module, kept: Tensor, num: int) -> None:
    """Refuse a cut that a group-limited router (DeepSeek-V2/V3) could not route as the masked model does.

    Every group must keep the same number of experts, enough for the group score and the top-k; the config's
    ``n_group`` and ``topk_group`` then hold as they are.

    Raises:
        ValueError: With the numbers, naming the block.
    """
    groups = expert_groups(router)
    if groups == 1:
        return
    per_group = torch.bincount(kept // (num // groups), minlength=groups).tolist()
    need = 2 if "e_score_correction_bias" in router._buffers else 1  # noqa: SLF001 - V3 sums each group's top 2
    top_k, topk_group = int(getattr(router, "top_k", 1)), int(getattr(router, "topk_group", groups))
    if len(set(per_group)) != 1 or per_group[0] < need or top_k > topk_group * per_group[0]:
        raise ValueError(
            f"Shrink: MoE block {name!r} routes within {groups} groups of {num // groups} experts (n_group), picking "
            f"{topk_group} groups (topk_group) and {top_k} experts (top_k); the cut keeps {per_group} experts per "
            f"group, but every group must keep the same number, at least {need} and at least "
            f"top_k / topk_group = {-(-top_k // topk_group)}. Declare the expert cluster with unit_groups={groups} "
            "(presets.moe does) and a target that keeps enough experts."
        )


def _shape(module: nn.Module, attr: str = "down_proj") -> tuple[int, ...]:
    """The shape of one of ``module``'s own parameters."""
    return tuple(cast(Tensor, module._parameters[attr]).shape)  # noqa: SLF001 - its own parameter


def _set_int(module: nn.Module, attr: str, value: int) -> None:
    if isinstance(getattr(module, attr, None), int) and not isinstance(getattr(module, attr), bool):
        setattr(module, attr, value)


def rewrite_experts(edit: Edit, new_params: Mapping[int, Tensor]) -> None:
    """Give an experts module or a router its new data, and its sizes."""
    module = edit.module
    layout = fused_layout(module) if edit.kind == "experts" else None  # read before the cut: shapes consistent
    stacked = stacked_experts(module) if edit.kind == "stacked_experts" else None
    for attr in edit.cuts:
        param = module._parameters[attr]  # noqa: SLF001 - the registered tensor itself
        if param is not None and param.shape != new_params[id(param)].shape:
            param.data = new_params[id(param)]
    if layout is not None:
        shape = _shape(module, layout.up)
        num, double, hidden = shape[0], shape[layout.gate_up_channels], shape[layout.gate_up_hidden]
        _set_int(module, "num_experts", num)
        for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
            _set_int(module, attr, double // layout.parts)
        for attr in ("hidden_dim", "hidden_size"):
            _set_int(module, attr, hidden)
    elif stacked is not None:  # the experts kept are those with a kept row; each keeps the same channels
        num, width = stacked
        rows = edit.cuts.get("w1", {}).get(0)
        kept = torch.unique(rows // width).numel() if rows is not None else num
        new_rows = _shape(module, "w1")[0]
        for attr in STACKED_COUNTS:
            _set_int(module, attr, kept)
        for attr in STACKED_WIDTHS:
            _set_int(module, attr, new_rows // kept)
    elif edit.kind == "parallel_experts":
        for attr, value in zip(("num_experts", "output_size", "input_size"), _shape(module, "weight"), strict=True):
            _set_int(module, attr, value)
    elif edit.kind == "router":
        num, hidden = cast(Tensor, module.weight).shape
        _set_int(module, "n_total_experts", num)  # Inkling: routed and shared (update_blocks sets num_experts)
        _set_int(module, "num_experts", num)
        _set_int(module, "hidden_dim", hidden)
        _set_int(module, "top_k", min(cast(int, module.top_k), num))


def _extra_router_rows(model: nn.Module) -> bool:
    """Whether a fused-experts block's router scores more rows than its experts (LongCat-Flash's zero experts).

    Its top-k may exceed the experts (the extra rows are identity experts), so no count or top-k follows the experts.
    """
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or not is_fused_experts(experts):
            continue
        router = block_router(block)
        found = router_weight(router) if router is not None else None
        if found is not None and found[1].shape[0] != _shape(experts)[0] + shared_router_rows(block):
            return True
    return False


def update_blocks(model: nn.Module, edits: Mapping[int, Edit] | None = None) -> None:
    """A MoE block's own ``top_k`` / ``num_experts`` (and its router's) after its experts were cut.

    With ``edits`` (those of the shrink), a block's per-expert buffers (:data:`PER_EXPERT_BUFFERS`) keep the kept
    experts' entries.
    """
    modules = dict(model.named_modules())
    for name, block, holder, gated in parallel_blocks(model):  # JetMoE: the block, its router and the attention read E
        num = _shape(block.get_submodule("input_linear"), "weight")[0]
        if gated:  # JetMoeMoE's hidden_size is its experts' width
            _set_int(block, "hidden_size", _shape(block.get_submodule("output_linear"), "weight")[2])
        owners = [block, *(m for n, m in modules.items() if m is not holder and holder in tuple(m.children()))]
        if "." in name:
            owners.append(modules[name.rsplit(".", 1)[0]])  # the attention holding its experts (its top_k)
        owners += [m for m in modules.values() if hasattr(m, "config")]  # JetMoeForCausalLM's own num_experts
        for owner in owners:
            _set_int(owner, "num_experts", num)
            for attr in ("top_k", "num_experts_per_tok"):
                if isinstance(top_k := getattr(owner, attr, None), int):
                    _set_int(owner, attr, min(top_k, num))
    for _, chain, _ in stacked_blocks(model):  # DBRX: the experts' owners and the block read E, F and top-k
        found = stacked_experts(chain[0])
        if found is None:
            continue
        for owner in chain:
            for attr in STACKED_COUNTS:
                _set_int(owner, attr, found[0])
            for attr in STACKED_WIDTHS:
                _set_int(owner, attr, found[1])
            if isinstance(top_k := getattr(owner, "top_k", None), int):
                _set_int(owner, "top_k", min(top_k, found[0]))
    if _extra_router_rows(model):
        return  # a router scoring more than its experts (LongCat-Flash's zero experts): no expert is cut, top-k holds
    counts = {_shape(m)[0] for m in model.modules() if is_fused_experts(m)}
    if len(counts) == 1:  # the model's own copies (Mixtral's CausalLM reads num_experts for its auxiliary loss)
        num = counts.pop()
        for owner in model.modules():
            if hasattr(owner, "config"):
                _set_int(owner, "num_experts", num)
                if isinstance(top_k := getattr(owner, "num_experts_per_tok", None), int):
                    _set_int(owner, "num_experts_per_tok", min(top_k, num))
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or not is_fused_experts(experts):
            continue
        num = _shape(experts)[0]
        router = block_router(block)
        for module in (block, router) if router is not None else (block,):
            _set_int(module, "num_experts", num)
            if isinstance(top_k := getattr(module, "top_k", None), int):
                _set_int(module, "top_k", min(top_k, num))
        edit = (edits or {}).get(id(experts))
        kept = edit.cuts.get("down_proj", {}).get(0) if edit is not None else None
        for owner in (block, router) if router is not None else (block,):
            for attr in PER_EXPERT_BUFFERS:
                buf = owner._buffers.get(attr)  # noqa: SLF001 - this module's own buffer
                if kept is not None and buf is not None and buf.dim() == 1 and buf.shape[0] != num:
                    owner._buffers[attr] = buf.index_select(0, kept.to(buf.device))  # noqa: SLF001


def shared_experts(model: nn.Module) -> list[nn.Module]:
    """The shared experts next to fused routed experts (``shared_expert``, ``shared_experts``, ``shared_mlp``)."""
    return [
        getattr(block, attr)
        for block in model.modules()
        for attr in ("shared_expert", "shared_experts", "shared_mlp")
        if isinstance(getattr(block, attr, None), nn.Module)
        and isinstance(getattr(block, "experts", None), nn.Module)
        and is_fused_experts(cast(nn.Module, block.experts))
    ]


def _shared_mlp_widths(model: nn.Module) -> set[int]:
    """The widths of GraniteMoE-shared's shared MLPs (``shared_mlp.output_linear`` next to fused experts)."""
    return {
        out.in_features
        for layer in model.modules()
        if isinstance(out := getattr(getattr(layer, "shared_mlp", None), "output_linear", None), nn.Linear)
    }


def stacked_config(model: nn.Module) -> dict[str, int | None]:
    """The config values of stacked experts' new sizes (DBRX's ``ffn_config``), ``None`` where layers differ."""
    found = [f for _, chain, _ in stacked_blocks(model) if (f := stacked_experts(chain[0])) is not None]
    if not found:
        return {}
    counts, widths = {n for n, _ in found}, {w for _, w in found}
    out: dict[str, int | None] = {a: counts.pop() if len(counts) == 1 else None for a in STACKED_COUNTS[:1]}
    out[STACKED_WIDTHS[0]] = widths.pop() if len(widths) == 1 else None
    out["top_k_at_most"] = min(n for n, _ in found)
    return out


def _parallel_config(model: nn.Module, config: Any) -> dict[str, int | None]:
    """The config values of parallel experts' new sizes (JetMoE): the expert count (MLP and attention experts)."""
    blocks = parallel_blocks(model)
    counts = {_shape(b.get_submodule("input_linear"), "weight")[0] for _, b, _, _ in blocks}
    widths = {_shape(b.get_submodule("output_linear"), "weight")[2] for _, b, _, gated in blocks if gated}
    out: dict[str, int | None] = {}
    for attr in EXPERT_COUNT_FIELDS:
        if isinstance(config_value(config, attr), int):
            out[attr] = counts.pop() if len(counts) == 1 else None
            break
    for attr in TOP_K_FIELDS:
        if isinstance(top_k := config_value(config, attr), int):
            out[attr] = min(top_k, *(_shape(b.get_submodule("input_linear"), "weight")[0] for _, b, _, _ in blocks))
    if widths:
        out["intermediate_size"] = widths.pop() if len(widths) == 1 else None
    return out


def expert_config(model: nn.Module) -> dict[str, int | None]:
    """The config values of the experts' new sizes, ``None`` where layers differ (per-layer counts: our format)."""
    if parallel_blocks(model):
        return _parallel_config(model, getattr(model, "config", None))
    fused = [(m, layout) for m in model.modules() if (layout := fused_layout(m)) is not None]
    if not fused:
        return {}
    counts = {_shape(m)[0] for m, _ in fused}
    fewest = min(counts)
    widths = {_shape(m, "down_proj")[layout.down_channels] for m, layout in fused}
    config: Any = getattr(model, "config", None)
    out: dict[str, int | None] = {}
    count = counts.pop() if len(counts) == 1 else None
    whole = _extra_router_rows(model)  # its experts are whole: their count and top-k stay
    for attr in () if whole else EXPERT_COUNT_FIELDS:
        if isinstance(config_value(config, attr), int):
            out[attr] = count
    for attr in () if whole else TOP_K_FIELDS:
        if isinstance(top_k := config_value(config, attr), int):
            out[attr] = min(top_k, fewest)
    width_attr = next((a for a in EXPERT_WIDTH_FIELDS if has_field(config, a)), "intermediate_size")
    out[width_attr] = widths.pop() if len(widths) == 1 else None
    shared = {d.in_features for m in shared_experts(model) if isinstance(d := getattr(m, "down_proj", None), nn.Linear)}
    shared |= _shared_mlp_widths(model)
    for attr in SHARED_WIDTH_FIELDS:
        if shared and isinstance(config_value(config, attr), int):
            out[attr] = next(iter(shared)) if len(shared) == 1 else None
    return out
