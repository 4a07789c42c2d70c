"""A GGUF file of a (shrunk) Llama-family model, with its tokenizer, for llama.cpp.

:func:`write_gguf` writes ``model.gguf`` with the ``gguf`` package (imported here only, lazily). The facts it
follows, from the GGUF specification and llama.cpp's loader:

* Architecture ``llama`` when every layer has the same widths (llama.cpp's ``llama`` graph sizes every layer like
  layer 0); otherwise ``deci``, whose loader and graph read ``{arch}.attention.head_count``,
  ``.head_count_kv`` and ``.feed_forward_length`` as per-layer arrays (query heads included).
* ``attention.key_length`` / ``value_length`` and ``rope.dimension_count`` are the head dim, written always: the
  default llama.cpp assumes is ``embedding_length / head_count``, wrong once heads or the residual were pruned.
* Tensor names ``token_embd``, ``output_norm``, ``output`` (absent when tied), and per block ``attn_norm``,
  ``attn_q/k/v``, ``attn_output``, ``ffn_norm``, ``ffn_gate/up/down``; a 2-D weight keeps its PyTorch shape
  ``(out, in)`` (GGUF lists dims innermost first, the ``gguf`` writer reverses them).
* llama.cpp's Llama RoPE rotates consecutive pairs ``(2i, 2i+1)`` of each head, Hugging Face's rotates ``(i, i +
  head_dim/2)``: the rows of ``q_proj`` (per query head) and ``k_proj`` (per KV head) are permuted accordingly.
* The tokenizer (a byte-level BPE ``tokenizer.json``, as Llama-family and SmolLM models use): model ``gpt2``, every
  token with its type (special added tokens ``CONTROL``, other added tokens ``USER_DEFINED``, rows of the
  embedding beyond the vocabulary ``UNUSED``), the merges, the special token ids, ``add_bos_token`` and the chat
  template (``gguf.SpecialVocab``), and ``tokenizer.ggml.pre``, the name llama.cpp gives the pre-tokenizer's
  regex: ``gpt-2`` for GPT-2's byte-level split, ``smollm`` for single digits then GPT-2's split. Another
  pre-tokenizer is refused (llama.cpp would split text differently from the Hugging Face tokenizer).

Types (``dtype``): ``f32``, ``f16``, ``bf16`` and the block quantizations the ``gguf`` package implements
(``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``). Norm weights stay ``f32``; a quantized type applies to the 2-D
weights whose rows are a multiple of its block (32), the others are written ``f16`` (as llama.cpp's converter does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from lightning_pat.export.llama_layout import LlamaLayout, read_layout

log = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
#: ``dtype`` -> (the ``GGMLQuantizationType`` name, the ``LlamaFileType`` name)
GGUF_TYPES: dict[str, tuple[str, str]] = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
}
_INSTALL = "pip install gguf"


def _pre_tokenizer_name(pre: object) -> str | None:
    """llama.cpp's name for a ``tokenizer.json`` pre-tokenizer, or ``None`` when it is not one we know."""

    def byte_level(p: object) -> bool:
        return (
            isinstance(p, Mapping)
            and p.get("type") == "ByteLevel"
            and p.get("use_regex", True) is True
            and not p.get("add_prefix_space", False)
        )

    if byte_level(pre):
        return "gpt-2"
    steps = pre.get("pretokenizers") if isinstance(pre, Mapping) and pre.get("type") == "Sequence" else None
    if isinstance(steps, list) and len(steps) == 2:
        digits, rest = steps
        if isinstance(digits, Mapping) and digits.get("type") == "Digits" and digits.get("individual_digits"):
            return "smollm" if byte_level(rest) else None
    return None


def check_tokenizer(directory: Path, *, vocab_rows: int, what: str) -> dict[str, Any]:
    """Read ``tokenizer.json`` and check that llama.cpp can use it as the Hugging Face tokenizer does.

    Returns:
        ``{"tokens": [...], "types": [...], "pre": ...}`` with one token per embedding row.

    Raises:
        ValueError: If there is no ``tokenizer.json``, it is not a byte-level BPE without byte fallback or
            normalizer, its pre-tokenizer has no llama.cpp name we know, or it has more tokens than the embedding.
    """
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{what}: a GGUF file embeds the tokenizer, and the export has no tokenizer.json; pass tokenizer= (a "
            "tokenizer object or the directory the model came from) to save_pretrained."
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    decoder = (data.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder != "ByteLevel":
        raise ValueError(
            f"{what}: the tokenizer is not a byte-level BPE (model {model.get('type')!r}, decoder {decoder!r}); this "
            "GGUF writer embeds byte-level BPE tokenizers only."
        )
    if data.get("normalizer"):
        raise ValueError(f"{what}: the tokenizer has a normalizer ({data['normalizer'].get('type')}); not supported.")
    pre = _pre_tokenizer_name(data.get("pre_tokenizer"))
    if pre is None:
        raise ValueError(
            f"{what}: the tokenizer's pre-tokenizer {json.dumps(data.get('pre_tokenizer'))[:200]} has no llama.cpp "
            "name this writer knows (GPT-2's byte-level split 'gpt-2'; single digits then that split 'smollm'); "
            "llama.cpp would split text differently, so no GGUF file is written."
        )
    by_id: dict[int, tuple[str, int]] = {int(i): (t, 1) for t, i in model.get("vocab", {}).items()}  # 1: NORMAL
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], 3 if added.get("special") else 4)  # CONTROL / USER_DEFINED
    if by_id and max(by_id) >= vocab_rows:
        raise ValueError(
            f"{what}: the tokenizer has token id {max(by_id)}, the embedding only {vocab_rows} rows; the tokenizer "
            "does not belong to this model."
        )
    tokens = [by_id.get(i, (f"[PAD{i}]", 5))[0] for i in range(vocab_rows)]  # 5: UNUSED
    types = [by_id.get(i, ("", 5))[1] for i in range(vocab_rows)]
    return {"tokens": tokens, "types": types, "pre": pre}


def permute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder the rows of a q (or k) projection from Hugging Face's half-split RoPE to llama.cpp's pairs.

    Within each head, row ``j * head_dim/2 + i`` (half ``j`` of pair ``i``) moves to row ``2 i + j``.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as err:
        raise ModuleNotFoundError(f"save_pretrained(format='gguf') needs the gguf package: `{_INSTALL}`.") from err
    return gguf


def check_dtype(dtype: str) -> None:
    """Raise now for a ``dtype`` :func:`write_gguf` does not write.

    Raises:
        ValueError: If ``dtype`` is not a key of :data:`GGUF_TYPES`.
    """
    if dtype not in GGUF_TYPES:
        raise ValueError(f"save_pretrained: `gguf_dtype` must be one of {sorted(GGUF_TYPES)}, got {dtype!r}.")


def _tensors(model: nn.Module, layout: LlamaLayout) -> list[tuple[str, torch.Tensor]]:
    backbone: Any = model.model
    out = [("token_embd.weight", backbone.embed_tokens.weight), ("output_norm.weight", backbone.norm.weight)]
    if not layout.tied:
        get_head = cast("Callable[[], nn.Module]", model.get_output_embeddings)
        out.append(("output.weight", get_head().weight))
    for i, (layer, shape) in enumerate(zip(backbone.layers, layout.layers, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        out += [
            (f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight),
            (f"blk.{i}.attn_q.weight", permute_rope_rows(attn.q_proj.weight, shape.n_head)),
            (f"blk.{i}.attn_k.weight", permute_rope_rows(attn.k_proj.weight, shape.n_kv_head)),
            (f"blk.{i}.attn_v.weight", attn.v_proj.weight),
            (f"blk.{i}.attn_output.weight", attn.o_proj.weight),
            (f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight),
            (f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight),
            (f"blk.{i}.ffn_up.weight", mlp.up_proj.weight),
            (f"blk.{i}.ffn_down.weight", mlp.down_proj.weight),
        ]
    return out


def layout_for_gguf(model: nn.Module, *, what: str) -> LlamaLayout:
    """The layout, checked for what this writer supports (RoPE without scaling).

    Raises:
        ValueError: As for :func:`~lightning_pat.export.llama_layout.read_layout`, or for a RoPE scaling type.
    """
    layout = read_layout(model, what=what)
    if layout.rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{what}: RoPE type {layout.rope.get('rope_type')!r} is not written to GGUF by lightning_pat (only "
            "unscaled RoPE); write format='hf' or 'decilm' for vLLM."
        )
    return layout


def write_gguf(model: nn.Module, path: Path, *, tokenizer_dir: Path, dtype: str = "f32", what: str) -> Path:
    """Write ``model`` (a Llama-family causal LM) and the tokenizer files in ``tokenizer_dir`` as one GGUF file.

    Args:
        model: A ``LlamaForCausalLM``, shrunk or not.
        path: The file to write.
        tokenizer_dir: A directory holding ``tokenizer.json`` (and ``tokenizer_config.json`` / ``config.json`` for
            the special tokens and chat template).
        dtype: A key of :data:`GGUF_TYPES`.
        what: The caller, for error messages.

    Returns:
        ``path``.

    Raises:
        ValueError: As for :func:`layout_for_gguf`, :func:`check_tokenizer` and :func:`check_dtype`.
        ModuleNotFoundError: If the ``gguf`` package is not installed.
    """
    check_dtype(dtype)
    layout = layout_for_gguf(model, what=what)
    vocab = check_tokenizer(tokenizer_dir, vocab_rows=layout.vocab, what=what)
    gguf = _import_gguf()
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[dtype][0])
    arch = "llama" if layout.uniform else "deci"
    writer = gguf.GGUFWriter(str(path), arch)
    name = str(layout.config.get("_name_or_path") or layout.config.get("name_or_path") or "").rstrip("/")
    writer.add_name(Path(name).name or "lightning_pat export")
    writer.add_file_type(int(getattr(gguf.LlamaFileType, GGUF_TYPES[dtype][1])))
    per_layer = layout.layers
    writer.add_block_count(len(per_layer))
    writer.add_context_length(layout.max_positions)
    writer.add_embedding_length(layout.hidden)
    if layout.uniform:
        writer.add_feed_forward_length(per_layer[0].ffn)
        writer.add_head_count(per_layer[0].n_head)
        writer.add_head_count_kv(per_layer[0].n_kv_head)
    else:
        writer.add_feed_forward_length([s.ffn for s in per_layer])
        writer.add_head_count([s.n_head for s in per_layer])
        writer.add_head_count_kv([s.n_kv_head for s in per_layer])
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(layout.rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(layout.rms_norm_eps)
    writer.add_vocab_size(layout.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=layout.vocab)
    special.add_special_token.setdefault("bos", False)  # the tokenizer's template adds no BOS unless it says so
    special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)
    fallback = []
    with torch.no_grad():
        for tensor_name, tensor in _tensors(model, layout):
            data = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
            if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(tensor_name, data)
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(tensor_name, data.astype("float16"))
            elif data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
                fallback.append(tensor_name)
                writer.add_tensor(tensor_name, data.astype("float16"))
            else:
                writer.add_tensor(tensor_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if fallback:
        log.info("%s: %d tensors' rows are not a multiple of %s's block: written f16", what, len(fallback), dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("%s: wrote %s (%s, architecture %r)", what, path, dtype, arch)
    return path
