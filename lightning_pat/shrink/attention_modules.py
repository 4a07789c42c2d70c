"""Attention modules whose inner width is ``num_heads * head_dim``, for attention the shrink cannot rewrite in place.

Four stock modules compute their head width from another width, so they cannot run with fewer heads:

* ``nn.MultiheadAttention`` computes q, k and v at ``embed_dim`` from its packed ``in_proj_weight`` (``head_dim =
  embed_dim // num_heads``, and ``out_proj`` reads ``embed_dim`` columns);
* torchvision's Swin ``ShiftedWindowAttention`` derives ``head_dim`` as ``C // num_heads`` from its input width and
  reads a per-head relative position bias table ``(entries, num_heads)``;
* torchvision's Swin V2 ``ShiftedWindowAttentionV2`` derives ``head_dim`` the same way and has per-head parameters of
  its own: the logit scale of its cosine attention ``[num_heads, 1, 1]`` and the last ``Linear`` of its continuous
  position bias MLP (``cpb_mlp``, one row per head);
* torchvision's MaxViT ``RelativePositionalMultiHeadAttention`` puts its heads back side by side at its input width
  (``reshape(B, G, P, D)`` before ``merge``) and reads a per-head relative position bias table ``(entries,
  n_heads)``.

:class:`HeadsMultiheadAttention`, :class:`WindowAttention`, :class:`WindowAttentionV2` and :class:`MaxVitAttention`
compute the same functions with the head count and the head dim held explicitly; their parameters and buffers have
the stock names (``in_proj_weight``, ``in_proj_bias``, ``out_proj.*``; ``qkv.*``, ``proj.*``,
``relative_position_bias_table``; ``logit_scale``, ``cpb_mlp.*``, ``relative_coords_table``; ``to_qkv.*``,
``merge.*``, ``relative_position_index``), so state dicts stay compatible. When the shrink cuts heads
of such a module (:mod:`lightning_pat.shrink.surgery`), :func:`replace_attention` puts one of these in its place,
holding the very same ``nn.Parameter`` objects (now smaller). Discovery traces a model with its supported stock
modules replaced the same way (:func:`replace_attention` on its meta copy, :mod:`lightning_pat.discovery.trace`), so
it sees where the heads are; a per-head parameter used directly in a forward (V2's ``logit_scale``) is declared in
``per_head_parameters``, which discovery reads.

Supported: ``nn.MultiheadAttention`` (exactly that class) with ``kdim == vdim == embed_dim``, no ``add_bias_kv``, no
``add_zero_attn``, called as batched self-attention (``query is key is value``; torchvision's ViT calls
``attn(x, x, x, need_weights=False)``), with or without a 2-D ``attn_mask`` ``(L, L)``, a ``key_padding_mask``
``(B, L)`` (bool or float) and ``is_causal``, computed as torch computes them; a 3-D ``attn_mask`` (one per batch
entry and head) is not, since the module does not know which of the original heads it kept. With
``need_weights=True`` the weights returned are those of the kept heads. torchvision's ``ShiftedWindowAttention``,
``ShiftedWindowAttentionV2`` and ``RelativePositionalMultiHeadAttention`` (exactly those classes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The window attention class of torchvision's Swin V1 that :class:`WindowAttention` reproduces.
SWIN_ATTENTION = ("torchvision.models.swin_transformer", "ShiftedWindowAttention")
#: The window attention class of torchvision's Swin V2 that :class:`WindowAttentionV2` reproduces.
SWIN_V2_ATTENTION = ("torchvision.models.swin_transformer", "ShiftedWindowAttentionV2")
#: The partition attention class of torchvision's MaxViT that :class:`MaxVitAttention` reproduces.
MAXVIT_ATTENTION = ("torchvision.models.maxvit", "RelativePositionalMultiHeadAttention")


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


def is_swin_attention(module: nn.Module) -> bool:
    """Whether ``module`` is torchvision's Swin V1 ``ShiftedWindowAttention`` (exactly that class) or ours."""
    if isinstance(module, WindowAttention):
        return True
    cls = type(module)
    return (cls.__module__, cls.__name__) == SWIN_ATTENTION and all(
        isinstance(getattr(module, a, None), nn.Linear) for a in ("qkv", "proj")
    )


def is_swin_v2_attention(module: nn.Module) -> bool:
    """Whether ``module`` is torchvision's Swin V2 ``ShiftedWindowAttentionV2`` (exactly that class) or ours."""
    if isinstance(module, WindowAttentionV2):
        return True
    cls = type(module)
    if (cls.__module__, cls.__name__) != SWIN_V2_ATTENTION:
        return False
    mlp = getattr(module, "cpb_mlp", None)
    return (
        all(isinstance(getattr(module, a, None), nn.Linear) for a in ("qkv", "proj"))
        and isinstance(getattr(module, "logit_scale", None), nn.Parameter)
        and isinstance(mlp, nn.Sequential)
        and len(mlp) > 0
        and isinstance(mlp[-1], nn.Linear)
    )


def is_maxvit_attention(module: nn.Module) -> bool:
    """Whether ``module`` is torchvision's MaxViT ``RelativePositionalMultiHeadAttention`` (exactly it) or ours."""
    if isinstance(module, MaxVitAttention):
        return True
    cls = type(module)
    return (
        (cls.__module__, cls.__name__) == MAXVIT_ATTENTION
        and all(isinstance(getattr(module, a, None), nn.Linear) for a in ("to_qkv", "merge"))
        and isinstance(getattr(module, "relative_position_bias_table", None), nn.Parameter)
        and isinstance(getattr(module, "relative_position_index", None), Tensor)
        and isinstance(getattr(module, "max_seq_len", None), int)
        and isinstance(getattr(module, "scale_factor", None), float)
    )


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """``new`` takes over the hooks registered on ``old`` and its training flag."""
    for attr in (
        "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
    ):  # fmt: skip
        if attr in old.__dict__:
            new.__dict__[attr] = old.__dict__[attr]
    new.train(old.training)


# ---------------------------------------------------------------------------------------------------- MHA
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
        if refusal is not None:
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
        _move_hooks(mha, new)
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


# ---------------------------------------------------------------------------------------------------- Swin
class _ShiftedWindows(nn.Module):
    """What Swin V1 and V2 window attention share: windows, cyclic shift, its mask, qkv and proj.

    Subclasses give the attention logits of one window (:meth:`logits`) and the q, k, v projection (:meth:`project`).
    """

    def __init__(
        self,
        dim: int,
        window_size: Sequence[int],
        shift_size: Sequence[int],
        num_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        proj_bias: bool,
        attention_dropout: float,
        dropout: float,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.window_size, self.shift_size = list(window_size), list(shift_size)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.attention_dropout, self.dropout = attention_dropout, dropout
        inner = num_heads * head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias, device=device)
        self.proj = nn.Linear(inner, dim, bias=proj_bias, device=device)

    def extra_repr(self) -> str:
        """The sizes, for ``print(model)``."""
        return f"window_size={self.window_size}, shift_size={self.shift_size}, num_heads={self.num_heads}, " + (
            f"head_dim={self.head_dim}"
        )

    def project(self, windows: Tensor) -> Tensor:
        """q, k and v of ``[windows * B, N, C]`` (V1: ``qkv`` itself, its hooks run)."""
        return self.qkv(windows)

    def logits(self, q: Tensor, k: Tensor) -> Tensor:
        """Attention logits ``[B * windows, heads, N, N]`` of queries and keys ``[B * windows, heads, N, D]``."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """``[B, H, W, C]`` -> ``[B, H, W, C]``."""
        batch, height, width, channels = x.shape
        wh, ww = self.window_size
        x = F.pad(x, (0, 0, 0, (-width) % ww, 0, (-height) % wh))
        ph, pw = x.shape[1], x.shape[2]
        sh = 0 if wh >= ph else self.shift_size[0]
        sw = 0 if ww >= pw else self.shift_size[1]
        shifted = sh + sw > 0
        if shifted:
            x = torch.roll(x, shifts=(-sh, -sw), dims=(1, 2))
        rows, cols, n = ph // wh, pw // ww, wh * ww
        windows = x.reshape(batch, rows, wh, cols, ww, channels).permute(0, 1, 3, 2, 4, 5)
        windows = windows.reshape(batch * rows * cols, n, channels)
        qkv = self.project(windows).reshape(-1, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = self.logits(q, k)
        if shifted:
            mask = _shift_mask(ph, pw, wh, ww, sh, sw, x)
            attn = attn.reshape(batch, rows * cols, self.num_heads, n, n) + mask[None, :, None]
            attn = attn.reshape(-1, self.num_heads, n, n)
        attn = F.dropout(F.softmax(attn, dim=-1), p=self.attention_dropout, training=self.training)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(-1, n, self.num_heads * self.head_dim)
        out = F.dropout(self.proj(out), p=self.dropout, training=self.training)
        out = out.reshape(batch, rows, cols, wh, ww, channels).permute(0, 1, 3, 2, 4, 5)
        out = out.reshape(batch, ph, pw, channels)
        if shifted:
            out = torch.roll(out, shifts=(sh, sw), dims=(1, 2))
        return out[:, :height, :width, :].contiguous()


class WindowAttention(_ShiftedWindows):
    """Swin's (shifted) window attention with a relative position bias, ``num_heads`` heads of ``head_dim``.

    Computes what torchvision's ``shifted_window_attention`` computes for its ``ShiftedWindowAttention`` (pad to
    whole windows, cyclic shift, attention inside each window with the bias of the relative positions, the shifted
    regions masked with -100, shift back, crop), with the head dim held explicitly instead of ``C // num_heads``.
    ``qkv`` is ``nn.Linear(dim, 3 * num_heads * head_dim)``, ``proj`` is ``nn.Linear(num_heads * head_dim, dim)``,
    ``relative_position_bias_table`` is ``[(2 * Wh - 1) * (2 * Ww - 1), num_heads]``.

    Args:
        dim: Input and output width.
        window_size: ``[Wh, Ww]``.
        shift_size: ``[Sh, Sw]`` (a shift is dropped along an axis the padded input fits in one window).
        num_heads: Number of heads.
        head_dim: Width of one head.
        qkv_bias: Whether ``qkv`` has a bias.
        proj_bias: Whether ``proj`` has a bias.
        attention_dropout: Dropout on the attention weights (training only).
        dropout: Dropout on the output (training only).
        device: Where the parameters are allocated.
    """

    def __init__(
        self,
        dim: int,
        window_size: Sequence[int],
        shift_size: Sequence[int],
        num_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            dim, window_size, shift_size, num_heads, head_dim, qkv_bias=qkv_bias, proj_bias=proj_bias,
            attention_dropout=attention_dropout, dropout=dropout, device=device,
        )  # fmt: skip
        wh, ww = self.window_size
        entries = (2 * wh - 1) * (2 * ww - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(entries, num_heads, device=device))
        if device is None or torch.device(device).type != "meta":
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", _relative_index(wh, ww, device))

    @classmethod
    def adopt(cls, attn: nn.Module) -> WindowAttention:
        """A module that holds ``attn``'s parameters, submodules and index buffer themselves.

        Args:
            attn: torchvision's ``ShiftedWindowAttention`` or a :class:`WindowAttention`, its heads possibly cut.

        Returns:
            The new module; the head count is the bias table's columns, the head dim ``qkv`` rows over 3 heads.

        Raises:
            ValueError: If ``attn`` is not such a module or its widths are not whole heads.
        """
        if not is_swin_attention(attn):
            raise ValueError(f"WindowAttention: cannot adopt {type(attn).__name__}.")
        heads = int(attn.relative_position_bias_table.shape[1])
        rows, inner = attn.qkv.out_features, attn.proj.in_features
        if heads < 1 or rows != 3 * inner or inner % heads:
            raise ValueError(
                f"WindowAttention: qkv rows {rows}, proj columns {inner} and {heads} heads are not whole heads."
            )
        new = cls(
            attn.qkv.in_features, attn.window_size, attn.shift_size, heads, inner // heads,
            qkv_bias=attn.qkv.bias is not None, proj_bias=attn.proj.bias is not None,
            attention_dropout=float(attn.attention_dropout), dropout=float(attn.dropout), device="meta",
        )  # fmt: skip
        new.qkv, new.proj = attn.qkv, attn.proj
        new.relative_position_bias_table = attn.relative_position_bias_table
        new.relative_position_index = attn.relative_position_index
        _move_hooks(attn, new)
        return new

    def position_bias(self) -> Tensor:
        """The relative position bias of one window, ``[1, num_heads, N, N]`` (``N = Wh * Ww``)."""
        n = self.window_size[0] * self.window_size[1]
        bias = F.embedding(self.relative_position_index.reshape(-1), self.relative_position_bias_table)
        return bias.reshape(n, n, self.num_heads).permute(2, 0, 1).unsqueeze(0)

    def logits(self, q: Tensor, k: Tensor) -> Tensor:
        """Scaled dot products plus the relative position bias."""
        return torch.matmul(q * self.head_dim**-0.5, k.transpose(-2, -1)) + self.position_bias()


class WindowAttentionV2(_ShiftedWindows):
    """Swin V2's (shifted) window attention: cosine attention with a per-head logit scale and a continuous bias.

    Computes what torchvision's ``shifted_window_attention`` computes for its ``ShiftedWindowAttentionV2``: the
    windows, shift and mask of :class:`WindowAttention`; logits ``normalize(q) @ normalize(k)^T`` times
    ``exp(min(logit_scale, log 100))`` per head, plus ``16 * sigmoid`` of the bias that the MLP ``cpb_mlp``
    (``Linear(2, 512)``, ReLU, ``Linear(512, num_heads, bias=False)``) computes from ``relative_coords_table`` and
    ``relative_position_index`` picks; the k part of ``qkv``'s bias is not added (it is left in the parameter, as
    torchvision leaves it). The head dim is held explicitly instead of ``C // num_heads``. Per head: q, k and v rows of
    ``qkv`` (and their bias entries), ``proj`` columns, the entry of ``logit_scale`` (``[num_heads, 1, 1]``) and the
    row of ``cpb_mlp``'s last ``Linear``.

    Discovery traces a meta copy of this module with :attr:`traced` set: the k bias is then added like the q and v
    biases, so that the whole bias reaches ``linear``'s bias slot and its k entries join their heads (the shrink cuts
    them with their rows); only shapes and the flow of channels are traced, never values.

    Args:
        dim: Input and output width.
        window_size: ``[Wh, Ww]``.
        shift_size: ``[Sh, Sw]`` (a shift is dropped along an axis the padded input fits in one window).
        num_heads: Number of heads.
        head_dim: Width of one head.
        qkv_bias: Whether ``qkv`` has a bias (its k part starts at zero).
        proj_bias: Whether ``proj`` has a bias.
        attention_dropout: Dropout on the attention weights (training only).
        dropout: Dropout on the output (training only).
        cpb_hidden: Width of ``cpb_mlp``'s hidden layer (torchvision: 512).
        device: Where the parameters are allocated.
    """

    #: Parameter -> its head axis, for parameters used directly in the forward (discovery makes them members).
    per_head_parameters: ClassVar[dict[str, int]] = {"logit_scale": 0}

    def __init__(
        self,
        dim: int,
        window_size: Sequence[int],
        shift_size: Sequence[int],
        num_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        cpb_hidden: int = 512,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            dim, window_size, shift_size, num_heads, head_dim, qkv_bias=qkv_bias, proj_bias=proj_bias,
            attention_dropout=attention_dropout, dropout=dropout, device=device,
        )  # fmt: skip
        self.traced = False
        wh, ww = self.window_size
        self.register_buffer("relative_coords_table", _coords_table(wh, ww, device))
        self.register_buffer("relative_position_index", _relative_index(wh, ww, device))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(num_heads, 1, 1, device=device)))
        self.cpb_mlp = nn.Sequential(
            nn.Linear(2, cpb_hidden, device=device),
            nn.ReLU(inplace=True),
            nn.Linear(cpb_hidden, num_heads, bias=False, device=device),
        )
        if self.qkv.bias is not None:
            with torch.no_grad():
                self.qkv.bias[num_heads * head_dim : 2 * num_heads * head_dim].zero_()

    @classmethod
    def adopt(cls, attn: nn.Module) -> WindowAttentionV2:
        """A module that holds ``attn``'s parameters, submodules and buffers themselves.

        Args:
            attn: torchvision's ``ShiftedWindowAttentionV2`` or a :class:`WindowAttentionV2`, its heads possibly cut.

        Returns:
            The new module; the head count is ``logit_scale``'s length, the head dim ``proj``'s columns per head.

        Raises:
            ValueError: If ``attn`` is not such a module or its widths are not whole heads.
        """
        if not is_swin_v2_attention(attn):
            raise ValueError(f"WindowAttentionV2: cannot adopt {type(attn).__name__}.")
        heads = int(attn.logit_scale.shape[0])
        rows, inner = attn.qkv.out_features, attn.proj.in_features
        last = attn.cpb_mlp[-1]
        if (
            heads < 1 or rows != 3 * inner or inner % heads or tuple(attn.logit_scale.shape) != (heads, 1, 1)
            or last.out_features != heads
        ):  # fmt: skip
            raise ValueError(
                f"WindowAttentionV2: qkv rows {rows}, proj columns {inner}, logit_scale {tuple(attn.logit_scale.shape)}"
                f" and cpb_mlp's last rows {last.out_features} are not whole heads of one head count."
            )
        new = cls(
            attn.qkv.in_features, attn.window_size, attn.shift_size, heads, inner // heads,
            qkv_bias=attn.qkv.bias is not None, proj_bias=attn.proj.bias is not None,
            attention_dropout=float(attn.attention_dropout), dropout=float(attn.dropout),
            cpb_hidden=last.in_features, device="meta",
        )  # fmt: skip
        new.qkv, new.proj, new.cpb_mlp = attn.qkv, attn.proj, attn.cpb_mlp
        new.logit_scale = attn.logit_scale
        new.relative_coords_table = attn.relative_coords_table
        new.relative_position_index = attn.relative_position_index
        new.traced = bool(getattr(attn, "traced", False))
        _move_hooks(attn, new)
        return new

    def project(self, windows: Tensor) -> Tensor:
        """q, k and v, with ``qkv``'s weight and its bias without the k part (the whole bias while :attr:`traced`).

        As torchvision does, ``qkv``'s weight and bias are used directly (its forward hooks do not run).
        """
        bias = self.qkv.bias
        if bias is not None and not self.traced:
            inner = self.num_heads * self.head_dim
            bias = torch.cat((bias[:inner], torch.zeros_like(bias[inner : 2 * inner]), bias[2 * inner :]))
        return F.linear(windows, self.qkv.weight, bias)

    def position_bias(self) -> Tensor:
        """The continuous relative position bias of one window, ``[1, num_heads, N, N]`` (``N = Wh * Ww``)."""
        n = self.window_size[0] * self.window_size[1]
        table = self.cpb_mlp(self.relative_coords_table).reshape(-1, self.num_heads)
        bias = table.index_select(0, self.relative_position_index.reshape(-1))
        bias = bias.reshape(n, n, self.num_heads).permute(2, 0, 1).contiguous().unsqueeze(0)
        return 16 * torch.sigmoid(bias)

    def logits(self, q: Tensor, k: Tensor) -> Tensor:
        """Cosine similarities times the per-head scale, plus the continuous position bias."""
        attn = torch.matmul(F.normalize(q, dim=-1), F.normalize(k, dim=-1).transpose(-2, -1))
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        return attn + self.position_bias()


# ---------------------------------------------------------------------------------------------------- MaxViT
class MaxVitAttention(nn.Module):
    """MaxViT's attention inside a block or grid partition, ``n_heads`` heads of ``head_dim``, relative position bias.

    Computes what torchvision's ``RelativePositionalMultiHeadAttention`` computes on ``[B, G, P, D]`` (``G``
    partitions of ``P = size**2`` positions): q, k and v are the three equal parts of ``to_qkv``'s output, k is scaled
    by ``feat_dim ** -0.5`` (the input width: the scale stays what it was when heads are cut), the logits get the
    per-head bias that ``relative_position_index`` picks from ``relative_position_bias_table``, and the heads are put
    back side by side at ``n_heads * head_dim`` (torchvision reshapes them to the input width, which holds only while
    no head is cut) for ``merge``. ``to_qkv`` is ``nn.Linear(feat_dim, 3 * n_heads * head_dim)``, ``merge`` is
    ``nn.Linear(n_heads * head_dim, feat_dim)``, ``relative_position_bias_table`` is ``[(2 * size - 1) ** 2,
    n_heads]``. Per head: its q, k and v rows of ``to_qkv`` (and their bias entries), ``merge`` columns and the bias
    table's column.

    Args:
        feat_dim: Input and output width.
        n_heads: Number of heads.
        head_dim: Width of one head.
        max_seq_len: Positions of one partition (a square: ``size**2``).
        device: Where the parameters are allocated.
    """

    def __init__(
        self, feat_dim: int, n_heads: int, head_dim: int, max_seq_len: int, *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.size, self.max_seq_len = math.isqrt(max_seq_len), max_seq_len
        self.scale_factor = feat_dim**-0.5
        inner = n_heads * head_dim
        self.to_qkv = nn.Linear(feat_dim, 3 * inner, device=device)
        self.merge = nn.Linear(inner, feat_dim, device=device)
        entries = (2 * self.size - 1) ** 2
        self.relative_position_bias_table = nn.Parameter(torch.zeros(entries, n_heads, device=device))
        if device is None or torch.device(device).type != "meta":
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        index = _relative_index(self.size, self.size, device).reshape(max_seq_len, max_seq_len)
        self.register_buffer("relative_position_index", index)

    @classmethod
    def adopt(cls, attn: nn.Module) -> MaxVitAttention:
        """A module that holds ``attn``'s parameters, submodules, index buffer and scale themselves.

        Args:
            attn: torchvision's ``RelativePositionalMultiHeadAttention`` or a :class:`MaxVitAttention`, its heads
                possibly cut.

        Returns:
            The new module; the head count is the bias table's columns, the head dim ``merge``'s columns per head.

        Raises:
            ValueError: If ``attn`` is not such a module or its widths are not whole heads.
        """
        if not is_maxvit_attention(attn):
            raise ValueError(f"MaxVitAttention: cannot adopt {type(attn).__name__}.")
        heads = int(attn.relative_position_bias_table.shape[1])
        rows, inner = attn.to_qkv.out_features, attn.merge.in_features
        if heads < 1 or rows != 3 * inner or inner % heads:
            raise ValueError(
                f"MaxVitAttention: to_qkv rows {rows}, merge columns {inner} and {heads} heads (bias table columns) "
                "are not whole heads of one head count."
            )
        new = cls(attn.to_qkv.in_features, heads, inner // heads, int(attn.max_seq_len), device="meta")
        new.scale_factor = float(attn.scale_factor)
        new.to_qkv, new.merge = attn.to_qkv, attn.merge
        new.relative_position_bias_table = attn.relative_position_bias_table
        new.relative_position_index = attn.relative_position_index
        _move_hooks(attn, new)
        return new

    def extra_repr(self) -> str:
        """The sizes, for ``print(model)``."""
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, max_seq_len={self.max_seq_len}"

    def position_bias(self) -> Tensor:
        """The relative position bias of one partition, ``[1, n_heads, P, P]``."""
        bias = F.embedding(self.relative_position_index.reshape(-1), self.relative_position_bias_table)
        return bias.reshape(self.max_seq_len, self.max_seq_len, self.n_heads).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, G, P, feat_dim]`` -> ``[B, G, P, feat_dim]``."""
        batch, groups, length, _ = x.shape
        heads, hd = self.n_heads, self.head_dim
        q, k, v = (
            t.reshape(batch, groups, length, heads, hd).permute(0, 1, 3, 2, 4)
            for t in torch.chunk(self.to_qkv(x), 3, dim=-1)
        )
        k = k * self.scale_factor
        attn = F.softmax(torch.matmul(q, k.transpose(-2, -1)) + self.position_bias(), dim=-1)
        out = torch.matmul(attn, v).permute(0, 1, 3, 2, 4).reshape(batch, groups, length, heads * hd)
        return self.merge(out)


def _coords_table(wh: int, ww: int, device: torch.device | str | None) -> Tensor:
    """``[1, 2Wh-1, 2Ww-1, 2]``: each relative offset scaled to [-8, 8], then ``sign * log2(|.| + 1) / 3``."""
    dy = torch.arange(-(wh - 1), wh, dtype=torch.float32) / (wh - 1)
    dx = torch.arange(-(ww - 1), ww, dtype=torch.float32) / (ww - 1)
    table = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1).unsqueeze(0) * 8
    return (torch.sign(table) * torch.log2(table.abs() + 1.0) / 3.0).to(device)


def _relative_index(wh: int, ww: int, device: torch.device | str | None) -> Tensor:
    """Index into the bias table of every (query, key) pair of a window, flattened (``N * N``)."""
    ys, xs = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[:, None] - ys[None, :] + (wh - 1)
    dx = xs[:, None] - xs[None, :] + (ww - 1)
    return (dy * (2 * ww - 1) + dx).flatten().to(device)


def _regions(size: int, window: int, shift: int) -> Tensor:
    """The region of each position along one axis after a cyclic shift: 0, 1 (last window), 2 (wrapped in)."""
    pos = torch.arange(size)
    return (pos >= size - window).long() + (pos >= size - shift).long()


def _shift_mask(ph: int, pw: int, wh: int, ww: int, sh: int, sw: int, like: Tensor) -> Tensor:
    """``[windows, N, N]``: 0 where two positions of a window came from one region, -100 where not."""
    region = _regions(ph, wh, sh)[:, None] * 3 + _regions(pw, ww, sw)[None, :]
    region = region.reshape(ph // wh, wh, pw // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)
    differs = region[:, :, None] != region[:, None, :]
    return torch.where(differs, -100.0, 0.0).to(device=like.device, dtype=like.dtype)


# ---------------------------------------------------------------------------------------------------- swapping
def _replacement(module: nn.Module) -> nn.Module | None:
    """Our module in place of a supported stock one (``None``: not one, unsupported, or ours: its counts updated)."""
    if isinstance(module, HeadsMultiheadAttention):
        module.num_heads = module.in_proj_weight.shape[0] // (3 * module.head_dim)
        return None
    if isinstance(module, WindowAttention):
        module.num_heads = int(module.relative_position_bias_table.shape[1])
        module.head_dim = module.proj.in_features // max(1, module.num_heads)
        return None
    if isinstance(module, WindowAttentionV2):
        module.num_heads = int(module.logit_scale.shape[0])
        module.head_dim = module.proj.in_features // max(1, module.num_heads)
        return None
    if isinstance(module, MaxVitAttention):
        module.n_heads = int(module.relative_position_bias_table.shape[1])
        module.head_dim = module.merge.in_features // max(1, module.n_heads)
        return None
    if isinstance(module, nn.MultiheadAttention) and mha_refusal(module) is None:
        return HeadsMultiheadAttention.adopt(module)
    if is_swin_attention(module):
        return WindowAttention.adopt(module)
    if is_swin_v2_attention(module):
        return WindowAttentionV2.adopt(module)
    if is_maxvit_attention(module):
        return MaxVitAttention.adopt(module)
    return None


def replace_attention(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> dict[str, nn.Module]:
    """Put our module in place of every supported stock attention module (of ``modules``, if given).

    The replacement holds the same parameter objects, so optimizers and tied weights are unaffected; it is set on
    every parent that registers the old module.

    Args:
        model: The model (never replaced itself).
        modules: Only these modules (default: every supported one).

    Returns:
        Module name -> the new module, for every module replaced (modules of ours have their head counts updated
        from their parameters instead).
    """
    wanted = None if modules is None else {id(m) for m in modules}
    done: dict[int, nn.Module] = {}
    names: dict[str, nn.Module] = {}
    for name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):  # noqa: SLF001 - every registration, duplicates too
            if child is None or (wanted is not None and id(child) not in wanted):
                continue
            new = done.get(id(child))
            if new is None:
                new = _replacement(child)
                if new is None:
                    continue
                done[id(child)] = new
            parent._modules[child_name] = new  # noqa: SLF001 - keeps the child's position
            names[f"{name}.{child_name}" if name else child_name] = new
    return names
