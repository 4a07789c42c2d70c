"""Transformers' causal-LM classes as tiny random models, for ``bench/bench_lmzoo.py`` and the family tests (offline).

:func:`tiny_config` shrinks a family's default config to hidden 64, 2 layers, 4 heads of 16 (2 KV heads where the
family has GQA), a small MLP and vocabulary (latent attention: the MLA sizes and 8 experts in 2 routing groups of
``_LATENT``); :func:`build` makes the model (eager attention, every parameter jittered
so that norms and biases matter); :func:`chain` runs what a new user runs: ``prune_clusters(model, "auto", 0.5,
calibration=...)``, ``shrink``, the logits against the masked model's, ``save_pretrained``, stock
``AutoModelForCausalLM.from_pretrained`` and ``generate()``. This is a test and benchmark helper, never library code.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV = 2
HEAD_DIM = 16
FF = 128
EXACT = 1e-4

#: config attribute -> its tiny value (set only where the family's config has the attribute and it is not None,
#: except those in _IF_NONE).
_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size"), FF),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"), 64),
    **dict.fromkeys(("head_dim", "v_head_dim"), HEAD_DIM),
    "rotary_dim": 8,
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,  # Inkling 2: the checkpoint's LM head rows kept (its stock loader pads the rest)
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token"), 2),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    # linear-attention layers of hybrid models (Qwen3-Next/3.5, Kimi-Linear): heads of 16 like the others
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), HEAD_DIM),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_heads"), KV),
    "linear_num_value_heads": HEADS,
    "shared_intermediate_size": 48,  # GraniteMoE-shared (0, its default, means no shared MLP)
    **dict.fromkeys(("router_hidden_size", "expert_ffn_hidden_size"), 32),  # ZAYA's MLP router; LongCat-Flash
    # hybrid mixers (mamba, gated delta nets, LRU): 8 SSM heads of 16 (2 * hidden), state 16 (their defaults would
    # hold most of the tiny model's parameters)
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size"), 16),
    **dict.fromkeys(("mamba_dt_rank", "time_step_rank"), 8),
    "mamba_d_ssm": 2 * HIDDEN,
    "lru_width": HIDDEN,
    # Gemma 3n/4: the per-layer input embeddings
    "hidden_size_per_layer_input": HEAD_DIM,
    "vocab_size_per_layer_input": VOCAB,
}
#: Inkling's sliding-layer heads and relative positions (``d_rel`` 8: heads * d_rel is not the hidden size).
_INKLING = {
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV, "swa_head_dim": HEAD_DIM,
    "sliding_window_size": 16, "rel_extent": 16, "d_rel": 8,
}  # fmt: skip
#: model_type -> the sizes its family needs besides (the tiny sizes above do not build it, or leave it half-used).
_FAMILY: dict[str, dict[str, Any]] = {
    "zaya": {"num_experts_per_tok": 1},  # its config refuses any other top-k
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None by default: every layer would need one
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # all Mamba by default
    "dbrx": {"attn_config": {"kv_n_heads": KV, "rope_theta": 10000.0, "clip_qkv": 8.0},  # its attention reads them
             "ffn_config": {"ffn_hidden_size": FF, "moe_num_experts": 4, "moe_top_k": 2}},
    # mamba2: hidden * expand == num_heads * head_dim; gpt_neo: one (global, local) pair of layers
    "mamba2": {"num_heads": 2 * HIDDEN // HEAD_DIM},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "attention_layers": ["global", "local"]},
    # RoPE per layer kind (None by default: the rotary embedding then finds no entry for its layers)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "bailing_hybrid": {"num_expert_group": 2, "topk_group": 1},  # 8 groups of its 4 experts would be empty
    "ergo": {"first_dense_intermediate_size": FF},  # its dense first layers: 32768 by default
    "nemotron_h": {"moe_shared_expert_intermediate_size": 48},  # its shared expert: 7688 by default
    # QSA indexer: None by default, which the attention divides by; the hyper-connections' rank (320 by default, for
    # hidden 2048) scaled to hidden 64, else they hold nine tenths of the tiny model
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
        "indexer_compress_ratio": 4, "hc_lowrank": 16,
    },
    "fuyu": {"patch_size": 4},  # its image-patch projection (30 * 30 * 3 inputs) would hold most of the tiny model
    # Phi-4-multimodal's audio encoder: 24 blocks, 1024 channels by default; its vision encoder's images 56 pixels
    # wide (16 patches: only its position-embedding table and the trace's cost depend on it)
    "phi4_multimodal": {"audio_config": {"num_blocks": 2, "ext_pw_out_channel": HIDDEN, "nemo_conv_channels": HIDDEN,
                                         "depthwise_separable_out_channel": HIDDEN},
                        "vision_config": {"image_size": 56, "crop_size": 56}},
    "xlstm": {"qk_dim_factor": 1.0},  # its recurrent step's state is (qk head, v head) with qk == v
    # zamba: its shared transformer block is tied across the hybrid layers: two of them; gemma3n: two of the four
    # layers reuse the KV of the last layer of their kind before them; dory: input, recurrent, output layer
    "zamba": {"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "num_hidden_layers": 4},
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_hidden_layers": 4,
                     "num_kv_shared_layers": 2},
    "dory": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "num_hidden_layers": 3,
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # Inkling 1/2/loop: the sliding layers' heads (64 of 128 by default) and the relative-position extents tiny too;
    # Inkling 2-loop: one looped layer (two passes) between a sliding and a full one
    **dict.fromkeys(("inkling_text", "inkling2_text"), _INKLING),
    "inkling2_loop_text": {**_INKLING, "num_hidden_layers": 3, "n_layers_per_attn_res_block": 1,
                           "layer_types": ["hybrid_sliding", "hybrid_sliding", "hybrid"], "loop_layer_index_start": 1,
                           "loop_layer_index_end": 2, "loop_num_passes": 2, "loop_gate_rank": 16},
    # BLT: 6 hash embeddings of 500002 rows by default, the local models' global width (2048) the global model's; its
    # forward's own cache asks its config for num_hidden_layers, which BltConfig has not (a transformers bug): no cache
    "blt": {"encoder_hash_byte_group_vocab": 64, "encoder_config": {"hidden_size_global": HIDDEN},
            "decoder_config": {"hidden_size_global": HIDDEN}, "use_cache": False},
    # kolibri1_1: its indexer scores with at most the query heads of one KV group (1 of the 2 after a query-head cut);
    # one dense layer (both by default) and its own width (3584 by default)
    "kolibri1_1": {"index_num_heads": 1, "mlp_only_layers": [0], "mlp_only_intermediate_size": 96},
}  # fmt: skip
#: Latent (LoRA) attention, set where the config has ``q_lora_rank`` or ``kv_lora_rank`` (DeepSeek-V2/V3/V3.2/V4,
#: GLM-4-MoE-lite, GLM-MoE-DSA, Sarvam-MLA, LongCat-Flash, Youtu, A.X-K1/K2, HY-V4): small ranks and head sizes
#: (DeepSeek-V2's ``head_dim`` is its rotary part: 8 where the config has ``qk_nope_head_dim``), as many KV heads as
#: heads, a small indexer; 8 experts in 2 groups, a dense first layer.
_LATENT = {
    "num_key_value_heads": HEADS, "q_lora_rank": 32, "kv_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 4,
    "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
    "num_experts_per_tok": 2,
}  # fmt: skip
#: Sizes set even where the family's default is ``None`` (derived, or left for the checkpoint to give).
_IF_NONE = {
    "head_dim": HEAD_DIM, "num_key_value_heads": KV, "intermediate_size": FF,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
}  # fmt: skip
#: model_type -> keyword arguments its config takes without holding them as fields (Gemma 4's full-attention head
#: size becomes a per-layer override; Dots3-note's sliding layers: their own latent attention sizes, per-layer
#: overrides of half the heads and ranks of the other layers, their defaults 64 heads and ranks of 1024).
_KWARGS: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("gemma4_text", "gemma4_unified_text"), {"global_head_dim": HEAD_DIM}),
    **dict.fromkeys(("dots3_note", "dots3_note_text"), {
        "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16,
        "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16, "shared_experts_intermediate_size": 32,
    }),
}  # fmt: skip
#: Per-layer kind lists of hybrid families: the tiny model holds each kind of the default list once, attention last
#: (two layers of only linear attention or only mamba would leave the family's attention, and its cache, out).
_KIND_LISTS = ("layer_types", "layers_block_type", "block_types")
#: Where a hybrid family places its attention layers (its default places none in the first two layers).
_HYBRID = {"attn_layer_indices": [1], "attn_layer_period": 2, "attn_layer_offset": 1, "hybrid_layer_ids": [1]}
#: model_type -> its nested configs made tiny with the same sizes (Fuyu's text model, Phi-4-multimodal's vision and
#: audio encoders, BLT's patcher, local encoder/decoder and global transformer; their defaults take minutes to build).
_SUB_CONFIGS = {
    "fuyu": ("text_config",), "phi4_multimodal": ("vision_config", "audio_config"),
    "blt": ("patcher_config", "encoder_config", "decoder_config", "global_config"),
}  # fmt: skip
_SUB_CONFIGS_ALL = {key for keys in _SUB_CONFIGS.values() for key in keys}
#: model_type -> its text model's type, for a config whose own default does not validate (Gemma 4's speculative-decoding
#: assistants: no per-layer inputs, every layer reads the shared KV of the target model), and the assistant's sizes.
_ASSISTANTS = {"gemma4_assistant": "gemma4_text", "gemma4_unified_assistant": "gemma4_unified_text"}
_ASSISTANT_SIZES = {"backbone_hidden_size": HIDDEN, "num_centroids": 16, "centroid_intermediate_top_k": 2}
#: Token ids the tiny vocabulary must hold.
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's default config at the tiny sizes (``overrides`` win); eager attention."""
    from transformers import AutoConfig

    if model_type in _ASSISTANTS:  # the text model's tiny config as the assistant's text_config
        text = tiny_config(_ASSISTANTS[model_type], hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
        text_config = {**text.to_dict(), "num_kv_shared_layers": text.num_hidden_layers}
        config = AutoConfig.for_model(model_type, text_config=text_config, **{**_ASSISTANT_SIZES, **overrides})
        config._attn_implementation = "eager"  # noqa: SLF001 - the documented way before the model exists
        return config
    default = AutoConfig.for_model(model_type)
    fields = default.to_dict()  # not properties derived from them (Falcon's head_dim)
    kwargs: dict[str, Any] = {k: v for k, v in _SIZES.items() if fields.get(k) is not None}
    kwargs.update({k: v for k, v in _IF_NONE.items() if k in fields and fields[k] is None})
    kwargs.update({k: v for k, v in _HYBRID.items() if k in fields})
    for key in (k for k in _KIND_LISTS if isinstance(fields.get(k), list) and len(set(map(str, fields[k]))) > 1):
        kinds = sorted(dict.fromkeys(fields[key]), key=lambda kind: kind == "full_attention")  # attention last
        kwargs[key] = kinds
        depth = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
        kwargs.update({k: len(kinds) for k in depth if k in fields})
    kwargs.update({k: v for k, v in _TOKENS.items() if isinstance(getattr(default, k, None), int)})
    if getattr(default, "n_inner", 0) is None:
        kwargs["n_inner"] = FF  # GPT-J, CodeGen: None means 4 * hidden
    if "q_lora_rank" in fields or "kv_lora_rank" in fields:
        kwargs.update({k: v for k, v in _LATENT.items() if k in fields})
        if "qk_nope_head_dim" in fields and "head_dim" in fields:
            kwargs["head_dim"] = 8
    for key in _SUB_CONFIGS.get(model_type, ()):  # a multimodal or byte-level model's parts: the same sizes
        if isinstance(fields.get(key), dict):
            kwargs[key] = {**fields[key], **{k: v for k, v in _SIZES.items() if fields[key].get(k) is not None}}
    for k, v in _FAMILY.get(model_type, {}).items():  # a nested config's sizes merge into it
        if k in fields:
            kwargs[k] = {**kwargs.get(k, fields[k]), **v} if isinstance(v, dict) and k in _SUB_CONFIGS_ALL else v
    kwargs.update(_KWARGS.get(model_type, {}))
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"  # noqa: SLF001 - the documented way before the model exists
    return config


def build(model_type: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random causal LM of ``model_type`` (eval mode, every parameter jittered)."""
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type, **overrides)
    cls = getattr(T, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    text = getattr(config, "text_config", None)
    if text is not None and not isinstance(config, cls.config_class):  # Llama 4, Qwen3.5-MoE: the text model's
        config = tiny_config(text.model_type, **overrides)
    torch.manual_seed(seed)
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return model.eval()


def standalone_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on token ids alone (a speculative-decoding assistant whose forward takes the target
    model's ``shared_kv_states``: Gemma 4's), else ``None``."""
    import inspect

    if "shared_kv_states" in inspect.signature(model.forward).parameters:
        return (
            "a speculative-decoding assistant: its forward takes the target model's inputs_embeds and "
            "shared_kv_states, not token ids, so it cannot be calibrated, compared or generate() alone"
        )
    return None


def token_ids(batch: int = 2, seq: int = 10, *, seed: int = 1) -> torch.Tensor:
    """Random token ids ``(batch, seq)`` above the special tokens."""
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def non_embedding_params(model: nn.Module) -> int:
    """Parameters outside embeddings and the LM head (a tied tensor once)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        skip.add(id(head.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _stock(cls: type, folder: str) -> nn.Module:
    """Stock ``AutoModelForCausalLM.from_pretrained``, or the class's own where the auto mapping does not list the
    saved config (Emu3's text config: its dense model does not reload through the auto class either)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(folder)
    loader: Any = AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else cls
    return loader.from_pretrained(folder, attn_implementation="eager").eval()


@dataclass
class Outcome:
    """What :func:`chain` reached: each stage's result, or the error that stopped it (``stage``: where)."""

    resolves: bool = False
    exact: float | None = None
    cut: float | None = None
    reload: float | None = None
    generates: bool = False
    stage: str = ""
    error: str = ""
    clusters: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every stage passed: exact shrink, >= 20% cut, stock reload with the same logits, generate()."""
        good = self.exact is not None and self.exact < EXACT and self.reload is not None and self.reload < EXACT
        return good and self.cut is not None and self.cut >= 0.2 and self.generates


def chain(model: nn.Module, *, sparsity: float = 0.5) -> Outcome:
    """Prune ``model`` with ``"auto"`` one-shot, shrink, compare, export, reload with stock transformers, generate."""
    from lightning_pat import prune_clusters, save_pretrained, shrink

    out = Outcome()
    ids = token_ids()
    calibration = [token_ids(seed=s) for s in (2, 3)]
    dense = non_embedding_params(model)
    try:
        out.stage = "prune"
        result = prune_clusters(model, "auto", sparsity, calibration=calibration)
        out.resolves = True
        out.clusters = sorted({name.split(".")[0] for name in result.dropped})
        masked = _logits(model, ids)
        out.stage = "shrink"
        small = shrink(model, result, example_input=None)
        out.exact = _rel(_logits(small, ids), masked)
        out.cut = 1 - non_embedding_params(small) / dense
        out.stage = "reload"
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(small, tmp, overwrite=True, tokenizer=None)
            stock = _stock(type(small), tmp)
            out.reload = _rel(_logits(stock, ids), masked)
            out.stage = "generate"
            with torch.no_grad():
                stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
            out.generates = True
        out.stage = ""
    except Exception as err:  # noqa: BLE001 - the bench records every failure with its reason
        out.error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    return out
