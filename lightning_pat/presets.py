r"""Ready cluster declarations for common model families.

A preset reads the layout and sizes from the model (parameter names, shapes, the attention module's ``head_dim``
or ``model.config``) and returns plain :class:`~lightning_pat.Cluster` declarations. Per-layer kinds use one
regex declaration with a named ``layer`` group, so they print and serialise short. Names are matched under the
backbone's prefix as found in the module, so a preset also works on a wrapper (a LightningModule holding the model
as ``self.model``): pass the same module to the preset and to ``resolve_clusters`` / the callback.

Kinds (keyword-selectable in every transformer preset):

* ``mlp`` (on): ``mlp.{layer}``, the MLP hidden channels: gate/up rows and biases, down columns (GPT-2: ``c_fc``
  columns and bias, ``c_proj`` rows, as ``Conv1D`` stores weights ``[in, out]``).
* ``heads`` (on): ``heads.{layer}``, one unit per KV head: for MHA a head, for GQA a whole query group (its KV head
  rows in k/v, its ``n_rep`` query heads' rows in q, their o columns, q/k/v biases); HF ``repeat_kv`` and TinyGPT
  map query head ``h`` to KV head ``h // n_rep``, so a group is contiguous. GPT-2: the three chunks of the packed
  ``c_attn`` weight (columns) and bias, and ``attn.c_proj`` rows.
* ``residual`` (off): ``residual``, the hidden size across the whole model: embedding columns (and GPT-2 ``wpe``),
  every q/k/v/gate/up column, every o/down row and bias, every norm weight (and LayerNorm bias), ``lm_head``
  columns; a tied ``lm_head`` is the embedding tensor and counts once. Every parameter of the model must belong to
  the family's layout (else a ``ValueError``), because an unknown writer would keep a pruned channel alive.

Families: ``llama`` (also ``mistral``, ``qwen2``, ``qwen3``: ``*.layers.N.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``norm``, ``embed_tokens``,
``lm_head``; Qwen3's per-head ``q_norm``/``k_norm`` act over ``head_dim`` and belong to no cluster), ``gpt2``
(``*.h.N.attn.c_attn``, ``ln_1``, ``ln_2``, ``mlp.c_fc``, ``wte``, ``wpe``, ``ln_f``) and ``linear_chain`` (see
:func:`linear_chain`). Other packages add families with :func:`register` (the demo registers ``tiny_gpt``, its
:class:`~lightning_pat.demo.model.TinyGPT`, when ``lightning_pat.demo`` is imported).

Limitations:

* A pruned residual channel is exactly zero everywhere, but the norms still divide by the full width ``d``. RMSNorm
  over the ``d'`` kept channels reproduces the zeroed model with weight ``w * sqrt(d / d')`` and eps
  ``eps * d / d'``, so a physical shrink must rescale. LayerNorm (GPT-2) subtracts the mean over all ``d``
  channels, zeros included; no LayerNorm over ``d'`` channels reproduces that, so shrinking a GPT-2 residual is not
  output-preserving (the zeroed model is; fine-tune after the shrink).
* ``linear_chain`` cannot see ``forward``; it assumes an ``nn.Sequential`` runs its children in order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pat.core.layers import LAYER_BUDGET
from lightning_pat.core.spec import WRAPPER_NAMES, Cluster, as_cluster

log = logging.getLogger(__name__)

Preset = Callable[..., list[Cluster]]
#: Whether the Llama-family presets cut GQA attention by query heads inside the KV groups (else whole KV groups).
QUERY_HEADS_DEFAULT = False
OPTIONS: tuple[str, ...] = ("mlp", "heads", "residual", "layers", "query_heads")

_HOW_TO = (
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
    )


_QKV = tuple(rf"attn\.c_attn\.{kind}[{i}/3]" for kind in ("weight", "bias") for i in range(3))
_LAYOUTS: dict[str, Layout] = {
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
    ),
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gpt2": "gpt2"}
_LM_HEAD = re.compile(r"(?:.*\.)?lm_head\.weight")
# module wrappers that may sit between `layers.N.` and the layer's own names (activation checkpointing, FSDP1 and
# per-block torch.compile); anywhere above the layer list they are simply part of the prefix
_WRAPPERS = rf"(?:(?:{'|'.join(WRAPPER_NAMES)})\.)*"


def _wrappers(names: Sequence[str]) -> str:
    """``_WRAPPERS`` if any name holds a wrapper segment, else nothing (so that patterns stay short)."""
    return _WRAPPERS if any(f".{w}." in n for n in names for w in WRAPPER_NAMES) else ""


def _param_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def _find_backbone(layout: Layout, names: Sequence[str]) -> tuple[str, str] | None:
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


def _head_dim(model: nn.Module, module_name: str, preset: str) -> int:
    """``head_dim`` from the attention module, else from ``model.config``."""
    try:
        head_dim = getattr(model.get_submodule(module_name), "head_dim", None)
    except AttributeError:
        head_dim = None
    config = getattr(model, "config", None)
    if not isinstance(head_dim, int):
        head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int):
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        num_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        head_dim = width // num_heads if isinstance(width, int) and isinstance(num_heads, int) else None
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(
            f"presets.{preset}: cannot read `head_dim` from module {module_name!r} or `model.config`; set "
            "heads=False, or declare the heads cluster by hand with `head_dim`."
        )
    return head_dim


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
    names = _param_names(model)
    backbone = _find_backbone(layout, names)
    if backbone is None:
        raise ValueError(
            f"presets.{preset}: no parameter of the model matches `<prefix>{layout.layers}.N.{layout.anchor}`, so "
            f"this is not a {preset} model. {_HOW_TO}"
        )
    prefix, attn_module = backbone
    per_layer = f"re:{re.escape(prefix)}{re.escape(layout.layers)}\\.(?P<layer>\\d+)\\.{_wrappers(names)}"
    out = []
    if mlp:
        writers, readers = layout.mlp
        out.append(Cluster("mlp.{layer}", [per_layer + w for w in writers], [per_layer + r for r in readers]))
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
        out.append(
            Cluster(
                "heads.{layer}",
                [per_layer + w for w in writers],
                [per_layer + r for r in readers],
                head_dim=head_dim,
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
        ValueError: If nothing is selected, the model has no or several Llama-style backbones, ``head_dim`` cannot
            be read, ``residual`` is asked for a model holding parameters outside the layout, ``layers`` with
            ``residual``, or ``query_heads`` for layers with different KV head counts.
    """
    return build(
        _LAYOUTS["llama"], model, mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads
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
    del query_heads  # multi-head attention only
    return build(_LAYOUTS["gpt2"], model, mlp=mlp, heads=heads, residual=residual, layers=layers)


_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.CELU,
    nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink,
    nn.LogSigmoid, nn.Identity, nn.Dropout,
)  # fmt: skip


def _linear_pairs(model: nn.Module) -> list[tuple[str, nn.Linear, str]]:
    """``(writer name, writer, reader name)`` for consecutive Linears in every ``nn.Sequential``."""
    pairs = []
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        prev: tuple[str, nn.Linear] | None = None
        for child_name, child in seq.named_children():
            name = f"{seq_name}.{child_name}" if seq_name else child_name
            if isinstance(child, nn.Linear):
                if prev is not None and prev[1].out_features == child.in_features:
                    pairs.append((prev[0], prev[1], name))
                prev = (name, child)
            elif not isinstance(child, _ELEMENTWISE):
                prev = None
    return pairs


def linear_chain(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = False,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = False,
) -> list[Cluster]:
    """One cluster per hidden axis between consecutive ``nn.Linear`` layers of every ``nn.Sequential``.

    Linear ``i`` and the next Linear ``i+1`` in the same ``nn.Sequential`` are coupled when only elementwise modules
    (activations, ``Dropout``, ``Identity``) sit between them: Linear ``i`` rows and bias are writers, Linear ``i+1``
    columns the reader. Any other module (a norm, a nested container) breaks the chain. This assumes the Sequential
    runs its children in order and nothing else reads Linear ``i``'s output. With an activation where
    ``f(0) != 0`` (sigmoid, softplus) a pruned channel is a constant that the zero reader columns ignore.

    Args:
        model: Any module.
        mlp: Must be true (the hidden axes are the only kind here).
        heads: Must be false: a chain has no attention heads.
        residual: Must be false: a chain has no residual stream.
        layers: Must be false: a chain has no residual layers to skip.
        query_heads: Ignored (a chain has no attention).

    Returns:
        One ``Cluster`` per hidden axis, named ``hidden.<writer module name>``.

    Raises:
        ValueError: If ``mlp`` is false, ``heads``, ``residual`` or ``layers`` is true, or no pair of consecutive
            Linears exists.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [(c.name, c.writers, c.readers) for c in linear_chain(net)]
        [('hidden.0', ['0.weight', '0.bias'], ['2.weight'])]
    """
    if not mlp or heads or residual or layers:
        raise ValueError(
            "presets.linear_chain: only the hidden axes (mlp=True) exist in a chain of nn.Linear; got "
            f"mlp={mlp}, heads={heads}, residual={residual}, layers={layers}. Declare other clusters by hand."
        )
    pairs = _linear_pairs(model)
    if not pairs:
        raise ValueError(f"presets.linear_chain: no two consecutive nn.Linear layers in an nn.Sequential. {_HOW_TO}")
    out = []
    for writer_name, writer, reader_name in pairs:
        writers = [f"{writer_name}.weight"] + ([f"{writer_name}.bias"] if writer.bias is not None else [])
        out.append(Cluster(f"hidden.{writer_name}", writers, [f"{reader_name}.weight"]))
    return out


def detect(model: nn.Module) -> str:
    """The preset name for ``model``: from ``model.config.model_type`` when known, else from parameter names.

    Args:
        model: The model (or a wrapper holding one backbone).

    Returns:
        One of ``"llama"``, ``"gpt2"``, a registered family with a layout (``"tiny_gpt"`` once the demo is
        imported), ``"linear_chain"``.

    Raises:
        ValueError: If no family, or more than one, matches; the message lists the supported families and how to
            declare clusters by hand.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    names = _param_names(model)
    found = [family for family, layout in _LAYOUTS.items() if _find_backbone(layout, names) is not None]
    if len(found) > 1:
        raise ValueError(f"The model matches several families {found}; pass one backbone, or name a preset.")
    if found:
        return found[0]
    if _linear_pairs(model):
        return "linear_chain"
    raise ValueError(f"Cannot detect the model family of {type(model).__name__} (model_type={model_type!r}). {_HOW_TO}")


def for_model(model: nn.Module, **options: bool) -> list[Cluster]:
    """Detect the family of ``model`` (see :func:`detect`) and return its preset's declarations.

    Args:
        model: The model (or a wrapper holding one backbone).
        **options: ``mlp``, ``heads``, ``residual`` for the preset (each preset's defaults apply otherwise).

    Returns:
        The declarations.

    Raises:
        ValueError: If the family cannot be detected, or the preset rejects the options.
    """
    family = detect(model)
    log.info("presets.for_model: %s detected as %r", type(model).__name__, family)
    return PRESETS[family](model, **options)


PRESETS: dict[str, Preset] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "gpt2": gpt2,
    "linear_chain": linear_chain,
}


def register(name: str, preset: Preset, *, layout: Layout | None = None) -> None:
    """Add the preset ``name`` (usable as ``clusters=name`` everywhere); with a ``layout``, :func:`detect` finds it.

    Registering the same preset again is a no-op (a module imported twice, e.g. by a notebook's re-run cell).

    Args:
        name: The preset's name (lower case).
        preset: A callable ``(model, *, mlp, heads, residual, layers) -> list[Cluster]``.
        layout: The family's parameter layout, for detection by ``clusters="auto"``.

    Raises:
        ValueError: If ``name`` is ``"auto"``, not lower case, or already names another preset.
    """
    if name == "auto" or name != name.lower() or PRESETS.get(name, preset) is not preset:
        raise ValueError(
            f"presets.register: cannot register {name!r}: the name must be lower case, not 'auto', and not taken by "
            f"another preset (taken: {sorted(PRESETS)})."
        )
    PRESETS[name] = preset
    if layout is not None:
        _LAYOUTS[name] = layout


def get(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive; ``"auto"`` is :func:`for_model`).

    Args:
        name: A key of :data:`PRESETS`, or ``"auto"``.

    Returns:
        A callable ``(model, **options) -> list[Cluster]``.

    Raises:
        ValueError: If the name is unknown.
    """
    key = name.lower() if isinstance(name, str) else name
    if key == "auto":
        return for_model
    if key not in PRESETS:
        raise ValueError(
            f"Unknown preset {name!r}; expected one of {[*PRESETS, 'auto']}, or a list of Cluster declarations."
        )
    return PRESETS[key]


def check_options(options: Mapping[str, object]) -> None:
    """Raise unless ``options`` maps preset option names (:data:`OPTIONS`) to bools.

    Raises:
        ValueError: If a key is unknown or a value is not a bool.
    """
    bad = {k: v for k, v in dict(options).items() if k not in OPTIONS or not isinstance(v, bool)}
    if bad:
        raise ValueError(f"`preset_options` must map some of {OPTIONS} to bools, got {bad}; e.g. {{'residual': True}}.")


def resolve_preset(
    clusters: str | Cluster | Mapping | Sequence[str | Cluster | Mapping], model: nn.Module, **options: bool
) -> list[Cluster]:
    """Turn a callback's ``clusters`` argument into declarations.

    Args:
        clusters: A preset name or ``"auto"``, a ``Cluster`` or mapping of its fields, or a list mixing them
            (preset names expand in place).
        model: The module the declarations will be resolved against.
        **options: ``mlp``, ``heads``, ``residual`` for the named presets.

    Returns:
        The declarations, in order.

    Raises:
        ValueError: If a preset name is unknown or rejects the model, an option is unknown or not a bool, or options
            are given without any preset name.
        TypeError: If an entry is neither a name, a ``Cluster`` nor a mapping.
    """
    check_options(options)
    return expand(clusters, model, options)


def expand(
    clusters: str | Cluster | Mapping | Sequence[str | Cluster | Mapping], model: nn.Module, options: Mapping[str, bool]
) -> list[Cluster]:
    """:func:`resolve_preset` with ``options`` taken as checked (by :func:`check_options`, once, by the caller).

    :class:`~lightning_pat.pruning.options.PruningOptions` checks its ``preset_options`` when it is built; the
    callback's declarations are expanded here, without a second check.

    Raises:
        ValueError: If a preset name is unknown or rejects the model, or options are given without any preset name.
        TypeError: If an entry is neither a name, a ``Cluster`` nor a mapping.
    """
    entries = [clusters] if isinstance(clusters, (str, Cluster, Mapping)) else list(clusters)
    if options and not any(isinstance(e, str) for e in entries):
        raise ValueError(f"`preset_options` {dict(options)} apply to preset names only; none was given.")
    out: list[Cluster] = []
    for entry in entries:
        out.extend(get(entry)(model, **options) if isinstance(entry, str) else [as_cluster(entry)])
    return out
