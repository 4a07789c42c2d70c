"""``nn.MultiheadAttention`` with an inner width of ``num_heads * head_dim``: :class:`HeadsMultiheadAttention`.

See :mod:`lightning_pat.heads.replace` for why and when the shrink puts it in place of the stock module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pat.heads.parts import move_hooks


def mha_refusal(module: nn.Module) -> str | None:
    """Why the heads of an ``nn.MultiheadAttention`` cannot be shrunk (its configuration), or ``None`` if they can.

    Args:
        module: Any module.

    Returns:
        ``None`` for a supported ``nn.MultiheadAttention`` or a :class:`HeadsMultiheadAttention`; else the reason
        (also for modules that are no multi-head attention at all).
    """
    if isinstance(module, HeadsMultiheadAttention):
        return None
    if not isinstance(module, nn.MultiheadAttention):
        return f"{type(module).__name__} is not nn.MultiheadAttention"
    if type(module).forward is not nn.MultiheadAttention.forward:
        return f"{type(module).__name__} overrides nn.MultiheadAttention.forward"
    if not module._qkv_same_embed_dim:  # noqa: SLF001 - the stock flag for kdim/vdim != embed_dim
        return "kdim or vdim differs from embed_dim (separate q/k/v projections)"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True (learned key/value biases appended to the sequence)"
    if module.add_zero_attn:
        return "add_zero_attn=True"
    if module.in_proj_weight is None or module.in_proj_weight.dim() != 2:
        return "no packed in_proj_weight"
    return None


class HeadsMultiheadAttention(nn.Module):
    """Self-attention with ``nn.MultiheadAttention``'s parameters and an inner width of ``num_heads * head_dim``.

    ``in_proj_weight`` is ``[3 * num_heads * head_dim, embed_dim]`` (q, k, v rows, head by head), ``out_proj`` is an
    ``nn.Linear(num_heads * head_dim, embed_dim)``. With ``num_heads * head_dim == embed_dim`` it computes what
    ``nn.MultiheadAttention`` computes for the calls it supports (see the module docstring).

    Args:
        embed_dim: The model width (input and output).
        num_heads: Number of heads.
        head_dim: Width of one head.
        bias: Whether ``in_proj_bias`` and ``out_proj.bias`` exist.
        dropout: Dropout on the attention weights (training only).
        batch_first: Inputs and outputs are ``(batch, seq, feature)`` (else ``(seq, batch, feature)``).
        device: Where the parameters are allocated.
        dtype: Their dtype.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.dropout, self.batch_first = dropout, batch_first
        inner = num_heads * head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, embed_dim, device=device, dtype=dtype))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner, device=device, dtype=dtype))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias, device=device, dtype=dtype)
        # read by nn.TransformerEncoderLayer: False keeps it off its fused path, which assumes embed_dim-wide heads
        self._qkv_same_embed_dim = False
        if device is None or torch.device(device).type != "meta":
            nn.init.xavier_uniform_(self.in_proj_weight)

    @classmethod
    def adopt(cls, mha: nn.Module) -> HeadsMultiheadAttention:
        """A module that holds ``mha``'s parameters and ``out_proj`` themselves (whatever their rows now are).

        Args:
            mha: A supported ``nn.MultiheadAttention`` (see :func:`mha_refusal`) or a :class:`HeadsMultiheadAttention`.

        Returns:
            The new module; the head count is the packed projection's rows over ``3 * head_dim``.

        Raises:
            ValueError: If ``mha`` is not supported or its rows are not whole heads.
        """
        refusal = mha_refusal(mha)
        if refusal is not None or not isinstance(mha, (nn.MultiheadAttention, HeadsMultiheadAttention)):
            raise ValueError(f"HeadsMultiheadAttention: cannot adopt {type(mha).__name__}: {refusal}.")
        head_dim = int(mha.head_dim)
        rows = mha.in_proj_weight.shape[0]
        if rows % (3 * head_dim):
            raise ValueError(f"HeadsMultiheadAttention: {rows} in_proj rows are not whole heads of {head_dim}.")
        new = cls(
            int(mha.embed_dim), rows // (3 * head_dim), head_dim, bias=mha.in_proj_bias is not None,
            dropout=float(mha.dropout), batch_first=bool(mha.batch_first), device="meta",
        )  # fmt: skip
        new.in_proj_weight = mha.in_proj_weight
        new.in_proj_bias = mha.in_proj_bias
        new.out_proj = mha.out_proj
        move_hooks(mha, new)
        return new

    def extra_repr(self) -> str:
        """The sizes, for ``print(model)``."""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"batch_first={self.batch_first}"
        )

    @staticmethod
    def call_refusal(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> str | None:
        """Why a call cannot be computed with fewer heads, or ``None``.

        Supported: batched self-attention, with a 2-D ``attn_mask`` ``(L, L)`` (shared by every head), a
        ``key_padding_mask`` ``(B, L)``, bool or float, and ``is_causal`` (with the mask torch requires with it).
        """
        if query is not key or key is not value:
            return "called as cross-attention (query, key and value are not one tensor)"
        if query.dim() != 3:
            return f"called with unbatched input (a {query.dim()}-D query)"
        for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if mask is not None and mask.dtype != torch.bool and not torch.is_floating_point(mask):
                return f"called with a {mask.dtype} {name} (torch takes bool or floating masks)"
        if attn_mask is not None and attn_mask.dim() != 2:
            return (
                f"called with a {attn_mask.dim()}-D attn_mask (one mask per batch entry and head; which of the "
                "original heads were kept is not known to the module: pass a 2-D mask shared by every head)"
            )
        if is_causal and attn_mask is None:
            return "called with is_causal=True without an attn_mask (torch requires the causal mask with it)"
        return None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``nn.MultiheadAttention``'s call for self-attention: ``(output, weights or None)``.

        Masks as torch applies them: a bool mask is ``-inf`` where ``True``, a float mask is added to the logits; the
        key padding mask is added to the attention mask; ``is_causal`` makes ``scaled_dot_product_attention`` causal
        (its ``attn_mask`` then ignored) when there is no key padding mask and no weights are asked for, else the
        ``attn_mask`` passed with it is used.

        Raises:
            ValueError: If the call is not supported (see :meth:`call_refusal`), or its masks do not fit the input,
                and the heads were cut.
        """
        refusal = self.call_refusal(
            query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal
        )
        x = query if self.batch_first or refusal is not None else query.transpose(0, 1)
        if refusal is None:
            refusal = self._mask_misfit(x.shape[0], x.shape[1], attn_mask, key_padding_mask)
        if refusal is not None:
            return self._stock(refusal, query, key, value, key_padding_mask, need_weights, attn_mask,
                               average_attn_weights, is_causal)  # fmt: skip
        batch, length = x.shape[0], x.shape[1]
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        qkv = qkv.reshape(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None if causal else _additive(attn_mask, q.dtype)  # [L, S]
        if mask is not None:
            mask = mask[None, None]  # [1, 1, L, S]: every batch entry and head
        padding = _additive(key_padding_mask, q.dtype)  # [B, S]
        if padding is not None:
            padding = padding[:, None, None, :]  # [B, 1, 1, S]
            mask = padding if mask is None else mask + padding
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / self.head_dim), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            attn = F.dropout(F.softmax(scores, dim=-1), p, self.training)  # returned after dropout, as torch does
            weights = attn.mean(dim=1) if average_attn_weights else attn
            out = torch.matmul(attn, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    @staticmethod
    def _mask_misfit(batch: int, length: int, attn_mask: Tensor | None, padding: Tensor | None) -> str | None:
        """Why the masks do not fit a ``[batch, length]`` input (torch's own function then says so), or ``None``."""
        if attn_mask is not None and tuple(attn_mask.shape) != (length, length):
            return f"called with an attn_mask of shape {tuple(attn_mask.shape)} for a sequence of {length}"
        if padding is not None and tuple(padding.shape) != (batch, length):
            return f"called with a key_padding_mask of shape {tuple(padding.shape)} for input {batch} x {length}"
        return None

    def _stock(self, refusal: str, *args: Any) -> tuple[Tensor, Tensor | None]:
        """A call :meth:`forward` does not support, computed by torch's own function while no head was cut."""
        self.refused_call = refusal  # read by discovery (lightning_pat.discovery.trace)
        if self.num_heads * self.head_dim != self.embed_dim:
            raise ValueError(
                f"HeadsMultiheadAttention: {refusal}, which is not supported with cut heads ({self.num_heads} heads "
                f"of {self.head_dim}, embed_dim {self.embed_dim}); call it as batched self-attention with at most a "
                "2-D attn_mask of (L, L), a key_padding_mask of (B, L) and is_causal (with its mask), as discovery "
                "saw it called."
            )
        query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal = args
        if self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        out, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, None, None,
            False, self.dropout, self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average, is_causal=is_causal,
        )  # fmt: skip
        return (out.transpose(0, 1) if self.batch_first else out), weights


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A mask as torch adds it to the logits: a bool mask is ``-inf`` where ``True``, a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
