"""The shapes of a (shrunk) Llama-family Hugging Face model, layer by layer, for the serving formats.

:func:`read_layout` reads them from the modules themselves (a shrunk model's config keeps the stock sizes where the
widths differ between layers) and checks everything the GGUF and DeciLM writers rely on: a ``LlamaForCausalLM``
(``model_type`` "llama") without biases, SiLU MLPs, RoPE without scaling or with a scaling both formats express,
one ``head_dim``, one RMSNorm eps. What it refuses it names, with the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pat.shrink.model_meta import is_llama_attention


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: its query heads, KV heads and MLP width."""

    n_head: int
    n_kv_head: int
    ffn: int


@dataclass(frozen=True)
class LlamaLayout:
    """What a serving format needs to know about a Llama-family model.

    Attributes:
        hidden: The residual width (``hidden_size``).
        vocab: Rows of the embedding.
        head_dim: Channels per head (query, key and value).
        layers: One :class:`LayerShape` per decoder layer, in order.
        tied: Whether ``lm_head`` is the embedding.
        rms_norm_eps: The eps of every RMSNorm (one value: a residual shrink rescales all of them alike).
        rope: The config's RoPE parameters (``rope_theta``, ``rope_type`` and the type's own keys).
        max_positions: ``max_position_embeddings``.
        config: The model's config as a plain dict (token ids, dtype, ...).
    """

    hidden: int
    vocab: int
    head_dim: int
    layers: tuple[LayerShape, ...]
    tied: bool
    rms_norm_eps: float
    rope: Mapping[str, Any]
    max_positions: int
    config: Mapping[str, Any]

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same head counts and MLP width (a stock Llama config expresses it)."""
        return len(set(self.layers)) <= 1


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config dict as one dict with ``rope_theta`` and ``rope_type``.

    transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_theta`` and ``rope_scaling``.
    """
    found = config.get("rope_parameters")
    if isinstance(found, Mapping):
        rope = dict(found)
    else:
        rope = dict(config.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def _refuse(what: str, fix: str) -> ValueError:
    return ValueError(f"{what}; {fix}")


def read_layout(model: nn.Module, *, what: str) -> LlamaLayout:
    """The per-layer shapes of a Llama-family Hugging Face causal LM, checked for the serving formats.

    Args:
        model: A ``LlamaForCausalLM`` (shrunk or not).
        what: The caller (``save_pretrained(format='gguf')``), for error messages.

    Returns:
        The layout.

    Raises:
        ValueError: If the model is not a ``LlamaForCausalLM``, has attention or MLP biases, another activation than
            SiLU, heads of different sizes, RMSNorms with different eps, or layers that are not Llama decoder layers
            (each message names what was found and the fix).
    """
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    config: dict[str, Any] = to_dict() if callable(to_dict) else {}
    if config.get("model_type") != "llama" or type(model).__name__ != "LlamaForCausalLM":
        raise _refuse(
            f"{what}: writes the Llama family only (LlamaForCausalLM, model_type 'llama'); got "
            f"{type(model).__name__} with model_type {config.get('model_type')!r}",
            "export it with the default format='hf'",
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise _refuse(f"{what}: the model has attention or MLP biases", "the Llama GGUF and DeciLM layouts have none")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(f"{what}: hidden_act is {config.get('hidden_act')!r}, not 'silu'", "export with format='hf'")
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    embed = getattr(backbone, "embed_tokens", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(embed, nn.Embedding):
        raise _refuse(f"{what}: {type(model).__name__} has no model.layers / model.embed_tokens", "export with 'hf'")
    shapes, head_dims = [], set()
    for i, layer in enumerate(layers):
        attn, down = getattr(layer, "self_attn", None), getattr(getattr(layer, "mlp", None), "down_proj", None)
        if attn is None or not is_llama_attention(attn) or not isinstance(down, nn.Linear):
            raise _refuse(f"{what}: layer {i} is not a Llama decoder layer (self_attn q/k/v/o_proj, mlp)", "use 'hf'")
        hd = attn.head_dim
        head_dims.add(hd)
        n_q, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
        shapes.append(LayerShape(n_q, n_kv, down.in_features))
    if len(head_dims) != 1:
        raise _refuse(f"{what}: head_dim differs between layers ({sorted(head_dims)})", "export with format='hf'")
    eps = {
        float(e)
        for m in model.modules()
        if type(m).__name__.endswith("RMSNorm") and isinstance(e := getattr(m, "variance_epsilon", None), float)
    }
    if len(eps) != 1:
        raise _refuse(
            f"{what}: the RMSNorms have different eps ({sorted(eps)}; a serving config has one rms_norm_eps)",
            "export with format='hf' and load it with lightning_pat.load_pretrained",
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return LlamaLayout(
        hidden=embed.embedding_dim,
        vocab=embed.num_embeddings,
        head_dim=head_dims.pop(),
        layers=tuple(shapes),
        tied=head is not None and head.weight is embed.weight,
        rms_norm_eps=eps.pop(),
        rope=rope_parameters(config),
        max_positions=int(config.get("max_position_embeddings") or 2048),
        config=config,
    )
