r"""Mixture-of-experts decoders with fused 3-D experts (Mixtral, Qwen2/3-MoE, OLMoE in transformers 5).

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
* ``heads.{layer}``, ``residual``, ``layer.{layer}`` as for Llama (:func:`lightning_pat.presets.transformers.llama`).

Members on dim 1 or 2 of the fused tensors are declared with ``@d`` (see :mod:`lightning_pat.core.spec.patterns`)
and pruned on the materializing path only. Every expert cluster has its own target, so every layer keeps the same
number of experts and the stock config can express the result. The kept expert width and hidden size are multiples
of :data:`WIDTH_MULTIPLE` (transformers' ``grouped_mm`` experts need 16-byte strides).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from lightning_pat.core.spec import WRAPPER_NAMES, Cluster
from lightning_pat.presets.transformers import QUERY_HEADS_DEFAULT, build, find_backbone, llama_like, param_names

_NORMS = "(?:input_layernorm|post_attention_layernorm)"
_GATE_UP, _DOWN, _ROUTER = r"mlp\.experts\.gate_up_proj", r"mlp\.experts\.down_proj", r"mlp\.gate\.weight"
#: Kept widths of the experts' intermediate and hidden axes are multiples of this: transformers' ``grouped_mm``
#: experts (its default where torch has it) need 16-byte strides, 8 elements in bf16.
WIDTH_MULTIPLE = 8
#: The layout of a decoder whose MLP is a block of fused routed experts (``mlp.experts``, router ``mlp.gate``).
MOE_LAYOUT = dataclasses.replace(
    llama_like("moe", attn="self_attn", norms=_NORMS, embed="embed_tokens"),
    mlp=((rf"{_GATE_UP}@1[0/2]", rf"{_GATE_UP}@1[1/2]"), (rf"{_DOWN}@2",)),
    residual=(
        (rf"{_NORMS}\.weight", r"self_attn\.o_proj\.(?:weight|bias)", rf"{_DOWN}@1"),
        (r"self_attn\.[qkv]_proj\.weight", rf"{_GATE_UP}@2", _ROUTER),
    ),
    layer_params=rf"(?:self_attn\.[qkvo]_proj)\.(?:weight|bias)|{_NORMS}\.weight|self_attn\.[qk]_norm\.weight"
    rf"|{_GATE_UP}|{_DOWN}|{_ROUTER}",
    layer_out=((r"self_attn\.o_proj\.(?:weight|bias)", rf"{_DOWN}@1"), ()),
)
_SHARED = r"mlp\.shared_expert\."
#: With a shared expert next to the routed ones (Qwen2-MoE: an MLP ``mlp.shared_expert`` and its sigmoid gate
#: ``mlp.shared_expert_gate``, a Linear to one output): its residual rows and columns join the residual cluster.
SHARED_LAYOUT = dataclasses.replace(
    MOE_LAYOUT,
    residual=(
        (*MOE_LAYOUT.residual[0], rf"{_SHARED}down_proj\.weight"),
        (*MOE_LAYOUT.residual[1], rf"{_SHARED}(?:gate|up)_proj\.weight", r"mlp\.shared_expert_gate\.weight"),
    ),
    layer_params=rf"{MOE_LAYOUT.layer_params}|{_SHARED}(?:gate|up|down)_proj\.weight|mlp\.shared_expert_gate\.weight",
    layer_out=((*MOE_LAYOUT.layer_out[0], rf"{_SHARED}down_proj\.weight"), ()),
)


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
    names = param_names(model)
    backbone = find_backbone(MOE_LAYOUT, names)
    prefix = backbone[0] if backbone is not None else ""
    wrappers = rf"(?:(?:{'|'.join(WRAPPER_NAMES)})\.)*"
    per_layer = rf"re:{re.escape(prefix)}layers\.(?P<layer>\d+)\.{wrappers}"
    if not any(re.fullmatch(per_layer[3:] + _ROUTER, n) for n in names):
        raise ValueError(
            "presets.moe: no parameter matches `<prefix>layers.N.mlp.gate.weight` next to fused "
            "`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, so this is not a fused mixture-of-experts model; "
            "use presets.llama, or declare clusters by hand."
        )
    shared = any(re.fullmatch(per_layer[3:] + _SHARED + r"down_proj\.weight", n) for n in names)
    out = (
        build(
            SHARED_LAYOUT if shared else MOE_LAYOUT,
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
        out.append(Cluster("experts.{layer}", [per_layer + p for p in (_ROUTER, _GATE_UP, _DOWN)]))
    if not out:
        raise ValueError("presets.moe: select at least one of `mlp`, `heads`, `residual`, `layers`, `experts`.")
    return out
