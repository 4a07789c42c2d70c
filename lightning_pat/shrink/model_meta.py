"""What a module is, for the shrink, and the size metadata it and its model's config carry.

Module kinds (:func:`module_kind`: the rewrite rule of a module that owns a shrunk parameter), attention layouts the
shrink understands (Llama-style ``q/k/v/o_proj`` with ``head_dim``; GPT-2's packed ``c_attn``; a fused q/k/v
``Linear`` with ``head_dim``: Phi-3, Falcon, Bloom, CodeGen, :func:`fused_qkv_heads`), and the updates of
head counts, MLP widths, hidden sizes and ``model.config`` after the parameters were cut (:func:`update_containers`,
:func:`update_config`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from torch import Tensor, nn

from lightning_pat.heads import (
    HeadsMultiheadAttention,
    is_maxvit_attention,
    is_swin_attention,
    is_swin_v2_attention,
    mha_refusal,
)
from lightning_pat.shrink.experts import (
    SHARED_WIDTH_FIELDS,
    STACKED_TOP_K,
    expert_config,
    experts_kind,
    shared_experts,
    stacked_config,
)
from lightning_pat.shrink.layer_config import has_field, is_heterogeneous, layer_values, write_per_layer
from lightning_pat.shrink.mixers import mixer_config, mixer_kind
from lightning_pat.shrink.surgery_conv import conv_kind

log = logging.getLogger("lightning_pat.shrink")


def module_kind(module: nn.Module) -> str | None:
    """The rewrite rule for a module that owns a shrunk parameter, or ``None`` if it has none."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:  # noqa: SLF001 - the common base
        return "batchnorm"
    if isinstance(module, nn.RMSNorm):
        return "rmsnorm"
    name = type(module).__name__
    if name.endswith(("RMSNorm", "RMSNormGated")) and isinstance(getattr(module, "variance_epsilon", None), float):
        return "hf_rmsnorm"
    if isinstance(module, (nn.MultiheadAttention, HeadsMultiheadAttention)):
        return "mha" if mha_refusal(module) is None else None
    if is_swin_attention(module):
        return "window_attention"
    if is_swin_v2_attention(module):
        return "window_attention_v2"
    if is_maxvit_attention(module):
        return "maxvit_attention"
    if has_sinks(module):
        return "sinks_attention"
    if is_scale(module):
        return "scale"
    return conv_kind(module) or experts_kind(module) or mixer_kind(module) or scales_kind(module)


def scales_kind(module: nn.Module) -> str | None:
    """``"scales"`` for a block holding 1-D parameters of its own, else ``None``.

    A block (a module with submodules) whose own parameters are 1-D vectors: per-channel scales it multiplies into its
    activations (Dory's ``suv_gate``, ``sqk``), cut on their one axis.
    """
    own = [p for p in module._parameters.values() if p is not None]  # noqa: SLF001 - its own, not a child's
    return "scales" if own and next(module.children(), None) is not None and all(p.dim() == 1 for p in own) else None


def is_scale(module: nn.Module) -> bool:
    """Whether ``module`` holds one parameter of its own, ``scale``, and its children none (Inkling 2's per-head scale).

    Inkling 2's ``ScaledL2Clip``: a ``(heads, head_dim)`` scale multiplied into the per-head query or relative states;
    discovery makes its dim 0 a member where the product puts it on a channel axis (:attr:`~lightning_pat.discovery.
    trace.Trace.per_head`), so the shrink cuts that dim.
    """
    own = [k for k, p in module._parameters.items() if p is not None]  # noqa: SLF001 - its own parameters
    return own == ["scale"] and not any(True for c in module.children() for _ in c.parameters())


def has_sinks(m: nn.Module) -> bool:
    """Whether ``m`` is a q/k/v attention holding ``sinks`` itself, one logit per query head (gpt-oss)."""
    sinks = m._parameters.get("sinks")  # noqa: SLF001 - its own parameter, not a submodule's
    q_proj = getattr(m, "q_proj", None)
    head_dim = getattr(m, "head_dim", None)
    return (
        is_qkv_attention(m)
        and isinstance(sinks, nn.Parameter)
        and sinks.dim() == 1
        and isinstance(q_proj, nn.Linear)
        and isinstance(head_dim, int)
        and sinks.shape[0] * head_dim == q_proj.out_features
    )


def is_llama_attention(m: nn.Module) -> bool:
    """Whether ``m`` is a Llama-style attention: ``nn.Linear`` ``q/k/v/o_proj`` and an int ``head_dim``."""
    return all(isinstance(getattr(m, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and (
        isinstance(getattr(m, "head_dim", None), int)
    )


def is_qkv_attention(m: nn.Module) -> bool:
    """Whether ``m`` has separate ``nn.Linear`` ``q/k/v_proj`` and an int ``head_dim`` (Llama, Phi, OPT, ...)."""
    return all(isinstance(getattr(m, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj")) and (
        isinstance(getattr(m, "head_dim", None), int)
    )


def query_heads(m: nn.Module) -> int:
    """The query head count of a :func:`is_qkv_attention` module: its ``o_proj`` input over ``head_dim``.

    ``o_proj`` reads exactly the heads' outputs; ``q_proj`` may hold more rows per head (Qwen3.5's and Qwen3-Next's
    gated attention: a query and a gate row block per head), so it is read only where there is no ``o_proj``.
    """
    out = getattr(m, "o_proj", None)
    width = out.in_features if isinstance(out, nn.Linear) else cast(nn.Linear, m.q_proj).out_features
    return width // cast(int, m.head_dim)


def is_gpt2_attention(m: nn.Module) -> bool:
    """Whether ``m`` is a GPT-2 attention: a packed ``Conv1D`` ``c_attn`` and an int ``split_size``."""
    packed = module_kind(getattr(m, "c_attn", nn.Identity())) == "conv1d"
    return packed and isinstance(getattr(m, "split_size", None), int)


#: Names of a fused q/k/v projection and of the output projection of an attention with ``head_dim``.
FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv")
OUT_PROJECTIONS = ("o_proj", "dense", "out_proj")


def fused_qkv_heads(m: nn.Module) -> tuple[int, int] | None:
    """``(query heads, KV heads)`` of an attention with one fused q/k/v ``nn.Linear`` and an int ``head_dim``.

    Phi-3's ``qkv_proj``, Falcon's and Bloom's ``query_key_value``, CodeGen's ``qkv_proj`` (then ``o_proj``,
    ``dense`` or ``out_proj``): the query heads are the output projection's input columns over ``head_dim``, the
    rest of the fused rows are as many keys as values (``(H + 2 * KV) * head_dim`` rows). ``None`` for any other
    module, separate ``q/k/v_proj`` and GPT-2's ``c_attn`` included.
    """
    hd = getattr(m, "head_dim", None)
    if not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0 or is_qkv_attention(m):
        return None
    fused = next((getattr(m, n) for n in FUSED_QKV if isinstance(getattr(m, n, None), nn.Linear)), None)
    out = next((getattr(m, n) for n in OUT_PROJECTIONS if isinstance(getattr(m, n, None), nn.Linear)), None)
    if fused is None or out is None or out.in_features % hd or fused.out_features % hd:
        return None
    n_q = out.in_features // hd
    rest = fused.out_features // hd - n_q
    if n_q < 1 or rest < 2 or rest % 2:
        return None
    return n_q, rest // 2


def nested_qkv_heads(m: nn.Module) -> tuple[int, int] | None:
    """``(query heads, KV heads)`` of an attention whose ``q/k/v_proj`` are modules around an ``nn.Linear`` ``linear``.

    Inkling 2's: each projection is its ``linear`` then a per-head norm or a short convolution; an int ``head_dim``.
    ``None`` for any other module (separate ``nn.Linear`` projections included: :func:`is_qkv_attention`).
    """
    hd = getattr(m, "head_dim", None)
    linears = [getattr(getattr(m, p, None), "linear", None) for p in ("q_proj", "k_proj", "v_proj")]
    if not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0 or is_qkv_attention(m):
        return None
    if not all(isinstance(lin, nn.Linear) for lin in linears):
        return None
    q, k = cast("list[nn.Linear]", linears)[:2]
    return q.out_features // hd, k.out_features // hd


def _set_fused_counts(module: nn.Module, n_q: int, n_kv: int) -> None:
    for attr in ("num_heads", "num_attention_heads", "n_head"):
        _set_if_int(module, attr, n_q)
    for attr in ("num_key_value_heads", "num_kv_heads", "n_kv_head"):
        _set_if_int(module, attr, n_kv)
    if n_q % n_kv == 0:
        _set_if_int(module, "num_key_value_groups", n_q // n_kv)


def _set_if_int(module: nn.Module, attr: str, value: int) -> None:
    if isinstance(getattr(module, attr, None), int) and not isinstance(getattr(module, attr), bool):
        setattr(module, attr, value)


def mla_heads(m: nn.Module) -> int | None:
    """The head count of a multi-head latent attention (DeepSeek-V2/V3), else ``None``.

    Its ``kv_b_proj`` rows are the heads' k and v channels, ``qk_nope_head_dim + v_head_dim`` per head.
    """
    kv_b, nope, v = getattr(m, "kv_b_proj", None), getattr(m, "qk_nope_head_dim", None), getattr(m, "v_head_dim", None)
    if not isinstance(kv_b, nn.Linear) or not isinstance(nope, int) or not isinstance(v, int) or nope + v <= 0:
        return None
    return kv_b.out_features // (nope + v)


def update_containers(model: nn.Module, hidden: tuple[int, int] | None) -> None:
    """Head counts of attention modules, MLP widths and hidden-size attributes of every container module."""
    for module in model.modules():
        if (heads := mla_heads(module)) is not None:
            _set_if_int(module, "num_heads", heads)
        elif is_qkv_attention(module):
            hd = cast(int, module.head_dim)
            n_q = query_heads(module)
            n_kv = cast(nn.Linear, module.k_proj).out_features // hd
            for attr in ("num_heads", "num_attention_heads", "n_head"):
                _set_if_int(module, attr, n_q)
            for attr in ("num_key_value_heads", "num_kv_heads", "n_kv_head"):
                _set_if_int(module, attr, n_kv)
            if n_kv and n_q % n_kv == 0:  # query heads cut inside their KV groups change the heads per group
                for attr in ("num_key_value_groups", "n_rep"):
                    _set_if_int(module, attr, n_q // n_kv)
        elif (fused := fused_qkv_heads(module) or nested_qkv_heads(module)) is not None:
            _set_fused_counts(module, *fused)
        elif is_gpt2_attention(module) and not hasattr(module, "q_attn"):
            gpt2: Any = module  # transformers' GPT2Attention (its Conv1D c_attn is not a type imported here)
            gpt2.split_size = gpt2.c_attn.nf // 3
            if isinstance(getattr(module, "head_dim", None), int):  # GPT-1's attention has none
                _set_if_int(module, "num_heads", gpt2.split_size // gpt2.head_dim)
        down = getattr(module, "down_proj", None)
        up = next((getattr(module, n) for n in ("up_proj", "gate_up_proj") if hasattr(module, n)), None)
        if isinstance(down, nn.Linear) and isinstance(up, nn.Linear):  # a fused gate_up_proj: Phi-3, Zamba 2
            _set_if_int(module, "intermediate_size", down.in_features)
        if hidden is not None and hidden[0] != hidden[1]:
            for attr in ("hidden_size", "embed_dim", "d_model"):
                if getattr(module, attr, None) == hidden[0]:
                    _set_if_int(module, attr, hidden[1])


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding (``get_input_embeddings()``, else its first ``nn.Embedding``), or ``None``."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _uniform(values: Iterable[int | float]) -> int | float | None:
    found = set(values)
    return found.pop() if len(found) == 1 else None


def _has(config: Any, name: str) -> bool:
    """``hasattr``, False where reading the field raises (Gemma 4's per-layer ``head_dim``: no global value)."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return False


def _missing(config: Any, name: str) -> bool:
    """Whether ``config`` has no field ``name`` (reading it raises ``AttributeError``; another error: it has one)."""
    try:
        getattr(config, name)
    except AttributeError:
        return True
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError: a per-layer field
        return False
    return False


def _set_config(config: Any, names: Sequence[str], value: int | float | None, what: str) -> None:
    if value is None:
        if any(_has(config, n) for n in names):
            log.info("shrink: %s differs between layers; `config` keeps its value, the export records per layer", what)
        return
    for n in names:
        if _has(config, n):
            setattr(config, n, value)


def config_owners(model: nn.Module) -> list[nn.Module]:
    """The outermost module holding each distinct ``config`` object.

    For a LightningModule this is its inner HF model or TinyGPT; HF attention modules share their model's config
    object and are skipped.
    """
    owners, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and not isinstance(config, (int, float, str, Mapping)):
            seen.add(id(config))
            owners.append(module)
    return owners


def in_width(module: nn.Module) -> int | None:
    """The input width of an ``nn.Linear`` or a ``Conv1D`` (``nx``), else ``None``."""
    kind = module_kind(module)
    if kind == "linear":
        return int(cast(nn.Linear, module).in_features)
    return int(cast(Tensor, module.weight).shape[0]) if kind == "conv1d" else None


#: Config fields holding the (query) head count and the KV head count.
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_FIELDS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
#: Config fields holding the MLP width (``n_inner``: ``None`` means 4 * hidden).
MLP_WIDTHS = (
    "intermediate_size", "n_inner", "ffn_dim", "d_ff", "dff", "ffn_hidden_size", "inner_hidden_size",
    "first_dense_intermediate_size",  # Ergo's dense first layers (its other layers are mixtures of experts)
    "mlp_only_intermediate_size",  # Kolibri 1.1's dense layers (mlp_only_layers)
)  # fmt: skip
#: Config fields holding the width of a low-rank block, and the name part of that block's readers (Gemma 3n's LAuReL,
#: Zamba 2's LoRA-style adapters of its shared transformer: ``gate_up_proj_adapter_list``, ``linear_q_adapter_list``;
#: Qwen4-exp's hyper-connections, whose input mix is ``sigmoid(up(silu(down(x))))`` through ``hc_lowrank`` channels).
NAMED_WIDTHS = {"laurel_rank": "laurel", "adapter_rank": "adapter", "hc_lowrank": "hyper_connection"}


def _mlp_widths(
    config: Any, reads: Sequence[tuple[str, int, int]], hidden: int | None, mixers: frozenset[str] = frozenset()
) -> None:
    """The MLP width fields of ``config``: the new input width of the readers that read the old width.

    A reader counts when its input width was the field's value before the cut (``n_inner=None``: 4 * hidden), its
    name is not an attention's (``attn``/``attention``), a low-rank block's (:data:`NAMED_WIDTHS`) nor a state-space
    mixer's (``mixers``: their own fields), whatever the family calls it (``down_proj``, ``fc2``, ``fc_out``,
    ``c_proj``, ``dense_4h_to_h``, below a fused ``gate_up_proj``).
    """
    # shared experts and low-rank blocks: their own config fields
    skip = ("attn", "attention", "shared_expert", "shared_mlp", *NAMED_WIDTHS.values())
    mlp = [(old, new) for name, old, new in reads if not any(part in name for part in skip) and name not in mixers]
    shared = [(old, new) for name, old, new in reads if "shared_expert" in name and "attn" not in name]
    _derived_width(config, mlp)
    _width_in_hiddens(config, mlp, hidden)
    _width_by_factor(config, mlp, hidden)
    _set_widths(config, MLP_WIDTHS, mlp, hidden)
    _set_widths(config, SHARED_WIDTH_FIELDS, shared, hidden)  # readers: shared_expert(s) in the name
    for field, part in NAMED_WIDTHS.items():
        _set_widths(config, (field,), [(old, new) for name, old, new in reads if part in name], hidden)


def _set_widths(config: Any, fields: Sequence[str], mlp: Sequence[tuple[int, int]], hidden: int | None) -> None:
    """Each of ``fields`` that ``config`` holds as an int: the one new width of the readers that read its value."""
    for field in (f for f in fields if _has(config, f)):
        value = getattr(config, field)
        if field == "n_inner" and value is None and isinstance(hidden, int):
            value = 4 * hidden
        per_layer = isinstance(value, list) and len(set(value)) == 1  # Gemma 3n: one width per layer, all equal
        count = len(value) if per_layer else 0
        value = value[0] if per_layer else value
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        new = _uniform(n for o, n in mlp if o == value and n != o)
        if new is None:  # a width the family derives as the field over a whole factor (RecurrentGemma: // 2)
            factor = _uniform(value // o for o, n in mlp if n != o and o < value and value % o == 0)
            new = _uniform(n * factor for o, n in mlp if n != o) if isinstance(factor, int) and factor > 1 else None
        if new is None:
            continue
        try:
            setattr(config, field, [new] * count if per_layer else new)
        except Exception as err:  # noqa: BLE001 - a strict config refusing the value: it cannot express the width
            log.info("shrink: %s cannot hold the new MLP width in %r (%s)", type(config).__name__, field, err)


def _derived_width(config: Any, mlp: Sequence[tuple[int, int]]) -> None:
    """A config that derives its MLP width from ``intermediate_size`` under a flag: the flag off, the width itself.

    LFM2 builds ``int(2 * intermediate_size / 3)`` rounded up to ``block_multiple_of`` while its
    ``block_auto_adjust_ff_dim`` (any ``*auto_adjust*`` bool of the config) is set; with the flag off it builds
    ``intermediate_size`` as it is, so the cut width is expressed by turning the flag off. Only when every cut MLP
    reader had the same width before, the config's field is not that width (it is derived), and they share one new
    width.
    """
    flags = [f for f in vars(config) if "auto_adjust" in f and getattr(config, f) is True]
    width = getattr(config, "intermediate_size", None)
    old, new = _uniform(o for o, n in mlp if n != o), _uniform(n for o, n in mlp if n != o)
    if not flags or not isinstance(width, int) or not isinstance(old, int) or old == width or not isinstance(new, int):
        return
    try:
        for flag in flags:
            setattr(config, flag, False)
        config.intermediate_size = new
    except Exception as err:  # noqa: BLE001 - a strict config refusing the value: it cannot express the width
        log.info("shrink: %s cannot hold the new MLP width (%s)", type(config).__name__, err)


def _round_up(x: float, multiple: int) -> int:
    return int(((x + multiple - 1) // multiple) * multiple)


def _width_by_factor(config: Any, mlp: Sequence[tuple[int, int]], hidden: int | None) -> None:
    """An MLP width the config derives as ``hidden * <x>_proj_factor`` rounded up to ``<x>_round_up_to_multiple_of``.

    xLSTM's feed-forward: the factor becomes ``new / hidden`` and the multiple the largest common divisor of the new
    width and the old multiple, where that rebuilds the new width exactly (else the fields stay, and the stock probe
    refuses the cut).
    """
    old, new = _uniform(o for o, n in mlp if n != o), _uniform(n for o, n in mlp if n != o)
    if not isinstance(hidden, int) or not isinstance(old, int) or not isinstance(new, int):
        return
    for field in (f for f in vars(config) if f.endswith("_proj_factor")):
        multiple_field = field.removesuffix("proj_factor") + "round_up_to_multiple_of"
        factor, multiple = getattr(config, field), getattr(config, multiple_field, None)
        if not isinstance(factor, (int, float)) or not isinstance(multiple, int) or multiple < 1:
            continue
        if _round_up(hidden * factor, multiple) != old:
            continue
        new_multiple = math.gcd(new, multiple)
        if _round_up(hidden * (new / hidden), new_multiple) == new:
            setattr(config, field, new / hidden)
            setattr(config, multiple_field, new_multiple)


def _width_in_hiddens(config: Any, mlp: Sequence[tuple[int, int]], hidden: int | None) -> None:
    """An MLP width the config holds in multiples of the hidden size: the new multiple, where it is a whole one.

    GPT-NeoX-Japanese builds ``hidden_size * intermediate_multiple_size`` (an int); a width that is not a multiple of
    the hidden size leaves the field as it was, and the stock probe refuses the cut.
    """
    old, new = _uniform(o for o, n in mlp if n != o), _uniform(n for o, n in mlp if n != o)
    if not isinstance(hidden, int) or not isinstance(old, int) or not isinstance(new, int) or new % hidden:
        return
    for field in (f for f in vars(config) if "multiple_size" in f):
        if getattr(config, field) == old / hidden:
            setattr(config, field, new // hidden)


#: Prefix of the config fields that size the sliding-window layers' attention apart (Inkling's ``swa_head_dim``,
#: ``swa_num_attention_heads``, ``swa_num_key_value_heads``).
SLIDING_PREFIX = "swa_"


def _sliding_heads(config: Any, attns: list[Any], nested: Sequence[nn.Module] = ()) -> list[Any]:
    """Tell the sliding-window attentions' sizes to the config's ``swa_*`` fields; the other attentions, returned.

    A config holding ``swa_num_attention_heads`` (and ``swa_num_key_value_heads``, ``swa_head_dim``) builds its
    sliding-window layers' attention (``is_sliding``) from those and the others from the usual fields; without such
    fields every attention is returned. ``nested``: attentions of :func:`nested_qkv_heads` (Inkling 2's), whose
    sliding ones are told too, and the others where ``attns`` holds none.
    """
    counts = [(a, query_heads(a), a.k_proj.out_features // a.head_dim) for a in attns]
    counts += [(a, *cast("tuple[int, int]", nested_qkv_heads(a))) for a in nested]
    sliding = [c for c in counts if getattr(c[0], "is_sliding", None) is True]
    full = [c for c in counts[len(attns) :] if getattr(c[0], "is_sliding", None) is not True]
    if not sliding or not _has(config, SLIDING_PREFIX + HEAD_FIELDS[0]):
        return attns
    for prefix, group in ((SLIDING_PREFIX, sliding), ("", full if not attns else [])):
        for fields, value, what in (
            (HEAD_FIELDS, _uniform(n_q for _, n_q, _ in group), "the head count"),
            (KV_FIELDS, _uniform(n_kv for _, _, n_kv in group), "the KV head count"),
            (("head_dim",), _uniform(a.head_dim for a, _, _ in group), "head_dim"),
        ):
            if group:
                _set_config(config, [prefix + f for f in fields], value, what)
    return [a for a in attns if getattr(a, "is_sliding", None) is not True]


#: What :func:`_per_layer_heads` writes: a size's key -> the config fields that may hold it.
_PER_LAYER_FIELDS = {"heads": HEAD_FIELDS, "kv": KV_FIELDS, "head_dim": ("head_dim",)}


def _layer_index(name: str, count: int) -> int | None:
    """The decoder layer of a module named ``name``: its first integer name part, if below ``count``."""
    index = next((int(part) for part in name.split(".") if part.isdigit()), None)
    return index if index is not None and index < count else None


def _per_layer_heads(config: Any, found: Sequence[tuple[str, Mapping[str, int]]]) -> bool:
    """Write each layer's attention sizes as the per-layer config of a heterogeneous config; whether it did.

    ``found``: ``(attention module name, {"heads": ..., "kv": ..., "head_dim": ...})``. Only a config that already
    holds per-layer fields (transformers' ``per_layer_config``: its family's layers read their own config) is
    written, and only where each layer holds one such attention; a layer without one keeps its values.
    """
    count = getattr(config, "num_hidden_layers", None)
    if not found or not is_heterogeneous(config) or not isinstance(count, int):
        return False
    by_layer: dict[int, Mapping[str, int]] = {}
    for name, sizes in found:
        index = _layer_index(name, count)
        if index is None or index in by_layer:
            return False
        by_layer[index] = sizes
    values: dict[str, list[Any]] = {}
    for key, fields in _PER_LAYER_FIELDS.items():
        for field in (f for f in fields if has_field(config, f)):
            current = layer_values(config, field) or []
            per_layer = list(current) * count if len(current) == 1 else list(current)
            if len(per_layer) != count or not any(key in s for s in by_layer.values()):
                continue
            for index, sizes in by_layer.items():
                if key in sizes:
                    per_layer[index] = sizes[key]
            values[field] = per_layer
    if not values:
        return False
    try:
        write_per_layer(config, values)
    except Exception as err:  # noqa: BLE001 - a strict config refusing the sizes: the export records them per layer
        log.info("shrink: %s cannot hold the per-layer attention sizes (%s)", type(config).__name__, err)
        return False
    return True


def update_config(
    model: nn.Module,
    rescaled_eps: Mapping[int, float],
    hidden_changed: bool,
    *,
    reads: Sequence[tuple[str, int, int]] = (),
) -> None:
    """Write the new uniform sizes into ``model.config`` (Hugging Face configs and ``TinyGPTConfig``).

    ``reads``: ``(module name, input width before, after)`` of every cut ``nn.Linear``/``Conv1D`` (the MLP width
    fields follow the readers that read the old width, whatever the family calls them).
    """
    config: Any = model.config
    hidden = next((getattr(config, n) for n in ("hidden_size", "n_embd", "d_model") if _has(config, n)), None)
    if reads:
        # a mixer's projections read its inner width, held in fields of its own (mixer_config)
        mixers = frozenset(
            f"{name}.{child}"
            for name, m in model.named_modules()
            if mixer_kind(m) is not None
            for child in ("x_proj", "out_proj")
        )
        inside = frozenset(r[0] for r in reads if any(r[0] == m or r[0].endswith(f".{m}") for m in mixers))
        _mlp_widths(config, reads, hidden if isinstance(hidden, int) else None, inside)
    norm_eps = [rescaled_eps[id(m)] for m in model.modules() if id(m) in rescaled_eps]
    # a multimodal model's encoders hold configs of their own (Phi-4-multimodal's vision and audio): not ours
    ours = [m for m in model.modules() if getattr(m, "config", config) is config]
    attns: list[Any] = [m for m in ours if is_qkv_attention(m)]  # stock attention modules
    gpt2: list[Any] = [
        m
        for m in model.modules()
        if is_gpt2_attention(m) and not hasattr(m, "q_attn") and isinstance(getattr(m, "head_dim", None), int)
    ]
    shared = {id(m) for m in shared_experts(model)}  # their width is the config's shared_expert_intermediate_size
    mlp_widths: list[int] = [
        cast(nn.Linear, m.down_proj).in_features
        for m in model.modules()
        if id(m) not in shared
        and isinstance(getattr(m, "down_proj", None), nn.Linear)
        and isinstance(getattr(m, "up_proj", None), nn.Linear)
    ]
    mlp_widths += [
        cast(Any, m.c_fc).nf for m in model.modules() if module_kind(getattr(m, "c_fc", nn.Identity())) == "conv1d"
    ]
    # cut down_proj readers were matched to the fields above, whose width the family may derive (RecurrentGemma
    # builds intermediate_size // 2): their width is not the field's value then
    read = any(name.endswith("down_proj") and new != old for name, old, new in reads)
    if mlp_widths and not read:
        _set_config(config, ("intermediate_size", "n_inner", "d_ff"), _uniform(mlp_widths), "the MLP width")
    mla_named = [(n, h) for n, m in model.named_modules() if (h := mla_heads(m)) is not None]
    mla = [h for _, h in mla_named]
    if mla and not _per_layer_heads(config, [(n, {"heads": h, "kv": h}) for n, h in mla_named]):
        # as many KV heads as heads: the stock attention repeats each latent KV head num_heads / kv_heads times
        _set_config(config, HEAD_FIELDS, _uniform(mla), "the head count")
        _set_config(config, KV_FIELDS, _uniform(mla), "the KV head count")
    attns = _sliding_heads(config, attns, [m for m in ours if nested_qkv_heads(m) is not None])
    per_layer_qkv = [
        (n, {"heads": query_heads(m), "kv": m.k_proj.out_features // m.head_dim, "head_dim": m.head_dim})
        for n, m in model.named_modules()
        if getattr(m, "config", config) is config and is_qkv_attention(m)
    ]
    if attns and not mla and _per_layer_heads(config, per_layer_qkv):
        attns = []  # written per layer
    if attns and not mla:  # next to MLA layers (Kimi-Linear), q/k/v layers are linear attention of its own fields
        _set_config(
            config,
            HEAD_FIELDS,
            _uniform(query_heads(a) for a in attns),
            "the head count",
        )
        _set_config(
            config,
            KV_FIELDS,
            _uniform(a.k_proj.out_features // a.head_dim for a in attns),
            "the KV head count",
        )
        head_dim = _uniform(a.head_dim for a in attns)
        if head_dim is not None and _missing(config, "head_dim") and _has(config, "model_type"):
            config.head_dim = head_dim  # HF attention reads `getattr(config, "head_dim", hidden // heads)`
        _set_config(config, ("head_dim",), head_dim, "head_dim")
    if gpt2:
        _set_config(config, ("n_head",), _uniform(a.split_size // a.head_dim for a in gpt2), "the head count")
    fused = [(counts, cast(int, m.head_dim)) for m in ours if (counts := fused_qkv_heads(m)) is not None]
    if fused and not attns:  # Phi-3 reads config.num_attention_heads in its forward
        heads_before = next((getattr(config, n) for n in HEAD_FIELDS if hasattr(config, n)), None)
        heads = _uniform(c[0] for c, _ in fused)
        _set_config(config, HEAD_FIELDS, heads, "the head count")
        _set_config(config, KV_FIELDS, _uniform(c[1] for c, _ in fused), "the KV head count")
        head_dim = _uniform(hd for _, hd in fused)
        settable = not isinstance(getattr(type(config), "head_dim", None), property)  # Falcon: hidden // heads
        if heads != heads_before and head_dim is not None and settable and hasattr(config, "model_type"):
            config.head_dim = head_dim  # HF attention reads `getattr(config, "head_dim", hidden // heads)`
    emb = input_embedding(model)
    if emb is not None and hidden_changed:
        _set_config(config, ("hidden_size", "n_embd", "d_model"), emb.embedding_dim, "the hidden size")
    if norm_eps:
        _set_config(config, ("rms_norm_eps",), _uniform(norm_eps), "the RMSNorm eps")
    for attr, value in expert_config(model).items():
        _set_config(config, (attr,), value, attr)
    if stacked := stacked_config(model):  # DBRX: its experts' sizes live in a sub-config (`ffn_config`)
        at_most = cast(int, stacked.pop("top_k_at_most"))
        subs = [config, *(v for v in vars(config).values() if hasattr(v, "to_dict") and not isinstance(v, Mapping))]
        for sub in subs:
            for attr, value in stacked.items():
                _set_config(sub, (attr,), value, attr)
            for attr in STACKED_TOP_K:
                if isinstance(top_k := getattr(sub, attr, None), int) and not isinstance(top_k, bool):
                    setattr(sub, attr, min(top_k, at_most))
    for attr, value in mixer_config(model, config).items():
        _set_config(config, (attr,), value, attr)


# ---------------------------------------------------------------------------------------------------- head counts
#: Names of a hand-written attention's (packed) query projection, a direct child of the attention module.
QUERY_PROJECTIONS = (
    "qkv",
    "qkv_proj",
    "in_proj",
    "Wqkv",
    "query_key_value",
    "to_qkv",
    "q",
    "q_proj",
    "query",
    "to_q",
    "linear",
)  # Inkling 2's relative-position bias: its ``linear`` writes each head's states
#: Attributes holding a hand-written attention's head count, and its inner width (heads * head_dim).
HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads")
INNER_WIDTHS = ("attn_dim", "inner_dim", "all_head_size")


def _int_attr(module: nn.Module, attr: str) -> int | None:
    value = module.__dict__.get(attr)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: Attention modules with a rule of their own (their head counts are never scaled from a query projection).
_OWN_RULES = (
    is_qkv_attention, is_gpt2_attention, is_swin_attention, is_swin_v2_attention, is_maxvit_attention,
    lambda m: fused_qkv_heads(m) is not None, lambda m: mixer_kind(m) is not None,
)  # fmt: skip


def head_counts_before(model: nn.Module, edited: Mapping[int, Any]) -> list[tuple[nn.Module, nn.Linear, int]]:
    """``(attention, query projection, its out_features)`` for each hand-written attention whose projection is cut.

    A module counts when it holds an int head count (:data:`HEAD_COUNTS`) and a direct ``nn.Linear`` child named as
    in :data:`QUERY_PROJECTIONS` that the shrink edits; Llama-style and GPT-2 attention have their own rules.
    """
    found = []
    for module in model.modules():
        if any(f(module) for f in _OWN_RULES):
            continue  # Swin and MaxViT attention: replaced by the shrink (lightning_pat.heads.replace)
        if not any(_int_attr(module, a) for a in HEAD_COUNTS):
            continue
        proj = next(
            (getattr(module, n) for n in QUERY_PROJECTIONS if isinstance(getattr(module, n, None), nn.Linear)), None
        )
        if proj is not None and id(proj) in edited:
            found.append((module, proj, proj.out_features))
    return found


def update_head_counts(records: Sequence[tuple[nn.Module, nn.Linear, int]]) -> None:
    """Scale each recorded attention's head count and inner width with its query projection's kept rows.

    A projection of ``3 * H * D`` rows that keeps ``3 * H' * D`` gives ``num_heads = H'`` (whole heads are cut: the
    shrink's check and discovery's trial shrink prove the model runs and is exact with the new count).
    """
    for module, proj, old_out in records:
        new_out = proj.out_features
        for attr in (*HEAD_COUNTS, *INNER_WIDTHS):
            old = _int_attr(module, attr)
            if old and (old * new_out) % old_out == 0:
                setattr(module, attr, old * new_out // old_out)
