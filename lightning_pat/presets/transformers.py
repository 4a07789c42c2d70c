"""The transformer layout model: one :class:`Layout` of parameter-name regexes per family, and its declarations.

:func:`build` turns a layout into the declarations of the kinds asked for (``mlp``, ``heads``, ``residual``,
``layers``, ``query_heads``); :func:`llama` and :func:`gpt2` are the built-in families, :func:`llama_like` builds the
layout of another Llama-style family (the demo's ``tiny_gpt``). The kinds and the limitations are described in
:mod:`lightning_pat.presets`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pat.core.checks import check_bool
from lightning_pat.core.layers import LAYER_BUDGET
from lightning_pat.core.spec import WRAPPER_NAMES, Cluster
from lightning_pat.shrink.layer_config import config_value

log = logging.getLogger(__name__)


#: Whether the Llama-family presets cut GQA attention by query heads inside the KV groups (else whole KV groups).
QUERY_HEADS_DEFAULT = False
#: The end of a message that rejects a model: the supported families and how to declare clusters by hand.
HOW_TO = (
    "Supported families: llama/mistral/qwen2 (`<prefix>layers.N.self_attn.q_proj.weight`), gpt2 "
    "(`<prefix>h.N.attn.c_attn.weight`), linear_chain (consecutive nn.Linear layers in an nn.Sequential) and "
    "those registered with lightning_pat.presets.register (tiny_gpt, by lightning_pat.demo). For other models "
    "declare clusters by hand, e.g. "
    "Cluster(name='mlp.{layer}', writers=['re:blocks\\.(?P<layer>\\d+)\\.fc1\\.(?:weight|bias)'], "
    "readers=['re:blocks\\.(?P<layer>\\d+)\\.fc2\\.weight'])."
)


@dataclass(frozen=True)
class Layout:
    """Parameter-name regexes of one family, relative to the backbone prefix (per layer: after ``layers.N.``).

    Build one for a Llama-like family with :func:`llama_like`, its clusters with :func:`build`.
    """

    family: str
    layers: str  # module path of the layer list: "layers", "h"
    anchor: str  # a per-layer parameter that identifies the family
    mlp: tuple[tuple[str, ...], tuple[str, ...]]  # (writers, readers) per layer
    heads: tuple[tuple[str, ...], tuple[str, ...]]
    residual: tuple[tuple[str, ...], tuple[str, ...]]  # per layer
    top: tuple[tuple[str, ...], tuple[str, ...]]  # residual members outside the layers (lm_head is found anywhere)
    layer_params: str  # every parameter a layer may hold
    layer_out: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # (writers, readers): zero => the layer is identity
    # GQA query heads inside their KV groups: (writers, readers, the KV projection's weight); None: no such units
    query_heads: tuple[tuple[str, ...], tuple[str, ...], str] | None = None
    # what the projections are: "linear" (nn.Linear, [out, in]) or "conv1d" (transformers' Conv1D, [in, out])
    projection: str = "linear"
    # per-layer modules that every layer must hold (the attention's query and the MLP's output projections)
    required: tuple[str, ...] = ()
    # norms inside a layer's submodules (besides the layer's own, over the residual): per-head q/k norms
    inner_norms: str = "(?!)"
    # parameters the attention module holds itself, one entry per query head (gpt-oss's `sinks`): cut with the heads
    head_params: str = "(?!)"


def llama_like(family: str, *, attn: str, norms: str, embed: str) -> Layout:
    """The layout of a Llama-style family whose names differ only in the attention, norm and embedding modules.

    Args:
        family: The family's name (in messages).
        attn: The regex of the attention module's name in a layer (``"self_attn"``).
        norms: The regex of the layer's norm names (``"(?:input_layernorm|post_attention_layernorm)"``).
        embed: The embedding module's name (``"embed_tokens"``).
    """
    return Layout(
        family=family,
        layers="layers",
        anchor=rf"{attn}\.q_proj\.weight",
        mlp=((r"mlp\.(?:gate|up)_proj\.(?:weight|bias)",), (r"mlp\.down_proj\.weight",)),
        heads=((rf"{attn}\.[qkv]_proj\.(?:weight|bias)",), (rf"{attn}\.o_proj\.weight",)),
        residual=(
            (rf"{norms}\.weight", rf"{attn}\.o_proj\.(?:weight|bias)", r"mlp\.down_proj\.(?:weight|bias)"),
            (rf"{attn}\.[qkv]_proj\.weight", r"mlp\.(?:gate|up)_proj\.weight"),
        ),
        top=((r"norm\.weight",), (rf"{embed}\.weight",)),
        # Qwen3's per-head q_norm/k_norm act over head_dim, on no unit axis: known, but in no cluster
        layer_params=rf"(?:{attn}\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(?:weight|bias)|{norms}\.weight"
        rf"|{attn}\.[qk]_norm\.weight",
        layer_out=((rf"{attn}\.o_proj\.(?:weight|bias)", r"mlp\.down_proj\.(?:weight|bias)"), ()),
        query_heads=((rf"{attn}\.q_proj\.(?:weight|bias)",), (rf"{attn}\.o_proj\.weight",), rf"{attn}\.k_proj\.weight"),
        required=(*(rf"{attn}\.{p}_proj" for p in "qkvo"), r"mlp\.down_proj", r"mlp\.(?:gate|up)_proj"),
        inner_norms=rf"{attn}\.[qk]_norm",
    )


_QKV = tuple(rf"attn\.c_attn\.{kind}[{i}/3]" for kind in ("weight", "bias") for i in range(3))
#: The built-in families' layouts (the registry adds those registered with one).
LAYOUTS: dict[str, Layout] = {
    "llama": llama_like(
        "llama", attn="self_attn", norms="(?:input_layernorm|post_attention_layernorm)", embed="embed_tokens"
    ),
    "gpt2": Layout(
        family="gpt2",
        layers="h",
        anchor=r"attn\.c_attn\.weight",
        mlp=((r"mlp\.c_fc\.bias", r"mlp\.c_proj\.weight"), (r"mlp\.c_fc\.weight",)),
        heads=((*_QKV[3:], r"attn\.c_proj\.weight"), _QKV[:3]),  # Conv1D: c_attn columns are the head axis
        residual=(
            (r"ln_[12]\.(?:weight|bias)", r"(?:attn\.c_attn|mlp\.c_fc)\.weight", r"(?:attn|mlp)\.c_proj\.bias"),
            (r"(?:attn|mlp)\.c_proj\.weight",),
        ),
        top=((r"ln_f\.(?:weight|bias)",), (r"wte\.weight", r"wpe\.weight")),
        layer_params=r"(?:ln_[12]|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(?:weight|bias)",
        layer_out=((r"(?:attn|mlp)\.c_proj\.bias",), (r"(?:attn|mlp)\.c_proj\.weight",)),  # Conv1D: [in, out]
        projection="conv1d",
        required=(r"attn\.c_attn", r"attn\.c_proj", r"mlp\.c_fc", r"mlp\.c_proj"),
    ),
}


_LM_HEAD = re.compile(r"(?:.*\.)?lm_head\.weight")
# module wrappers that may sit between `layers.N.` and the layer's own names (activation checkpointing, FSDP1 and
# per-block torch.compile); anywhere above the layer list they are simply part of the prefix
_WRAPPERS = rf"(?:(?:{'|'.join(WRAPPER_NAMES)})\.)*"


def _wrappers(names: Sequence[str]) -> str:
    """``_WRAPPERS`` if any name holds a wrapper segment, else nothing (so that patterns stay short)."""
    return _WRAPPERS if any(f".{w}." in n for n in names for w in WRAPPER_NAMES) else ""


def param_names(model: nn.Module) -> list[str]:
    """Every parameter name of ``model``, a tied tensor under each of its names (what a preset must cover)."""
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def find_backbone(layout: Layout, names: Sequence[str]) -> tuple[str, str] | None:
    """The backbone prefix of ``layout`` in ``names`` and the attention module of its first layer, or ``None``."""
    layer = rf"{re.escape(layout.layers)}\.(?P<layer>\d+)\.{_WRAPPERS}"
    regex = re.compile(rf"(?P<prefix>(?:.+\.)?){layer}{layout.anchor}")
    found: dict[str, tuple[int, str]] = {}
    for name in names:
        match = regex.fullmatch(name)
        if match is not None:
            key = (int(match["layer"]), name.rsplit(".", 2)[0])  # anchors are `<attn module>.<proj>.weight`
            found[match["prefix"]] = min(found.get(match["prefix"], key), key)
    if len(found) > 1:
        raise ValueError(
            f"Found {len(found)} {layout.family} backbones, under prefixes {sorted(found)}; a preset covers one. "
            "Pass the submodule that holds one backbone, or declare clusters by hand."
        )
    return next(((prefix, attn) for prefix, (_, attn) in found.items()), None)


def _is_projection(module: nn.Module, kind: str) -> bool:
    if kind == "conv1d":
        return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
    return isinstance(module, nn.Linear)


def uncovered(layout: Layout, model: nn.Module, prefix: str) -> str | None:
    """Why ``layout`` does not describe every decoder layer of ``model`` under ``prefix``, or ``None`` if it does.

    The layout covers a layer when the layer holds each of ``layout.required`` as a projection of the layout's kind
    (``nn.Linear``, or transformers' ``Conv1D``), each parameter-holding module of the layer is one of the layout's
    projections (of that kind) or a normalisation (a module whose class name holds ``Norm``) of the layer itself
    (over the residual) or of ``layout.inner_norms`` (per-head q/k norms), and nothing else holds a parameter (a
    fused ``gate_up_proj``, Phi's ``dense``/``fc1``, routed experts, a differential attention's ``lambda_q1``,
    BitNet's norm over the heads: then the names only look like the family's).
    """
    layer_list = f"{prefix}{layout.layers}"
    try:
        layers = model.get_submodule(layer_list) if layer_list else model
    except AttributeError:
        return f"no module {layer_list!r}"
    known = re.compile(rf"{_WRAPPERS}(?:{layout.layer_params})")
    required = [re.compile(rf"{_WRAPPERS}{r}") for r in layout.required]
    norm = re.compile(rf"{_WRAPPERS}(?:[^.]+|{layout.inner_norms})")  # the layer's own norms, or the inner ones
    for index, layer in layers.named_children():
        found: set[int] = set()
        for name, module in layer.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if not own:
                continue
            where = f"{layer_list}.{index}.{name}"
            if _is_projection(module, layout.projection) and all(known.fullmatch(f"{name}.{n}") for n in own):
                found.update(i for i, r in enumerate(required) if r.fullmatch(name))
            elif "Norm" not in type(module).__name__ or not norm.fullmatch(name):
                return f"{where} ({type(module).__name__}: {', '.join(own)}) is not part of the {layout.family} layout"
        missing = [layout.required[i] for i in range(len(required)) if i not in found]
        if missing:
            return f"layer {layer_list}.{index} has no {layout.projection} projection matching {missing}"
    return None


def _head_dim(model: nn.Module, module_name: str, preset: str) -> int:
    """``head_dim`` from the attention module, else from ``model.config``."""
    try:
        head_dim = getattr(model.get_submodule(module_name), "head_dim", None)
    except AttributeError:
        head_dim = None
    config = getattr(model, "config", None)
    if not isinstance(head_dim, int):
        head_dim = config_value(config, "head_dim")
    if not isinstance(head_dim, int):
        width = config_value(config, "hidden_size") or config_value(config, "n_embd")
        num_heads = config_value(config, "num_attention_heads") or config_value(config, "n_head")
        head_dim = width // num_heads if isinstance(width, int) and isinstance(num_heads, int) else None
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(
            f"presets.{preset}: cannot read `head_dim` from module {module_name!r} or `model.config`; set "
            "heads=False, or declare the heads cluster by hand with `head_dim`."
        )
    return head_dim


def _shared_qk_norm(model: nn.Module, module_name: str) -> str | None:
    """Why a ``q_norm``/``k_norm`` of the attention blocks a head cut (it normalises over all heads), or ``None``.

    A per-head norm (Qwen3, Gemma 3: a ``head_dim`` weight) acts on no unit axis; OLMo 2's normalises the whole
    projection, so a head cut would change every kept head's values, and Cohere's holds one row per head.
    """
    try:
        attn = model.get_submodule(module_name)
    except AttributeError:
        return None
    head_dim = getattr(attn, "head_dim", None)
    for name in ("q_norm", "k_norm"):
        weight = getattr(getattr(attn, name, None), "weight", None)
        if weight is not None and (weight.dim() != 1 or weight.shape[0] != head_dim):
            return (
                f"{module_name}.{name} normalises {list(weight.shape)} channels, not one head ({head_dim}), so a head "
                "cut could not be exact"
            )
    return None


def _residual(layout: Layout, names: Sequence[str], prefix: str, preset: str) -> Cluster:
    p, layers = re.escape(prefix), re.escape(layout.layers)
    top_params = "|".join(layout.top[0] + layout.top[1])
    known = re.compile(rf"{p}(?:{layers}\.\d+\.{_wrappers(names)}(?:{layout.layer_params})|{top_params})")
    unknown = [n for n in names if not known.fullmatch(n) and not _LM_HEAD.fullmatch(n)]
    if unknown:
        raise ValueError(
            f"presets.{preset}(residual=True): parameters {unknown[:5]} are not part of the {layout.family} layout, "
            "so the preset cannot tell how they read or write the residual stream. Set residual=False, or declare "
            "the residual cluster by hand (Cluster(name='residual', writers=[...], readers=[...]))."
        )

    def top(patterns: tuple[str, ...]) -> list[str]:
        return [n for n in names if any(re.fullmatch(p + pattern, n) for pattern in patterns)]

    per_layer = f"re:{p}{layers}\\.\\d+\\.{_wrappers(names)}"
    writers = [per_layer + w for w in layout.residual[0]] + top(layout.top[0])
    readers = top(layout.top[1]) + [per_layer + r for r in layout.residual[1]]
    return Cluster(name="residual", writers=writers, readers=readers + [n for n in names if _LM_HEAD.fullmatch(n)])


def _kv_heads(layout: Layout, model: nn.Module, prefix: str, head_dim: int, preset: str) -> tuple[int, int] | None:
    """``(query heads, KV heads)`` of the first layer if every layer is GQA with the same KV head count, else None.

    Raises:
        ValueError: If the layers' KV head counts differ (one declaration has one ``unit_groups``).
    """
    assert layout.query_heads is not None
    writer = re.compile(rf"{re.escape(prefix)}{re.escape(layout.layers)}\.\d+\.{_WRAPPERS}{layout.anchor}")
    kv = re.compile(rf"{re.escape(prefix)}{re.escape(layout.layers)}\.\d+\.{_WRAPPERS}{layout.query_heads[2]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    num_q = [p.shape[0] // head_dim for n, p in params.items() if writer.fullmatch(n)]
    num_kv = [p.shape[0] // head_dim for n, p in params.items() if kv.fullmatch(n)]
    if not num_kv or all(q == k for q, k in zip(num_q, num_kv, strict=False)):
        return None  # multi-head attention: a head is already one query head (with its own k/v head)
    if len(set(num_kv)) > 1:
        raise ValueError(
            f"presets.{preset}(query_heads=True): the layers have different KV head counts {sorted(set(num_kv))}, "
            "but query-head units keep the same number in every KV group of one declaration; set "
            "query_heads=False (whole KV groups), or declare one heads cluster per layer with its `unit_groups`."
        )
    return num_q[0], num_kv[0]


def _per_head_units(layout: Layout, model: nn.Module, prefix: str, head_dim: int, query_heads: bool) -> int | None:
    """The heads cluster's unit count when the layers hold ``layout.head_params`` (one entry per query head), or None.

    A unit is a query head (``query_heads``) or a KV head with its query group; a per-head entry is a block of
    ``1`` or ``n_rep`` entries then, so the cluster counts its units explicitly (``head_dim`` blocks would not fit).
    """
    layer = rf"{re.escape(prefix)}{re.escape(layout.layers)}\.\d+\.{_WRAPPERS}"
    own = re.compile(rf"{layer}(?:{layout.head_params})")
    kv = re.compile(rf"{layer}{layout.query_heads[2]}") if layout.query_heads else None
    params = dict(model.named_parameters(remove_duplicate=False))
    per_head = [p.shape[0] for n, p in params.items() if own.fullmatch(n)]
    if not per_head:
        return None
    if query_heads or kv is None:
        return per_head[0]
    return next(p.shape[0] // head_dim for n, p in params.items() if kv.fullmatch(n))


def check_flags(preset: str, **flags: object) -> None:
    """Raise unless every option of preset ``preset`` is a bool (``query_heads="no"`` would be truthy).

    Raises:
        ValueError: If an option is not ``True`` or ``False``, naming the preset and the option.
    """
    for name, value in flags.items():
        try:
            check_bool(name, value)
        except ValueError as err:
            raise ValueError(f"presets.{preset}: {err}") from None


def build(
    layout: Layout,
    model: nn.Module,
    *,
    mlp: bool,
    heads: bool,
    residual: bool,
    layers: bool = False,
    query_heads: bool = False,
) -> list[Cluster]:
    """The declarations of the kinds selected for ``model``, a model of ``layout``'s family (see :func:`llama`).

    With ``query_heads`` and a GQA model (and a layout that has query-head patterns), ``heads.{layer}`` has one unit
    per query head (``q_proj`` rows and bias, ``o_proj`` columns; ``k/v_proj`` in no cluster) in ``unit_groups`` =
    the KV head count, so every KV group keeps the same number of query heads (the model stays a stock one).

    Raises:
        ValueError: As for :func:`llama`.
    """
    preset = layout.family
    check_flags(preset, mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads)
    if not (mlp or heads or residual or layers):
        raise ValueError(
            f"presets.{preset}: select at least one of `mlp`, `heads`, `residual`, `layers` (all are False)."
        )
    if layers and residual:
        raise ValueError(
            f"presets.{preset}: `layers=True` with `residual=True` is not supported yet: a layer unit zeroes the "
            "layer's output projections, which the residual cluster also prunes along the same axis. Choose one "
            "of them (widths: mlp/heads combine with layers)."
        )
    names = param_names(model)
    backbone = find_backbone(layout, names)
    if backbone is None:
        raise ValueError(
            f"presets.{preset}: no parameter of the model matches `<prefix>{layout.layers}.N.{layout.anchor}`, so "
            f"this is not a {preset} model. {HOW_TO}"
        )
    prefix, attn_module = backbone
    per_layer = f"re:{re.escape(prefix)}{re.escape(layout.layers)}\\.(?P<layer>\\d+)\\.{_wrappers(names)}"
    out = []
    if mlp:
        writers, readers = layout.mlp
        out.append(Cluster("mlp.{layer}", [per_layer + w for w in writers], [per_layer + r for r in readers]))
    if heads and (why := _shared_qk_norm(model, attn_module)) is not None:
        log.warning("presets.%s: the heads are not cut: %s; heads.{layer} left out", preset, why)
        heads = False
    if heads:
        head_dim = _head_dim(model, attn_module, preset)
        writers, readers = layout.heads
        gqa = _kv_heads(layout, model, prefix, head_dim, preset) if query_heads and layout.query_heads else None
        if gqa is not None:
            (writers, readers, _), groups = layout.query_heads, gqa[1]  # type: ignore[misc]
            log.info("presets.%s: heads.{layer} are query heads, %d per KV group of %d", preset, gqa[0] // groups,
                     groups)  # fmt: skip
        else:
            groups = 1
        units = _per_head_units(layout, model, prefix, head_dim, gqa is not None)
        if units is not None:  # entries per query head (sinks): explicit unit counts instead of head_dim blocks
            writers = (*writers, layout.head_params)
        out.append(
            Cluster(
                "heads.{layer}",
                [per_layer + w for w in writers],
                [per_layer + r for r in readers],
                head_dim=head_dim if units is None else None,
                num_units=units,
                unit_groups=groups,
            )
        )
    if residual:
        out.append(_residual(layout, names, prefix, preset))
    if layers:
        out.append(layer_units(per_layer, layout.layer_out))
    return out


def layer_units(per_layer: str, out: tuple[tuple[str, ...], tuple[str, ...]]) -> Cluster:
    r"""The layer units: one 1-unit cluster per layer over its output projections, in the ``layers`` budget.

    In a pre-norm transformer a layer whose output projections (and their biases) are zero adds nothing to the
    residual stream: it is the identity, so dropping the unit removes the layer exactly. The ``layers`` budget ranks
    the layers jointly (lowest score first: during training ``1 - cos(input, output)`` of the layer, as in ShortGPT,
    see :mod:`lightning_pat.scoring.layers`; one-shot, the RMS of the output projections), and
    :func:`lightning_pat.shrink` deletes the dropped layers and renumbers the rest.

    Args:
        per_layer: The ``re:`` prefix up to and including ``layers.(?P<layer>\d+).``.
        out: (writers, readers) patterns of the output projections, relative to the layer.

    Returns:
        The declaration ``layer.{layer}`` (``num_units=1``, ``budget="layers"``).
    """
    return Cluster(
        "layer.{layer}", [per_layer + w for w in out[0]], [per_layer + r for r in out[1]], num_units=1,
        budget=LAYER_BUDGET,
    )  # fmt: skip


def llama(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = True,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = QUERY_HEADS_DEFAULT,
) -> list[Cluster]:
    """Clusters of a Llama-style decoder (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2/3ForCausalLM``, ...).

    Args:
        model: The model, or a module that holds exactly one such backbone.
        mlp: Add ``mlp.{layer}`` (gate/up rows and biases, down columns).
        heads: Add ``heads.{layer}``: one unit per query head inside the GQA groups (``query_heads``), else per
            KV head (a head, or a whole GQA query group with its KV head).
        residual: Add ``residual`` (the hidden size across the model).
        layers: Add ``layer.{layer}``: whole decoder layers as units (see :func:`layer_units`); not with
            ``residual``.
        query_heads: With GQA, a ``heads`` unit is one query head (its ``q_proj`` rows and bias, its ``o_proj``
            columns; ``k/v_proj`` are kept whole) and every KV group keeps the same number of them (the cluster's
            ``unit_groups`` is the KV head count), so the shrunk model is a stock one with
            ``num_attention_heads = num_key_value_heads * kept_per_group``. ``False``: whole KV groups. Without GQA
            (as many KV heads as query heads) a unit is a head with its k/v rows either way.

    Returns:
        The declarations, in the order mlp, heads, residual, layers.

    Raises:
        ValueError: If an option is not a bool, nothing is selected, the model has no or several Llama-style
            backbones, ``head_dim`` cannot be read, ``residual`` is asked for a model holding parameters outside the
            layout, ``layers`` with ``residual``, or ``query_heads`` for layers with different KV head counts.
    """
    return build(
        LAYOUTS["llama"], model, mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads
    )


def gpt2(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = True,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = QUERY_HEADS_DEFAULT,
) -> list[Cluster]:
    """Clusters of a GPT-2 model (``GPT2LMHeadModel``, ``GPT2Model``): ``Conv1D`` weights are ``[in, out]``.

    Args:
        model: The model, or a module that holds exactly one GPT-2 backbone.
        mlp: Add ``mlp.{layer}`` (``c_fc`` columns and bias, ``mlp.c_proj`` rows).
        heads: Add ``heads.{layer}`` (the q, k and v chunks of ``c_attn`` weight and bias, ``attn.c_proj`` rows).
        residual: Add ``residual`` (``wte``/``wpe`` columns, LayerNorm weights and biases, ``c_attn``/``c_fc`` rows,
            ``c_proj`` columns and biases, ``lm_head`` columns); see the LayerNorm limitation in the module docs.
        layers: Add ``layer.{layer}`` (whole blocks: ``c_proj`` columns and biases; see :func:`layer_units`); not
            with ``residual``.
        query_heads: Accepted for a uniform interface; GPT-2 has no GQA, so a head unit is one query head already.

    Returns:
        The declarations, in the order mlp, heads, residual, layers.

    Raises:
        ValueError: As for :func:`llama`.
    """
    check_flags("gpt2", query_heads=query_heads)
    del query_heads  # multi-head attention only
    return build(LAYOUTS["gpt2"], model, mlp=mlp, heads=heads, residual=residual, layers=layers)
