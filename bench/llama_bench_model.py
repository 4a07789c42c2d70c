"""The Llama-style ``LlamaForCausalLM`` timed by bench_shrink.py and bench_size.py (shared: neither imports the other).

Full size: d=384, ffn=1024, 6 layers, 6 heads of 64, vocabulary 6144, untied embeddings; ``quick``: a tiny model for a
smoke test.
"""

from __future__ import annotations

import torch
import transformers as T
from torch import nn


def config(quick: bool, **sizes: int) -> T.LlamaConfig:
    """The benchmark's config; ``sizes`` are set after construction (LlamaConfig refuses hidden % heads != 0, which an
    explicit ``head_dim`` makes legitimate)."""
    base = (
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        if quick
        else {
            "vocab_size": 6144,
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
        }
    )
    head_dim = base["hidden_size"] // base["num_attention_heads"]
    cfg = T.LlamaConfig(
        **base, num_key_value_heads=base["num_attention_heads"], head_dim=head_dim, tie_word_embeddings=False
    )
    for key, value in sizes.items():
        setattr(cfg, key, value)
    if "num_attention_heads" in sizes:
        cfg.num_key_value_heads = sizes["num_attention_heads"]
    return cfg


def build(cfg: T.LlamaConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(cfg).eval()
