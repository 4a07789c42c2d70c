r"""Mixture-of-experts decoders with fused 3-D experts (transformers 5).

Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE(-shared), PhiMoE, FlexOlmo, MiniMax-M2, Cohere2-MoE and gpt-oss keep a
layer's routed experts as one module with fused ``gate_up_proj`` and ``down_proj`` (``(E, 2 * I, H)`` and
``(E, H, I)``; gpt-oss transposed, gate and up interleaved, with biases; Nemotron-H and Ergo gate-less, an
``up_proj`` of ``I`` channels, Ergo's transposed and followed by a per-expert norm: see
:func:`lightning_pat.shrink.experts.fused_layout`) and a router ``weight`` ``(E, H)`` (gpt-oss: and a ``bias``).
The preset finds them by structure (a child ``experts`` holding the fused weights next to a ``*Router`` child, in
every decoder layer), not by family name. :func:`moe` declares, per layer:

* ``mlp.{layer}``: the intermediate channels of every expert, one width per layer shared by its experts (unit ``c``:
  the gate and up channels ``c`` of ``gate_up_proj`` (or channel ``c`` of a gate-less ``up_proj``) and its bias,
  channel ``c`` of ``down_proj``, in every expert),
  so that the stock config's ``intermediate_size`` (``moe_intermediate_size``) holds the new width;
* ``experts.{layer}``: whole routed experts (expert ``e``: its slice of every fused weight and bias, its row of a
  per-expert norm, and router row ``e``); a dropped expert is routed around (:mod:`lightning_pat.core.routing`), so
  the router runs over the kept experts, as in the shrunk model (``num_experts_per_tok`` becomes at most the experts
  kept);
* ``shared.{layer}`` (with ``mlp``, where the model has one): the shared expert's channels, an ordinary MLP cluster
  (Qwen2-MoE's ``mlp.shared_expert``: ``shared_expert_intermediate_size`` follows; GraniteMoE-shared's
  ``shared_mlp``, a fused ``input_linear``: ``shared_intermediate_size`` follows; ``shared_experts`` whose width
  the config holds in a field of its own, Nemotron-H's ``moe_shared_expert_intermediate_size``, Ergo's
  ``shared_intermediate_size``);
* ``heads.{layer}``, ``residual``, ``layer.{layer}`` as for Llama (``heads`` off where q/k norms span all heads, as
  in OLMoE, FlexOlmo and MiniMax-M2, where the attention holds other parameters of its own, or where
  linear-attention layers share the head count, MiniMax's: no head cut is exact or expressible there, and the preset
  says so; gpt-oss's ``sinks``, one logit per query head, are cut with their heads)
  (:func:`lightning_pat.presets.transformers.llama`); DeepSeek's multi-head latent
  attention has a head unit of its own (its query rows, its rows of ``kv_b_proj``, its ``o_proj`` columns; the
  latents and the shared rotary key stay whole).

Where the preset does not cover every layer (an attention it does not know: gated, MLA variants, linear attention),
``clusters="auto"`` discovers the clusters by tracing and adds the expert units above to them
(:func:`lightning_pat.discovery.entry.with_experts`); a block whose router is not one row per expert (an MLP router,
LongCat-Flash's zero-computation experts) has its experts' channels cut, never whole experts.

Two other layouts are read by structure where no fused block is found (:func:`stacked_units`, :func:`parallel_units`;
:func:`moe` returns them, and ``clusters="auto"`` uses them alone where tracing stops at an expert loop): DBRX's
experts stacked as 2-D ``w1``/``v1``/``w2`` of ``E * F`` rows (each expert's own channels, or whole experts with the
router's rows: both lie on one axis, so one of the two), and JetMoE's ``input_linear``/``output_linear`` 3-D weights
(the MLP experts' channels, whole MLP experts, whole attention experts).

Members on dim 1 or 2 of the fused tensors are declared with ``@d`` (see :mod:`lightning_pat.core.spec.patterns`)
and pruned on the materializing path only. Every expert cluster has its own target, so every layer keeps the same
number of experts and the stock config can express the result. The kept expert width and hidden size are multiples
of :data:`WIDTH_MULTIPLE` (transformers' ``grouped_mm`` experts need 16-byte strides).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import cast

from torch import Tensor, nn

from lightning_pat.core.routing import router_weight
from lightning_pat.core.spec import WRAPPER_NAMES, Cluster
from lightning_pat.presets.transformers import (
    QUERY_HEADS_DEFAULT,
    Layout,
    build,
    check_flags,
    llama_like,
    param_names,
)
from lightning_pat.shrink.experts import (
    SHARED_WIDTH_FIELDS,
    FusedLayout,
    block_router,
    expert_groups,
    expert_norms,
    fused_layout,
    fused_shared,
    parallel_blocks,
    shared_router_rows,
    stacked_blocks,
    stacked_experts,
)
from lightning_pat.shrink.layer_config import has_field
from lightning_pat.shrink.model_meta import has_sinks
from lightning_pat.shrink.stock_config import head_count_multiple

log = logging.getLogger(__name__)

_NORMS = "(?:input_layernorm|post_attention_layernorm)"
#: Kept widths of the experts' intermediate and hidden axes are multiples of this: transformers' ``grouped_mm``
#: experts (its default where torch has it) need 16-byte strides, 8 elements in bf16.
WIDTH_MULTIPLE = 8
_SHARED_MLP = r"shared_mlp\."
#: A block's shared MLP next to its routed experts: DeepSeek's ``shared_experts``, Llama 4's ``shared_expert``,
#: Hunyuan-MoE's ``shared_mlp`` (gate/up/down, as wide as the experts times the shared count).
_SHARED = r"(?:shared_experts?|shared_mlp)"
#: ``(block, router)`` module names of a layer's MoE block: Mixtral/Qwen/OLMoE, PhiMoE/gpt-oss, GraniteMoE.
BLOCKS: tuple[tuple[str, str], ...] = (("mlp", "gate"), ("mlp", "router"), ("block_sparse_moe", "router"))
_WRAPPERS = rf"(?:(?:{'|'.join(WRAPPER_NAMES)})\.)*"


def _gate_up(
    block: str, fused: FusedLayout, *, joint_shared: bool = False, fused_shared: bool = False
) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
    """``(writers, readers, head_dim)`` of the experts' intermediate channels, relative to the layer.

    ``joint_shared``: the block's ``shared_experts`` MLP (DeepSeek, Cohere2-MoE; Llama 4's ``shared_expert``) is as wide
    as the experts times the config's shared-expert count, so its channels join the same units (``s`` channels per
    unit for ``s`` experts). ``fused_shared``: the block's ``shared_experts`` are 3-D ``gate_proj``/``up_proj``
    ``(S, I, H)`` and ``down_proj`` ``(S, H, I)`` of the experts' width (Inkling's): channel ``c`` of every shared
    expert joins unit ``c``.
    """
    gate_up, down = rf"{block}\.experts\.{fused.up}", rf"{block}\.experts\.down_proj"
    dim = fused.gate_up_channels
    bias = (rf"{gate_up}_bias@1",) if fused.bias else ()
    readers: tuple[str, ...] = (rf"{down}@{fused.down_channels}",)
    shared_w: tuple[str, ...] = ()
    if joint_shared:
        shared_w = (rf"{block}\.{_SHARED}\.(?:gate|up)_proj\.(?:weight|bias)",)
        readers = (*readers, rf"{block}\.{_SHARED}\.down_proj\.weight")
    if fused_shared:
        shared_w = (rf"{block}\.shared_experts\.(?:gate|up)_proj@1",)
        readers = (*readers, rf"{block}\.shared_experts\.down_proj@2")
    if not fused.gated:  # up_proj alone: channel c of up_proj and of down_proj
        return (rf"{gate_up}@{dim}", *bias, *shared_w), readers, 1 if joint_shared else None
    if fused.interleaved:  # gate 2c, up 2c + 1: a unit is a block of 2 channels (head_dim=1 over I)
        return (rf"{gate_up}@{dim}", *bias, *shared_w), readers, 1
    halves = tuple(rf"{p}[{i}/2]" for p in (rf"{gate_up}@{dim}", *bias) for i in range(2))
    return (*halves, *shared_w), readers, 1 if joint_shared else None


def moe_layout(
    block: str = "mlp", router: str = "gate", *, shared: bool = False, fused: FusedLayout | None = None
) -> Layout:
    """The layout of a decoder whose MLP is a block of fused routed experts (``<block>.experts``, ``<block>.<router>``).

    With ``shared`` (Qwen2-MoE: an MLP ``mlp.shared_expert`` and its sigmoid gate ``mlp.shared_expert_gate``, a Linear
    to one output) the shared expert's residual rows and columns join the residual cluster. ``fused``: how the
    experts store their weights (default: ``(E, 2I, H)`` halves, no biases).
    """
    fused = fused or FusedLayout()
    shared_re = rf"{block}\.shared_expert\."
    gate_up, down = rf"{block}\.experts\.{fused.up}", rf"{block}\.experts\.down_proj"
    router_w = rf"{block}\.{router}\.(?:[^.]+\.)?(?:weight|bias)|{block}\.(?:expert_bias|e_score_correction_bias)"
    biases = rf"|{gate_up}_bias|{down}_bias" if fused.bias else ""
    down_out = (rf"{down}@{fused.down_hidden}", *((rf"{down}_bias@1",) if fused.bias else ()))
    writers: tuple[str, ...] = (rf"{_NORMS}\.weight", r"self_attn\.o_proj\.(?:weight|bias)", *down_out)
    readers: tuple[str, ...] = (r"self_attn\.[qkv]_proj\.weight", rf"{gate_up}@{fused.gate_up_hidden}",
                                rf"{block}\.{router}\.weight")  # fmt: skip
    params = rf"(?:self_attn\.[qkvo]_proj)\.(?:weight|bias)|{_NORMS}\.(?:weight|bias)|self_attn\.[qk]_norm\.weight"
    params += rf"|{gate_up}|{down}|{router_w}{biases}|self_attn\.sinks|post_feedforward_layernorm\.weight"
    params += rf"|{block}\.{router}\.e_score_correction_bias"
    params += rf"|{_SHARED_MLP}(?:input|output)_linear\.weight"
    params += rf"|{block}\.shared_experts?\.(?:gate|up|down|gate_up)_proj\.(?:weight|bias)"
    params += rf"|{block}\.shared_expert_gate\.weight"
    out: tuple[str, ...] = (r"self_attn\.o_proj\.(?:weight|bias)", *down_out)
    if shared:
        writers, out = (*writers, rf"{shared_re}down_proj\.weight"), (*out, rf"{shared_re}down_proj\.weight")
        readers = (*readers, rf"{shared_re}(?:gate|up)_proj\.weight", rf"{block}\.shared_expert_gate\.weight")
    mlp_writers, mlp_readers, _ = _gate_up(block, fused)
    return dataclasses.replace(
        llama_like("moe", attn="self_attn", norms=_NORMS, embed="embed_tokens"),
        head_params=r"self_attn\.sinks",
        mlp=(mlp_writers, mlp_readers),
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


def _attention_params(model: nn.Module, names: list[str]) -> list[str]:
    """Parameters an attention module holds itself that no head cut rewrites.

    gpt-oss's ``sinks`` (one logit per query head) are not among them: they are cut with their heads
    (:func:`~lightning_pat.shrink.model_meta.has_sinks`).
    """
    own = [n for n in names if re.fullmatch(rf".*layers\.\d+\.{_WRAPPERS}self_attn\.[^.]+", n)]
    return [n for n in own if not (n.endswith(".sinks") and has_sinks(model.get_submodule(n.rsplit(".", 1)[0])))]


#: Per-layer parameters of DeepSeek's multi-head latent attention (MLA), relative to the layer.
_MLA = (
    r"self_attn\.(?:q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)"
    r"\.(?:weight|bias)"
)
#: MiniMax's lightning (linear) attention layers between its full-attention ones: left whole, and the heads of the
#: full-attention layers too (the config's head count builds both kinds).
_LINEAR_ATTENTION = r"self_attn\.(?:qkv_proj|out_proj|output_gate|norm)\.weight"
#: The config fields of MLA's head count (as many KV heads as heads).
_MLA_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")
#: A dense MLP in the layers before the first MoE layer (DeepSeek's ``first_k_dense_replace``).
_DENSE = r"mlp\.(?:gate|up|down)_proj\.(?:weight|bias)"
#: Models the preset said something about already (each reason is logged once per model).
_TOLD: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _tell(model: nn.Module, message: str, *args: object) -> None:
    told = _TOLD.setdefault(model, set())
    if message not in told:
        told.add(message)
        log.warning(message, *args)


def find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, str, str, FusedLayout]]] | None:
    """The backbone prefix and, per decoder layer with one, ``(layer, block, router, layout)`` of its MoE block.

    A block is a child of the layer holding a fused ``experts`` module (:func:`~lightning_pat.shrink.experts.
    fused_layout`), and a top-k router (``gate`` or ``router``) whose rows are its experts (``router`` is ``""``
    where there is none: ZAYA's MLP router, LongCat-Flash's router that also scores zero-computation experts; the
    experts' channels can be cut there, not whole experts); ``None`` if the model has no such backbone.

    Raises:
        ValueError: If MoE blocks sit under several backbones (a preset covers one).
    """
    layer_re = re.compile(rf"(?P<prefix>(?:.+\.)?)layers\.(?P<layer>\d+)\.{_WRAPPERS}(?P<block>[^.]+)")
    found, prefixes = [], set()
    for name, module in model.named_modules():
        match = layer_re.fullmatch(name)
        experts = getattr(module, "experts", None)
        if match is None or not isinstance(experts, nn.Module) or (layout := fused_layout(experts)) is None:
            continue
        router = block_router(module)
        weight = router_weight(router) if router is not None else None
        router_name = ""  # no top-k router whose rows are these experts: the experts' channels only
        if (  # one row per expert (Inkling: then one per 3-D shared expert, see shared_router_rows)
            router is not None
            and weight is not None
            and weight[1].shape[0] == cast(Tensor, experts.down_proj).shape[0] + shared_router_rows(module)
        ):
            router_name = next(n for n, c in module.named_children() if c is router)
        prefixes.add(match["prefix"])
        found.append((match["layer"], match["block"], router_name, layout))
    if len(prefixes) > 1:
        raise ValueError(
            f"presets.moe: found mixture-of-experts blocks under {len(prefixes)} backbones {sorted(prefixes)}; a "
            "preset covers one. Pass the submodule that holds one backbone, or declare clusters by hand."
        )
    return (prefixes.pop(), found) if found else None


def _layer_params(layout: Layout) -> re.Pattern[str]:
    """Every parameter a layer of the model may hold for :func:`moe` (MLA, a dense MLP, shared experts included)."""
    return re.compile(rf"(?:{layout.layer_params}|{_MLA}|{_DENSE}|{_LINEAR_ATTENTION})")


def covers(model: nn.Module) -> bool:
    """Whether :func:`moe` covers every decoder layer of ``model`` (``clusters="auto"`` picks it then).

    Some layer must hold a fused-experts block with its router (the same block name and layout in each), the others
    a dense Llama MLP (DeepSeek's first layers), and no layer anything the preset does not know (then discovery
    runs instead).
    """
    try:
        found = find_blocks(model)
    except ValueError:
        return False
    if found is None:
        return False
    prefix, blocks = found
    if len({(b, r, lay) for _, b, r, lay in blocks}) != 1:
        return False
    _, block, router, fused = blocks[0]
    if not router:  # no router the preset can cut with its experts: discovery, with the experts' channels
        return False
    names = param_names(model)
    shared = any(re.search(rf"{block}\.shared_expert\.down_proj\.weight$", n) for n in names)
    known = _layer_params(moe_layout(block, router, shared=shared, fused=fused))
    layer = re.compile(rf"{re.escape(prefix)}layers\.(?P<layer>\d+)\.{_WRAPPERS}(?P<rest>.+)")
    moe_layers = {layer for layer, *_ in blocks}
    dense: set[str] = set()
    seen: set[str] = set()
    for n in names:
        match = layer.fullmatch(n)
        if match is None:
            continue
        seen.add(match["layer"])
        if not known.fullmatch(match["rest"]):
            return False
        if re.fullmatch(r"mlp\.down_proj\.weight", match["rest"]):
            dense.add(match["layer"])
    return seen == moe_layers | dense and not moe_layers & dense


def _own_width_shared_experts(model: nn.Module, prefix: str, blocks: list[tuple[str, str, str, FusedLayout]]) -> bool:
    """Whether the blocks' ``shared_experts`` MLPs have a width of their own, not a multiple of the experts' width.

    DeepSeek's shared experts are ``n_shared_experts`` experts wide (their channels join the experts' units); a
    shared MLP whose width is no multiple of the experts' (MiniMax-M3's ``shared_intermediate_size``), or whose width
    the config holds in a field of its own (Nemotron-H's ``moe_shared_expert_intermediate_size``, Ergo's
    ``shared_intermediate_size``: :data:`~lightning_pat.shrink.experts.SHARED_WIDTH_FIELDS`), is a cluster of its own.
    """
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    fields = {v for f in SHARED_WIDTH_FIELDS if isinstance(v := getattr(config, f, None), int)}
    for layer, block, _, fused in blocks:
        module = model.get_submodule(f"{prefix}layers.{layer}.{block}")
        shared = getattr(module, "shared_experts", None) or getattr(module, "shared_mlp", None)
        down = getattr(shared, "down_proj", None)
        experts = getattr(module, "experts", None)
        if not isinstance(down, nn.Linear) or not isinstance(experts, nn.Module):
            continue
        width = cast(Tensor, experts.down_proj).shape[fused.down_channels]
        if down.in_features % width or down.in_features in fields:
            return True
    return False


def _fused_shared_experts(model: nn.Module, prefix: str, blocks: list[tuple[str, str, str, FusedLayout]]) -> bool:
    """Whether the blocks' ``shared_experts`` are 3-D shared experts of the routed experts' width (Inkling's).

    Their config builds both widths from one field (``moe_intermediate_size``), so their channels join the experts'
    (:func:`~lightning_pat.shrink.experts.fused_shared`).
    """
    found = False
    for layer, block, _, fused in blocks:
        module = model.get_submodule(f"{prefix}layers.{layer}.{block}")
        shared = getattr(module, "shared_experts", None)
        counts = fused_shared(shared) if isinstance(shared, nn.Module) else None
        if counts is None:
            continue
        width = cast(Tensor, cast(nn.Module, module.experts).down_proj).shape[fused.down_channels]
        if counts[1] != width:
            return False
        found = True
    return found


def _mla_heads(model: nn.Module, names: list[str], prefix: str) -> int | None:
    """The head count of the model's MLA layers, if each holds DeepSeek's projections and head sizes, else ``None``.

    A head ``h`` is exactly removable: its query rows (``q_b_proj``, or ``q_proj`` without a query LoRA), its rows of
    ``kv_b_proj`` (its k without position and its v) and its ``o_proj`` columns; the latents and the shared rotary
    key stay. The shrink then writes ``num_attention_heads`` and ``num_key_value_heads`` (one KV head per head).
    """
    attns = [
        m for n, m in model.named_modules() if re.fullmatch(rf"{re.escape(prefix)}layers\.\d+\.{_WRAPPERS}self_attn", n)
    ]
    counts: set[int] = set()
    for attn in attns:
        heads = getattr(attn, "num_heads", None)
        nope, rope, v = (getattr(attn, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        kv_b, o = getattr(attn, "kv_b_proj", None), getattr(attn, "o_proj", None)
        q = getattr(attn, "q_b_proj", None) or getattr(attn, "q_proj", None)
        if not (
            isinstance(heads, int)
            and isinstance(nope, int)
            and isinstance(rope, int)
            and isinstance(v, int)
            and isinstance(kv_b, nn.Linear)
            and isinstance(o, nn.Linear)
            and isinstance(q, nn.Linear)
        ):
            return None
        if (q.out_features, kv_b.out_features, o.in_features) != (heads * (nope + rope), heads * (nope + v), heads * v):
            return None
        counts.add(heads)
    return counts.pop() if len(counts) == 1 else None


def _mla(model: nn.Module, names: list[str]) -> bool:
    """Whether the layers' attention is DeepSeek's multi-head latent attention (a ``kv_b_proj``, no ``k_proj``)."""
    return any(n.endswith("self_attn.kv_b_proj.weight") for n in names) and not any(
        n.endswith("self_attn.k_proj.weight") for n in names
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
        mlp: Add ``mlp.{layer}``: the intermediate channels shared by the layer's experts (with the channels of a
            ``shared_experts`` MLP as wide as the experts, DeepSeek's; in a dense layer, its MLP's channels), and
            ``shared.{layer}``: a shared expert of its own width, where the model has one.
        heads: Add ``heads.{layer}`` (as :func:`~lightning_pat.presets.transformers.llama`).
        residual: Add ``residual`` (the hidden size across the model, the experts' and router's hidden axes
            included).
        layers: Add ``layer.{layer}`` (whole decoder layers); not with ``residual``.
        query_heads: As for :func:`~lightning_pat.presets.transformers.llama`.
        experts: Add ``experts.{layer}``: whole routed experts with their router rows (a group-limited router's
            groups, DeepSeek's ``n_group``, each keep the same number: ``unit_groups``).

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
    found = find_blocks(model)
    if found is None and (stacked := stacked_units(model, mlp=mlp, experts=experts)):
        return stacked  # DBRX: experts stacked as 2-D rows; its attention is not declared here
    if found is None and (parallel := parallel_units(model, mlp=mlp, experts=experts)):
        return parallel  # JetMoE: one 3-D weight per projection; its attention experts whole
    if found is None:
        raise ValueError(
            "presets.moe: no decoder layer `<prefix>layers.N` holds a block with fused `experts.gate_up_proj` / "
            "`experts.down_proj` (3-D) next to a top-k router (`gate` or `router`), so this is not a fused "
            "mixture-of-experts model; use presets.llama, or declare clusters by hand."
        )
    prefix, blocks = found
    _, block, router, fused = blocks[0]
    per_layer = rf"re:{re.escape(prefix)}layers\.(?P<layer>\d+)\.{_WRAPPERS}"

    def has(pattern: str) -> bool:
        return any(re.fullmatch(per_layer[3:] + pattern, n) for n in names)

    shared_mlp = has(_SHARED_MLP + r"output_linear\.weight")
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    own_width = _own_width_shared_experts(model, prefix, blocks)
    joint = (
        (has(rf"{block}\.shared_experts\.down_proj\.weight") and not own_width)
        or (  # Llama 4: the experts' width
            has(rf"{block}\.shared_expert\.down_proj\.weight")
            and not has_field(config, "shared_expert_intermediate_size")
        )
        or (  # Hunyuan-MoE: the experts' width times num_shared_expert
            has(rf"{block}\.shared_mlp\.down_proj\.weight")
            and not own_width
            and not has_field(config, "shared_intermediate_size")
        )
    )
    shared = has(rf"{block}\.shared_expert\.down_proj\.weight") and not joint  # Qwen2-MoE: a width of its own
    mla = _mla(model, names)
    mla_heads = _mla_heads(model, names, prefix) if heads and mla else None
    if heads and mla and mla_heads is None:
        _tell(
            model,
            "presets.moe: the heads of %s are not cut: its multi-head latent attention (MLA) does not read its head "
            "count and sizes from the config as DeepSeek-V2/V3 do (num_attention_heads, qk_nope_head_dim, "
            "qk_rope_head_dim, v_head_dim); heads.{layer} left out (its MLPs and experts are cut)",
            type(model).__name__,
        )
    if mla:
        heads = False  # declared below from the latent projections, not from the Llama layout
    if heads and has(_LINEAR_ATTENTION):
        _tell(
            model,
            "presets.moe: the heads of %s are not cut: its linear-attention layers take their head count from the "
            "same config field as the full-attention layers, so a head cut could not reload stock; heads.{layer} "
            "left out",
            type(model).__name__,
        )
        heads = False
    if heads and _whole_width_qk_norm(model):
        _tell(
            model,
            "presets.moe: the heads are not cut: q_norm/k_norm normalise over all heads (OLMoE), so a head "
            "cut (query heads included) could not be exact; heads.{layer} left out",
        )
        heads = False
    if heads and (own := _attention_params(model, names)):
        _tell(
            model,
            "presets.moe: the heads are not cut: the attention holds %s itself (one entry per query head), which "
            "no head cut rewrites; heads.{layer} left out",
            own[0].rsplit(".", 1)[-1],
        )
        heads = False
    if residual and (fused.transposed or mla or joint):
        raise ValueError(
            "presets.moe(residual=True): the preset does not declare the residual axis of "
            f"{'MLA attention' if mla else 'transposed experts' if fused.transposed else 'shared experts'} yet; set "
            "residual=False, or "
            "declare the residual cluster by hand."
        )
    layout = moe_layout(block, router, shared=shared, fused=fused)
    if mla:
        layout = dataclasses.replace(layout, anchor=r"self_attn\.o_proj\.weight")
    out = (
        build(layout, model, mlp=False, heads=heads, residual=residual, layers=layers, query_heads=query_heads)
        if heads or residual or layers
        else []
    )
    if mlp:
        tied = _fused_shared_experts(model, prefix, blocks)
        writers, readers, head_dim = _gate_up(block, fused, joint_shared=joint, fused_shared=tied)
        mlps = [Cluster("mlp.{layer}", [per_layer + w for w in writers], [per_layer + r for r in readers],
                        head_dim=head_dim)]  # fmt: skip
        if has(r"mlp\.down_proj\.weight"):  # dense layers (DeepSeek's first_k_dense_replace)
            mlps.append(Cluster("mlp.{layer}", [per_layer + r"mlp\.(?:gate|up)_proj\.(?:weight|bias)"],
                                [per_layer + r"mlp\.down_proj\.weight"]))  # fmt: skip
        out = mlps + out
    out = [  # the expert weights' strides stay what transformers' grouped_mm experts need
        dataclasses.replace(c, multiple_of=WIDTH_MULTIPLE) if c.name in ("mlp.{layer}", "residual") else c for c in out
    ]
    if mlp and shared:  # the shared expert's channels: an ordinary MLP cluster
        shared_re = rf"{per_layer}{block}\.shared_expert\."
        out.append(
            Cluster("shared.{layer}", [shared_re + r"(?:gate|up)_proj\.weight"], [shared_re + r"down_proj\.weight"])
        )
    if mlp and own_width:  # MiniMax-M3: `shared_experts` of a width of their own (gate and up fused or not)
        shared_re = rf"{per_layer}{block}\.{_SHARED}\."
        gate_up = [shared_re + rf"gate_up_proj\.weight[{i}/2]" for i in range(2)]
        own = (
            gate_up if has(rf"{block}\.{_SHARED}\.gate_up_proj\.weight") else [shared_re + r"(?:gate|up)_proj\.weight"]
        )
        out.append(Cluster("shared.{layer}", own, [shared_re + r"down_proj\.weight"]))
    if mlp and shared_mlp:  # GraniteMoE-shared: a fused gate/up `input_linear`, `output_linear`
        fused_in = [per_layer + _SHARED_MLP + rf"input_linear\.weight[{i}/2]" for i in range(2)]
        out.append(Cluster("shared.{layer}", fused_in, [per_layer + _SHARED_MLP + r"output_linear\.weight"]))
    if mla_heads is not None:  # head h: its q rows, its k and v rows of kv_b_proj, its o_proj columns
        q = r"self_attn\.q_b_proj\.weight" if has(r"self_attn\.q_b_proj\.weight") else r"self_attn\.q_proj\.weight"
        out.append(Cluster("heads.{layer}", [per_layer + q, per_layer + r"self_attn\.kv_b_proj\.weight"],
                           [per_layer + r"self_attn\.o_proj\.weight"], num_units=mla_heads,
                           multiple_of=head_count_multiple(model, mla_heads, _MLA_HEAD_FIELDS)))  # fmt: skip
    if experts and router:
        first = model.get_submodule(f"{prefix}layers.{blocks[0][0]}.{block}")
        weight = router_weight(first.get_submodule(router))
        holder = f"{router}." + (weight[0].rsplit(".", 1)[0] + "." if weight and "." in weight[0] else "")
        routed = cast(Tensor, first.get_submodule("experts").down_proj).shape[0]
        rows = f"[0:{routed}]" if shared_router_rows(first) else ""  # Inkling: its last rows score shared experts
        parts = [re.escape(holder) + "weight" + rows, rf"experts\.{fused.up}", r"experts\.down_proj"]
        for extra in ("bias", "e_score_correction_bias"):  # a per-expert selection bias held as a parameter
            if has(rf"{block}\.{re.escape(holder)}{extra}"):
                parts.append(re.escape(holder) + extra)
        for extra in ("expert_bias", "e_score_correction_bias"):  # the block's own (AFMoE: passed to its router)
            if has(rf"{block}\.{extra}"):
                parts.append(extra)
        if fused.bias:
            parts += [rf"experts\.{fused.up}_bias", r"experts\.down_proj_bias"]
        for norm, _ in expert_norms(first.get_submodule("experts")):  # Ergo's per-expert output norm: its rows
            parts.append(rf"experts\.{re.escape(norm)}\.weight")
        groups = expert_groups(first.get_submodule(router))
        out.append(Cluster("experts.{layer}", [rf"{per_layer}{block}\.{p}" for p in parts], unit_groups=groups))
    if not out:
        raise ValueError("presets.moe: select at least one of `mlp`, `heads`, `residual`, `layers`, `experts`.")
    return out


def stacked_units(model: nn.Module, *, mlp: bool = True, experts: bool = False) -> list[Cluster]:
    """The expert units of experts stacked as 2-D ``w1``/``v1``/``w2`` of ``E * F`` rows (DBRX), per MoE block.

    ``mlp``: ``mlp.{layer}``, each expert's own intermediate channels (row ``e * F + c`` of every weight), every
    expert keeping the same number (``unit_groups=E``; ``ffn_config.ffn_hidden_size`` follows). ``experts``:
    ``experts.{layer}``, whole experts (their ``F`` rows of each weight) with the router's row (``moe_num_experts``
    follows, ``moe_top_k`` at most the experts kept; a dropped expert is routed around,
    :mod:`lightning_pat.core.routing`). Both units lie on the same axis (the rows), and a channel belongs to one
    cluster, so one of the two is declared: the channels where both are asked for (said once). Empty if the model has
    no stacked experts with a router of one row per expert.
    """
    out: list[Cluster] = []
    if mlp and experts and stacked_blocks(model):
        _tell(
            model,
            "presets.moe: %s stacks its experts and their channels on one axis (w1/v1/w2 rows), and a channel belongs "
            "to one cluster: its experts' channels are cut, not whole experts (presets.moe(model, mlp=False) cuts "
            "whole experts instead)",
            type(model).__name__,
        )
        experts = False
    for name, _, holder in stacked_blocks(model):
        found = stacked_experts(model.get_submodule(name))
        if holder is None or found is None:
            continue
        num, width = found
        router = next(f"{n}.weight" for n, m in model.named_modules() if m is holder)
        layer = re.findall(r"\.(\d+)\.", f".{name}.")
        key = layer[-1] if layer else name
        weights = [f"{name}.{w}" for w in ("w1", "v1", "w2")]
        if mlp:
            out.append(Cluster(f"mlp.{key}", weights, num_units=num * width, unit_groups=num))
        if experts and num > 1:
            out.append(Cluster(f"experts.{key}", [router, *weights], num_units=num))
    return out


def parallel_units(model: nn.Module, *, mlp: bool = True, experts: bool = True) -> list[Cluster]:
    """The expert units of blocks of parallel experts (JetMoE: ``input_linear``/``output_linear`` 3-D weights).

    ``mlp``: ``mlp.{layer}``, the intermediate channels every MLP expert shares (the same channel of the gate and up
    halves of ``input_linear``, dim 1, and of ``output_linear``'s columns, dim 2; ``intermediate_size`` follows).
    ``experts``: ``experts.{layer}``, whole MLP experts with their router rows, and ``attn_experts.{layer}``, whole
    attention experts (a mixture of attention heads: expert ``e``'s query and output projections) with theirs: the
    config's one ``num_local_experts`` builds both, so both keep as many (each cluster's own target, the same).
    The attention experts' heads are not cut: every expert's query projection is as wide as the KV projection that
    all experts share (``kv_channels * num_key_value_heads``). Empty if the model has no such blocks.
    """
    out: list[Cluster] = []
    named = {id(m): n for n, m in model.named_modules()}
    for name, block, holder, gated in parallel_blocks(model):
        layer = re.findall(r"\.(\d+)\.", f".{name}.")
        key = layer[-1] if layer else name
        inp, outp = f"{name}.input_linear.weight", f"{name}.output_linear.weight"
        if mlp and gated:
            out.append(Cluster(f"mlp.{key}", [f"{inp}@1[0/2]", f"{inp}@1[1/2]"], [f"{outp}@2"]))
        if experts and cast(Tensor, block.get_submodule("input_linear").weight).shape[0] > 1:
            kind = "experts" if gated else "attn_experts"
            out.append(Cluster(f"{kind}.{key}", [f"{named[id(holder)]}.weight", inp, outp]))
    if out and any(not gated for *_, gated in parallel_blocks(model)):
        _tell(
            model,
            "presets.moe: the heads of %s's attention experts are not cut: each expert's query projection is as "
            "wide as the KV projection all its experts share; whole attention experts are (attn_experts.{layer})",
            type(model).__name__,
        )
    return out
