r"""Mixture-of-experts decoders with fused 3-D experts (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE in transformers 5).

A layer's routed experts are one module with ``gate_up_proj`` ``(E, 2 * I, H)`` and ``down_proj`` ``(E, H, I)``, and
a router ``gate.weight`` ``(E, H)``. :func:`moe` declares, per layer:

* ``mlp.{layer}``: the intermediate channels of every expert, one width per layer shared by its experts (unit ``c``:
  gate row ``c`` and up row ``I + c`` of ``gate_up_proj`` dim 1, column ``c`` of ``down_proj`` dim 2, in every
  expert), so that the stock config's ``intermediate_size`` (``moe_intermediate_size``) holds the new width;
* ``experts.{layer}``: whole routed experts (expert ``e``: ``gate_up_proj[e]``, ``down_proj[e]`` and router row
  ``e``); a dropped expert is routed around (:mod:`lightning_pat.core.routing`), so the router's softmax and top-k
  run over the kept experts, as in the shrunk model (``num_experts_per_tok`` becomes at most the experts kept);
* ``shared.{layer}`` (with ``mlp``, where the model has one, as Qwen2-MoE): the shared expert's channels, an
  ordinary MLP cluster (``shared_expert_intermediate_size`` follows);
* ``heads.{layer}``, ``residual``, ``layer.{layer}`` as for Llama (``heads`` off where q/k norms span all heads, as
  in OLMoE: no head cut is exact there) (:func:`lightning_pat.presets.transformers.llama`).

Members on dim 1 or 2 of the fused tensors are declared with ``@d`` (see :mod:`lightning_pat.core.spec.patterns`)
and pruned on the materializing path only. Every expert cluster has its own target, so every layer keeps the same
number of experts and the stock config can express the result. The kept expert width and hidden size are multiples
of :data:`WIDTH_MULTIPLE` (transformers' ``grouped_mm`` experts need 16-byte strides).
"""

from __future__ import annotations

import dataclasses
import logging
import re

from torch import nn

from lightning_pat.core.spec import WRAPPER_NAMES, Cluster
from lightning_pat.presets.transformers import (
    QUERY_HEADS_DEFAULT,
    Layout,
    build,
    check_flags,
    find_backbone,
    llama_like,
    param_names,
)

log = logging.getLogger(__name__)

_NORMS = "(?:input_layernorm|post_attention_layernorm)"
#: Kept widths of the experts' intermediate and hidden axes are multiples of this: transformers' ``grouped_mm``
#: experts (its default where torch has it) need 16-byte strides, 8 elements in bf16.
WIDTH_MULTIPLE = 8
_SHARED = r"mlp\.shared_expert\."
#: ``(block, router)`` module names of a layer's MoE block: Mixtral/Qwen/OLMoE, GraniteMoE.
BLOCKS: tuple[tuple[str, str], ...] = (("mlp", "gate"), ("block_sparse_moe", "router"))


def moe_layout(block: str = "mlp", router: str = "gate", *, shared: bool = False) -> Layout:
    """The layout of a decoder whose MLP is a block of fused routed experts (``<block>.experts``, ``<block>.<router>``).

    With ``shared`` (Qwen2-MoE: an MLP ``mlp.shared_expert`` and its sigmoid gate ``mlp.shared_expert_gate``, a Linear
    to one output) the shared expert's residual rows and columns join the residual cluster.
    """
    gate_up, down = rf"{block}\.experts\.gate_up_proj", rf"{block}\.experts\.down_proj"
    router_w = rf"{block}\.{router}\.weight"
    writers: tuple[str, ...] = (rf"{_NORMS}\.weight", r"self_attn\.o_proj\.(?:weight|bias)", rf"{down}@1")
    readers: tuple[str, ...] = (r"self_attn\.[qkv]_proj\.weight", rf"{gate_up}@2", router_w)
    params = rf"(?:self_attn\.[qkvo]_proj)\.(?:weight|bias)|{_NORMS}\.weight|self_attn\.[qk]_norm\.weight"
    params += rf"|{gate_up}|{down}|{router_w}"
    out: tuple[str, ...] = (r"self_attn\.o_proj\.(?:weight|bias)", rf"{down}@1")
    if shared:
        writers, out = (*writers, rf"{_SHARED}down_proj\.weight"), (*out, rf"{_SHARED}down_proj\.weight")
        readers = (*readers, rf"{_SHARED}(?:gate|up)_proj\.weight", r"mlp\.shared_expert_gate\.weight")
        params += rf"|{_SHARED}(?:gate|up|down)_proj\.weight|mlp\.shared_expert_gate\.weight"
    return dataclasses.replace(
        llama_like("moe", attn="self_attn", norms=_NORMS, embed="embed_tokens"),
        mlp=((rf"{gate_up}@1[0/2]", rf"{gate_up}@1[1/2]"), (rf"{down}@2",)),
        residual=(writers, readers),
        layer_params=params,
        layer_out=(out, ()),
    )


#: The layout of Mixtral, Qwen3-MoE and OLMoE.
MOE_LAYOUT = moe_layout()


def _whole_width_qk_norm(model: nn.Module) -> bool:
    """Whether a layer normalises q (or k) over all heads at once (OLMoE): a head cut would not be exact."""
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("self_attn.q_norm.weight"):
            q_proj = params.get(name.replace("q_norm", "q_proj"))
            return q_proj is not None and p.numel() == q_proj.shape[0]
    return False


def moe(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = True,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = QUERY_HEADS_DEFAULT,
    experts: bool = True,
) -> list[Cluster]:
    """Clusters of a decoder with fused routed experts (``MixtralForCausalLM``, ``Qwen2/3MoeForCausalLM``, ...).

    Args:
        model: The model, or a module that holds exactly one such backbone.
        mlp: Add ``mlp.{layer}``: the intermediate channels shared by the layer's experts (and ``shared.{layer}``:
            the shared expert's channels, where the model has one).
        heads: Add ``heads.{layer}`` (as :func:`~lightning_pat.presets.transformers.llama`).
        residual: Add ``residual`` (the hidden size across the model, the experts' and router's hidden axes
            included).
        layers: Add ``layer.{layer}`` (whole decoder layers); not with ``residual``.
        query_heads: As for :func:`~lightning_pat.presets.transformers.llama`.
        experts: Add ``experts.{layer}``: whole routed experts with their router rows.

    Returns:
        The declarations, in the order mlp, heads, residual, layers, shared, experts.

    Raises:
        ValueError: If nothing is selected, the model has no or several such backbones, or as for
            :func:`~lightning_pat.presets.transformers.llama`.
    """
    check_flags(
        "moe", mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads, experts=experts
    )  # `experts` is read here alone (build checks the others only when it runs)
    names = param_names(model)
    backbone = find_backbone(MOE_LAYOUT, names)
    prefix = backbone[0] if backbone is not None else ""
    wrappers = rf"(?:(?:{'|'.join(WRAPPER_NAMES)})\.)*"
    per_layer = rf"re:{re.escape(prefix)}layers\.(?P<layer>\d+)\.{wrappers}"
    found = [
        (block, router)
        for block, router in BLOCKS
        if any(re.fullmatch(rf"{per_layer[3:]}{block}\.{router}\.weight", n) for n in names)
        and any(re.fullmatch(rf"{per_layer[3:]}{block}\.experts\.gate_up_proj", n) for n in names)
    ]
    if not found:
        raise ValueError(
            "presets.moe: no parameter matches `<prefix>layers.N.mlp.gate.weight` (or `block_sparse_moe.router`) next "
            "to fused `experts.gate_up_proj` / `experts.down_proj`, so this is not a fused mixture-of-experts model; "
            "use presets.llama, or declare clusters by hand."
        )
    block, router = found[0]
    shared = any(re.fullmatch(per_layer[3:] + _SHARED + r"down_proj\.weight", n) for n in names)
    if heads and _whole_width_qk_norm(model):
        log.info("presets.moe: q_norm/k_norm normalise over all heads (OLMoE), which no head cut keeps: heads=False")
        heads = False
    out = (
        build(
            moe_layout(block, router, shared=shared),
            model,
            mlp=mlp,
            heads=heads,
            residual=residual,
            layers=layers,
            query_heads=query_heads,
        )
        if mlp or heads or residual or layers
        else []
    )
    out = [  # the expert weights' strides stay what transformers' grouped_mm experts need
        dataclasses.replace(c, multiple_of=WIDTH_MULTIPLE) if c.name in ("mlp.{layer}", "residual") else c for c in out
    ]
    if mlp and shared:  # the shared expert's channels: an ordinary MLP cluster
        gate_up = per_layer + _SHARED + r"(?:gate|up)_proj\.weight"
        out.append(Cluster("shared.{layer}", [gate_up], [per_layer + _SHARED + r"down_proj\.weight"]))
    if experts:
        parts = (rf"{router}\.weight", r"experts\.gate_up_proj", r"experts\.down_proj")
        out.append(Cluster("experts.{layer}", [rf"{per_layer}{block}\.{p}" for p in parts]))
    if not out:
        raise ValueError("presets.moe: select at least one of `mlp`, `heads`, `residual`, `layers`, `experts`.")
    return out
