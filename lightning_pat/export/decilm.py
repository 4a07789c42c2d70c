"""The DeciLM format (``model_type`` ``nemotron-nas``): a Llama with per-layer widths that vLLM serves.

A stock Llama config has one MLP width and one KV-head count for all layers. DeciLM's ``config.json`` adds
``block_configs``, one per decoder layer: ``attention.n_heads_in_group`` (query heads per KV head: the layer has
``num_attention_heads // n_heads_in_group`` KV heads) and ``ffn.intermediate_size``. The weights keep the Llama
names. vLLM's model registry has ``DeciLMForCausalLM``; it builds the config from the class the checkpoint ships
(``configuration_decilm.py``, :mod:`lightning_pat.export.decilm_config`), so vLLM loads an export with
``LLM(model=dir, trust_remote_code=True)``.

What DeciLM cannot express, and is refused (never written as something else):

* a query-head count that differs between layers (``num_attention_heads`` is global; ranked head widths prune
  whole GQA groups, query heads with their KV head, so the query heads differ): prune the heads uniformly or not at
  all (``preset_options={"heads": False}`` with ``target_widths="ranked"`` ranks the MLP widths only), or write GGUF,
  whose ``deci`` architecture takes per-layer query-head counts;
* anything :func:`~lightning_pat.export.llama_layout.read_layout` refuses (not a ``LlamaForCausalLM``, biases, eps
  that differ between norms).

A dropped layer (``preset_options={"layers": True}``) is deleted by ``shrink``, so it is simply absent: a block with
``attention.no_op`` and ``ffn.no_op`` would compute the same, more slowly. Reading, :func:`entry_from_config` turns
a DeciLM ``config.json`` into the description :func:`lightning_pat.load_pretrained` builds a ``LlamaForCausalLM``
from (the config to build, every parameter shape, the attributes of the narrowed modules). Blocks with ``no_op`` or
``replace_with_linear`` (NVIDIA's Nemotron-51B has them) have no ``LlamaForCausalLM`` equivalent and are refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_pat.export.llama_layout import LayerShape, LlamaLayout, rope_parameters

MODEL_TYPE = "nemotron-nas"
ARCHITECTURE = "DeciLMForCausalLM"
#: The config class file an export carries (``auto_map`` names it; vLLM imports it with ``trust_remote_code``).
CONFIG_MODULE_FILE = "configuration_decilm.py"
_CONFIG_CLASS = "configuration_decilm.DeciLMConfig"
#: Keys of the source config copied as they are (token ids, dtype, cache flag).
_COPIED = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "dtype", "torch_dtype", "use_cache")


def is_decilm(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` (as a dict) is a DeciLM config."""
    return config.get("model_type") == MODEL_TYPE


def config_module_source() -> str:
    """The text of ``configuration_decilm.py`` (the module :mod:`lightning_pat.export.decilm_config`)."""
    return (Path(__file__).with_name("decilm_config.py")).read_text()


def check_expressible(layout: LlamaLayout, *, what: str) -> int:
    """The global query-head count, or a ``ValueError`` saying why DeciLM cannot express ``layout``.

    Raises:
        ValueError: If the layers have different query-head counts (the message lists them and the fixes).
    """
    heads = [layer.n_head for layer in layout.layers]
    if len(set(heads)) != 1:
        raise ValueError(
            f"{what}: DeciLM has one query-head count for all layers (`num_attention_heads`; per layer only the KV "
            f"groups `n_heads_in_group` and the MLP width vary), but the layers have {heads} query heads (ranked "
            "head widths drop whole GQA groups). Prune the heads uniformly or not at all (target_widths='ranked' "
            "with preset_options={'heads': False} ranks the MLP widths only), or write format='gguf' (llama.cpp's "
            "`deci` architecture takes per-layer head counts)."
        )
    return heads[0]


def config_dict(layout: LlamaLayout, *, what: str) -> dict[str, Any]:
    """The DeciLM ``config.json`` of a model.

    Raises:
        ValueError: As for :func:`check_expressible`.
    """
    n_head = check_expressible(layout, what=what)
    blocks = [
        {
            "attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": n_head // layer.n_kv_head},
            "ffn": {"no_op": False, "replace_with_linear": False, "intermediate_size": layer.ffn},
        }
        for layer in layout.layers
    ]
    out: dict[str, Any] = {k: layout.config[k] for k in _COPIED if layout.config.get(k) is not None}
    rope = dict(layout.rope)
    out.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        auto_map={"AutoConfig": _CONFIG_CLASS},
        vocab_size=layout.vocab,
        hidden_size=layout.hidden,
        num_hidden_layers=len(layout.layers),
        num_attention_heads=n_head,
        num_key_value_heads=layout.layers[0].n_kv_head,  # read by tools that expect one; block_configs rule
        head_dim=layout.head_dim,
        intermediate_size=max(layer.ffn for layer in layout.layers),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=layout.rms_norm_eps,
        max_position_embeddings=layout.max_positions,
        tie_word_embeddings=layout.tied,
        rope_theta=rope["rope_theta"],
        rope_parameters=rope,
        rope_scaling=None if rope.get("rope_type") == "default" else rope,
        block_configs=blocks,
    )
    return out


# ---------------------------------------------------------------------------------------------------- read
def _positive_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"load_pretrained: DeciLM config {where} must be a positive integer, got {value!r}.")
    return value


def _ffn_width(ffn: Mapping[str, Any], hidden: int, where: str) -> int:
    if "intermediate_size" in ffn:
        return _positive_int(ffn["intermediate_size"], f"{where}.intermediate_size")
    mult = ffn.get("ffn_mult")
    if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
        raise ValueError(f"load_pretrained: DeciLM config {where} has no intermediate_size and no positive ffn_mult.")
    width = int(2 * mult * hidden / 3)  # DeciLM's rule: two thirds of ffn_mult * hidden, rounded up to 256
    return 256 * math.ceil(width / 256)


def read_blocks(config: Mapping[str, Any]) -> tuple[int, int, tuple[LayerShape, ...]]:
    """``(hidden, query heads, per-layer shapes)`` of a DeciLM config, checked.

    Raises:
        ValueError: If a size is missing or not a positive integer, ``block_configs`` does not have one entry per
            layer, a block is ``no_op`` / ``replace_with_linear``, or ``n_heads_in_group`` does not divide the
            query heads.
    """
    hidden = _positive_int(config.get("hidden_size"), "hidden_size")
    n_head = _positive_int(config.get("num_attention_heads"), "num_attention_heads")
    n_layer = _positive_int(config.get("num_hidden_layers"), "num_hidden_layers")
    blocks = config.get("block_configs")
    if not isinstance(blocks, Sequence) or len(blocks) != n_layer:
        raise ValueError(
            f"load_pretrained: DeciLM config needs one block_configs entry per layer ({n_layer}), got "
            f"{len(blocks) if isinstance(blocks, Sequence) else blocks!r}."
        )
    shapes = []
    for i, block in enumerate(blocks):
        attn = block.get("attention") if isinstance(block, Mapping) else None
        ffn = block.get("ffn") if isinstance(block, Mapping) else None
        if not isinstance(attn, Mapping) or not isinstance(ffn, Mapping):
            raise ValueError(f"load_pretrained: DeciLM block_configs[{i}] needs `attention` and `ffn` sections.")
        sections = (("attention", attn), ("ffn", ffn))
        keys = ("no_op", "replace_with_linear")
        special = [f"{name}.{key}" for name, sec in sections for key in keys if sec.get(key)]
        if special:
            raise ValueError(
                f"load_pretrained: DeciLM block_configs[{i}] sets {special}: a skipped or linear block has no "
                "LlamaForCausalLM equivalent, so lightning_pat cannot load it (vLLM can: LLM(model=dir, "
                "trust_remote_code=True)). lightning_pat writes dropped layers by deleting them."
            )
        group = _positive_int(attn.get("n_heads_in_group"), f"block_configs[{i}].attention.n_heads_in_group")
        if n_head % group:
            raise ValueError(
                f"load_pretrained: DeciLM block_configs[{i}].attention.n_heads_in_group={group} does not divide "
                f"num_attention_heads={n_head}."
            )
        shapes.append(LayerShape(n_head, n_head // group, _ffn_width(ffn, hidden, f"block_configs[{i}].ffn")))
    return hidden, n_head, tuple(shapes)


def _layer_shapes(i: int, layer: LayerShape, hidden: int, head_dim: int) -> dict[str, list[int]]:
    p = f"model.layers.{i}."
    q, kv = layer.n_head * head_dim, layer.n_kv_head * head_dim
    return {
        p + "input_layernorm.weight": [hidden],
        p + "post_attention_layernorm.weight": [hidden],
        p + "self_attn.q_proj.weight": [q, hidden],
        p + "self_attn.k_proj.weight": [kv, hidden],
        p + "self_attn.v_proj.weight": [kv, hidden],
        p + "self_attn.o_proj.weight": [hidden, q],
        p + "mlp.gate_proj.weight": [layer.ffn, hidden],
        p + "mlp.up_proj.weight": [layer.ffn, hidden],
        p + "mlp.down_proj.weight": [hidden, layer.ffn],
    }


def _layer_attributes(i: int, layer: LayerShape, hidden: int, head_dim: int) -> dict[str, dict[str, Any]]:
    p = f"model.layers.{i}."
    q, kv = layer.n_head * head_dim, layer.n_kv_head * head_dim
    return {
        p[:-1]: {"hidden_size": hidden},
        p + "self_attn": {"num_key_value_groups": layer.n_head // layer.n_kv_head},
        p + "self_attn.q_proj": {"in_features": hidden, "out_features": q},
        p + "self_attn.k_proj": {"in_features": hidden, "out_features": kv},
        p + "self_attn.v_proj": {"in_features": hidden, "out_features": kv},
        p + "self_attn.o_proj": {"in_features": q, "out_features": hidden},
        p + "mlp": {"hidden_size": hidden, "intermediate_size": layer.ffn},
        p + "mlp.gate_proj": {"in_features": hidden, "out_features": layer.ffn},
        p + "mlp.up_proj": {"in_features": hidden, "out_features": layer.ffn},
        p + "mlp.down_proj": {"in_features": layer.ffn, "out_features": hidden},
    }


def entry_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`lightning_pat.load_pretrained` builds from a DeciLM ``config.json``.

    Returns:
        ``{"class": "LlamaForCausalLM", "base_config": ..., "shapes": ..., "attributes": ...}``: the Llama config to
        build (the widest layer's sizes), every parameter's shape and the attributes of each narrowed module.

    Raises:
        ValueError: As for :func:`read_blocks`; also if ``architectures`` is not ``["DeciLMForCausalLM"]``, the
            activation is not SiLU, or ``head_dim`` is missing and ``hidden_size`` is not a multiple of the heads.
    """
    if list(config.get("architectures") or [ARCHITECTURE]) != [ARCHITECTURE]:
        raise ValueError(f"load_pretrained: a {MODEL_TYPE} config.json names {config.get('architectures')}.")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("load_pretrained: this DeciLM config uses biases or another activation than SiLU.")
    hidden, n_head, layers = read_blocks(config)
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % n_head:
            raise ValueError(f"load_pretrained: DeciLM config has no head_dim and {hidden} % {n_head} != 0.")
        head_dim = hidden // n_head
    head_dim = _positive_int(head_dim, "head_dim")
    vocab = _positive_int(config.get("vocab_size"), "vocab_size")
    tied = bool(config.get("tie_word_embeddings", False))
    base: dict[str, Any] = {k: config[k] for k in _COPIED if config.get(k) is not None}
    # transformers refuses a Llama config whose hidden size is not a multiple of the heads (a shrunk residual can be
    # any width): build at the next multiple, the shapes and attributes below give every module its real width
    buildable = n_head * math.ceil(hidden / n_head)
    base.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=buildable,
        intermediate_size=max(layer.ffn for layer in layers),
        num_hidden_layers=len(layers),
        num_attention_heads=n_head,
        num_key_value_heads=max(layer.n_kv_head for layer in layers),
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_positive_int(config.get("max_position_embeddings", 2048), "max_position_embeddings"),
        tie_word_embeddings=tied,
        rope_parameters=rope_parameters(config),
    )
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    attributes: dict[str, dict[str, Any]] = {"model.embed_tokens": {"embedding_dim": hidden}}
    for i, layer in enumerate(layers):
        shapes.update(_layer_shapes(i, layer, hidden, head_dim))
        attributes.update(_layer_attributes(i, layer, hidden, head_dim))
    shapes["lm_head.weight"] = [vocab, hidden]
    attributes["lm_head"] = {"in_features": hidden}
    return {"class": "LlamaForCausalLM", "base_config": base, "shapes": shapes, "attributes": attributes}
