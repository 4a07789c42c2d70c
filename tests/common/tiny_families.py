"""Tiny models of each preset family (random init, offline) and the layout facts the preset tests check against.

The facts (module paths, widths, head counts) are written here from each architecture's definition, not read back
from the presets, so the tests stay independent of the code under test. ``transformers`` is imported lazily.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pat.demo.model import TinyGPT, TinyGPTConfig

VOCAB = 64
SEQ = 12


@dataclass(frozen=True)
class FamilyCase:
    """One tiny model and where its units live.

    Attributes:
        id: Test id.
        preset: The preset name that covers it.
        build: Builds a fresh model (eval mode, every parameter jittered so biases and norms are not trivial).
        layers: Module path of the layer list.
        n_layer, d, ff, n_head, n_kv, head_dim: Sizes.
        down: Module (inside a layer) whose input is the MLP hidden state.
        o: Module (inside a layer) whose input is the concatenated head outputs.
        reads_residual: Modules (inside a layer) whose input is a normed residual stream.
        tied: Whether ``lm_head.weight`` is the embedding tensor.
    """

    id: str
    preset: str
    build: Callable[[], nn.Module]
    layers: str
    n_layer: int
    d: int
    ff: int
    n_head: int
    n_kv: int
    head_dim: int
    down: str
    o: str
    reads_residual: tuple[str, ...]
    tied: bool

    def fresh(self) -> nn.Module:
        """A private copy of the model (built once per case, then deep-copied: tied tensors stay tied)."""
        return copy.deepcopy(_built(self.build))

    @property
    def group_width(self) -> int:
        """Columns of ``o``'s input per unit: a head (MHA) or a whole query group (GQA)."""
        return self.n_head // self.n_kv * self.head_dim


@functools.cache
def _built(build: Callable[[], nn.Module]) -> nn.Module:
    return build()


def jitter_(model: nn.Module, *, seed: int = 0, scale: float = 0.1) -> nn.Module:
    """Add noise to every parameter, so zero-initialised biases and unit norm weights matter in the tests."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return model.eval()


def llama_like(
    family: str,
    *,
    n_head: int,
    n_kv: int,
    bias: bool = False,
    tied: bool = False,
    d: int = 32,
    ff: int = 48,
    n_layer: int = 2,
) -> FamilyCase:
    """A Llama, Mistral, Qwen2 or Qwen3 causal LM (Qwen2 always has q/k/v biases; ``bias`` is Llama's and Qwen3's
    attention bias, and Llama's MLP bias; Qwen3 has per-head q_norm/k_norm and an explicit ``head_dim``)."""

    def build() -> nn.Module:
        import transformers as T

        config_cls, model_cls = {
            "llama": (T.LlamaConfig, T.LlamaForCausalLM),
            "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
            "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
        }[family]
        extra = {
            "llama": {"attention_bias": bias, "mlp_bias": bias},
            "qwen3": {"attention_bias": bias, "head_dim": d // n_head},
        }.get(family, {})
        config = config_cls(
            vocab_size=VOCAB,
            hidden_size=d,
            intermediate_size=ff,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
            attn_implementation="eager",
            **extra,
        )
        torch.manual_seed(0)
        return jitter_(model_cls(config))

    tags = [f"h{n_head}kv{n_kv}"] + (["bias"] if bias or family == "qwen2" else []) + (["tied"] if tied else [])
    return FamilyCase(
        id="-".join([family, *tags]),
        preset=family,
        build=build,
        layers="model.layers",
        n_layer=n_layer,
        d=d,
        ff=ff,
        n_head=n_head,
        n_kv=n_kv,
        head_dim=d // n_head,
        down="mlp.down_proj",
        o="self_attn.o_proj",
        reads_residual=tuple(f"self_attn.{p}_proj" for p in "qkv") + ("mlp.gate_proj", "mlp.up_proj"),
        tied=tied,
    )


def gpt2(*, n_head: int, tied: bool = True, d: int = 32, n_layer: int = 2) -> FamilyCase:
    """A GPT-2 LM head model (``Conv1D`` weights, packed ``c_attn``, LayerNorm with biases, learned positions)."""

    def build() -> nn.Module:
        import transformers as T

        config = T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=d,
            n_layer=n_layer,
            n_head=n_head,
            n_positions=16,
            tie_word_embeddings=tied,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
        torch.manual_seed(0)
        return jitter_(T.GPT2LMHeadModel(config))

    return FamilyCase(
        id=f"gpt2-h{n_head}" + ("-tied" if tied else ""),
        preset="gpt2",
        build=build,
        layers="transformer.h",
        n_layer=n_layer,
        d=d,
        ff=4 * d,
        n_head=n_head,
        n_kv=n_head,
        head_dim=d // n_head,
        down="mlp.c_proj",
        o="attn.c_proj",
        reads_residual=("attn.c_attn", "mlp.c_fc"),
        tied=tied,
    )


def tiny_gpt(
    *, n_head: int, n_kv: int, bias: bool = False, tied: bool = True, d: int = 32, ff: int = 48, n_layer: int = 2
) -> FamilyCase:
    """The demo model."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        cfg = TinyGPTConfig(
            vocab_size=VOCAB,
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv,
            d_model=d,
            d_ff=ff,
            max_seq_len=16,
            bias=bias,
            tie_embeddings=tied,
        )
        return jitter_(TinyGPT(cfg))

    tags = [f"h{n_head}kv{n_kv}"] + (["bias"] if bias else []) + (["tied"] if tied else [])
    return FamilyCase(
        id="-".join(["tiny_gpt", *tags]),
        preset="tiny_gpt",
        build=build,
        layers="layers",
        n_layer=n_layer,
        d=d,
        ff=ff,
        n_head=n_head,
        n_kv=n_kv,
        head_dim=d // n_head,
        down="mlp.down_proj",
        o="attn.o_proj",
        reads_residual=tuple(f"attn.{p}_proj" for p in "qkv") + ("mlp.gate_proj", "mlp.up_proj"),
        tied=tied,
    )


CASES: list[FamilyCase] = [
    llama_like("llama", n_head=4, n_kv=4),
    llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True),
    llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3),
    llama_like("llama", n_head=4, n_kv=1, tied=True),
    llama_like("mistral", n_head=4, n_kv=2),
    llama_like("mistral", n_head=4, n_kv=4, tied=True),
    llama_like("qwen2", n_head=4, n_kv=2, tied=True),
    llama_like("qwen2", n_head=4, n_kv=4),
    llama_like("qwen3", n_head=4, n_kv=2, bias=True, tied=True),
    gpt2(n_head=4),
    gpt2(n_head=2, tied=False, n_layer=3),
    tiny_gpt(n_head=4, n_kv=2, bias=True, tied=False),
    tiny_gpt(n_head=4, n_kv=4),
    tiny_gpt(n_head=8, n_kv=1, d=64, ff=64),
]


def zamba_mixer() -> nn.Module:
    """One Zamba Mamba mixer (``ZambaMambaMixer``) of hidden 8 split into 4 heads of 4 channels (``mamba_expand`` 2),
    state 3, dt rank 2; skips the test if transformers is missing."""
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.ZambaConfig(
        hidden_size=8, n_mamba_heads=4, mamba_d_state=3, mamba_dt_rank=2, num_hidden_layers=1, vocab_size=10,
        num_attention_heads=2, num_key_value_heads=2, layers_block_type=["mamba"],
    )  # fmt: skip
    return transformers.models.zamba.modeling_zamba.ZambaMambaMixer(config, 0)


def token_ids(*, batch: int = 2, seed: int = 1) -> torch.Tensor:
    """Random token ids ``(batch, SEQ)``."""
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a transformers model (``.logits``) or of TinyGPT (a tensor)."""
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits
