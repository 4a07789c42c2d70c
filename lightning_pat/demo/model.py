"""TinyGPT: a small Llama-style decoder (pure torch) for the README demo and the tests.

RMSNorm, RoPE, SwiGLU, GQA. Names (``N`` = layer; ``bias=True`` adds a ``.bias`` to every Linear but lm_head)::

    embed.weight [V, d]  (is lm_head.weight when tied)
    layers.N.attn_norm.weight [d]                          layers.N.mlp_norm.weight [d]
    layers.N.attn.{q,k,v}_proj.weight [H*hd | Hkv*hd, d]   layers.N.attn.o_proj.weight [d, H*hd]
    layers.N.mlp.{gate,up}_proj.weight [F, d]              layers.N.mlp.down_proj.weight [d, F]
    norm.weight [d]                                        lm_head.weight [V, d]

Zeroed units are dead: an MLP channel with zero gate/up rows gives ``silu(0) * 0 = 0``; a query group with zero
q/k/v rows attends uniformly over zero values and outputs 0 (RoPE rotates within a head); a residual channel with
zero embedding columns, o/down rows and biases stays 0 because RMSNorm is elementwise in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class TinyGPTConfig:
    """Sizes of a :class:`TinyGPT`.

    Args:
        vocab_size: Vocabulary size ``V``.
        n_layer: Number of decoder blocks.
        n_head: Query heads ``H``; must divide ``d_model`` (``hd = d_model // n_head``).
        n_kv_head: Key/value heads ``Hkv``; must divide ``n_head``.
        d_model: Residual width ``d``.
        d_ff: MLP hidden width ``F``.
        max_seq_len: Longest sequence ``T``.
        bias: Whether the q/k/v/o and gate/up/down projections have biases.
        tie_embeddings: Whether ``lm_head.weight`` is ``embed.weight``.
        head_dim: Width ``hd`` of one head; ``None`` means ``d_model // n_head`` (a shrunk model with dropped heads
            sets it explicitly, as ``n_head * hd`` then differs from ``d_model``).

    Raises:
        ValueError: If a head count does not divide, or ``hd`` is odd (RoPE rotates pairs).
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    d_ff: int = 256
    max_seq_len: int = 64
    bias: bool = False
    tie_embeddings: bool = True
    head_dim: int | None = None

    def __post_init__(self) -> None:
        divides = self.head_dim is not None or not self.d_model % self.n_head
        if not divides or self.n_head % self.n_kv_head or self.hd % 2:
            raise ValueError(f"Expected `n_head | d_model` (even head_dim) and `n_kv_head | n_head`, got {self}.")

    @property
    def hd(self) -> int:
        """The head width: ``head_dim`` if set, else ``d_model // n_head``."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head


class Attention(nn.Module):
    """Causal grouped-query attention: query group ``g`` is kv head ``g`` and query heads ``[g*n_rep, (g+1)*n_rep)``."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.head_dim, self.n_rep = cfg.hd, cfg.n_head // cfg.n_kv_head
        d, q_width, kv_width = cfg.d_model, cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim
        self.q_proj, self.k_proj = nn.Linear(d, q_width, bias=cfg.bias), nn.Linear(d, kv_width, bias=cfg.bias)
        self.v_proj, self.o_proj = nn.Linear(d, kv_width, bias=cfg.bias), nn.Linear(q_width, d, bias=cfg.bias)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        """``(B, T, d) -> (B, T, d)``; ``rope`` stacks ``cos`` and ``sin``, shape ``(2, T, hd)``."""
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        half = self.head_dim // 2  # RoPE, rotate-half convention; it never mixes heads
        q, k = (t * rope[0] + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * rope[1] for t in (q, k))
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)  # kv head g -> group g
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = (nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) for _ in range(2))
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, T, d) -> (B, T, d)``."""
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.d_model, eps=1e-6), Attention(cfg)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.d_model, eps=1e-6), MLP(cfg)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        """``(B, T, d) -> (B, T, d)``."""
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A small GPT-style causal language model (see the module docstring for parameter names).

    Args:
        cfg: The sizes; defaults to ``TinyGPTConfig()``.

    Example::

        >>> model = TinyGPT(TinyGPTConfig(vocab_size=32, d_model=16, d_ff=32, max_seq_len=8))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or TinyGPTConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        hd = cfg.hd
        inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("rope", torch.stack((freqs.cos(), freqs.sin())), persistent=False)  # (2, T, hd)
        for module in self.modules():  # GPT-2 style init: N(0, 0.02) weights, zero biases, unit norm weights
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, V)``.

        Raises:
            ValueError: If ``T`` exceeds ``max_seq_len``.
        """
        if (seq_len := idx.shape[1]) > self.config.max_seq_len:
            raise ValueError(f"Sequence length {seq_len} exceeds `max_seq_len` ({self.config.max_seq_len}).")
        x = self.embed(idx)
        for block in self.layers:
            x = block(x, self.rope[:, :seq_len].to(x.dtype))
        return self.lm_head(self.norm(x))
