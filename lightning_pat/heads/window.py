"""torchvision's Swin V1 and V2 window attention with explicit heads: WindowAttention and WindowAttentionV2.

See :mod:`lightning_pat.heads.replace` for why and when the shrink puts them in place of the stock modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pat.heads.parts import move_hooks, relative_index

#: The window attention class of torchvision's Swin V1 that :class:`WindowAttention` reproduces.
SWIN_ATTENTION = ("torchvision.models.swin_transformer", "ShiftedWindowAttention")
#: The window attention class of torchvision's Swin V2 that :class:`WindowAttentionV2` reproduces.
SWIN_V2_ATTENTION = ("torchvision.models.swin_transformer", "ShiftedWindowAttentionV2")


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


class _ShiftedWindows(nn.Module):
    """What Swin V1 and V2 window attention share: windows, cyclic shift, its mask, qkv and proj.

    Subclasses give the attention logits of one window (:meth:`logits`) and the q, k, v projection (:meth:`project`).
    """

    relative_position_index: Tensor

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
        out: Tensor = self.qkv(windows)
        return out

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
        self.register_buffer("relative_position_index", relative_index(wh, ww, device))

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
        qkv, proj = cast(nn.Linear, attn.qkv), cast(nn.Linear, attn.proj)
        table = cast(nn.Parameter, attn.relative_position_bias_table)
        heads = int(table.shape[1])
        rows, inner = qkv.out_features, proj.in_features
        if heads < 1 or rows != 3 * inner or inner % heads:
            raise ValueError(
                f"WindowAttention: qkv rows {rows}, proj columns {inner} and {heads} heads are not whole heads."
            )
        new = cls(
            qkv.in_features, cast("list[int]", attn.window_size), cast("list[int]", attn.shift_size), heads,
            inner // heads, qkv_bias=qkv.bias is not None, proj_bias=proj.bias is not None,
            attention_dropout=float(cast(float, attn.attention_dropout)), dropout=float(cast(float, attn.dropout)),
            device="meta",
        )  # fmt: skip
        new.qkv, new.proj = qkv, proj
        new.relative_position_bias_table = table
        new.relative_position_index = cast(Tensor, attn.relative_position_index)
        move_hooks(attn, new)
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

    relative_coords_table: Tensor

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
        self.register_buffer("relative_position_index", relative_index(wh, ww, device))
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
        qkv, proj = cast(nn.Linear, attn.qkv), cast(nn.Linear, attn.proj)
        logit_scale, cpb_mlp = cast(nn.Parameter, attn.logit_scale), cast(nn.Sequential, attn.cpb_mlp)
        heads = int(logit_scale.shape[0])
        rows, inner = qkv.out_features, proj.in_features
        last = cast(nn.Linear, cpb_mlp[-1])
        if (
            heads < 1 or rows != 3 * inner or inner % heads or tuple(logit_scale.shape) != (heads, 1, 1)
            or last.out_features != heads
        ):  # fmt: skip
            raise ValueError(
                f"WindowAttentionV2: qkv rows {rows}, proj columns {inner}, logit_scale {tuple(logit_scale.shape)}"
                f" and cpb_mlp's last rows {last.out_features} are not whole heads of one head count."
            )
        new = cls(
            qkv.in_features, cast("list[int]", attn.window_size), cast("list[int]", attn.shift_size), heads,
            inner // heads, qkv_bias=qkv.bias is not None, proj_bias=proj.bias is not None,
            attention_dropout=float(cast(float, attn.attention_dropout)), dropout=float(cast(float, attn.dropout)),
            cpb_hidden=last.in_features, device="meta",
        )  # fmt: skip
        new.qkv, new.proj, new.cpb_mlp = qkv, proj, cpb_mlp
        new.logit_scale = logit_scale
        new.relative_coords_table = cast(Tensor, attn.relative_coords_table)
        new.relative_position_index = cast(Tensor, attn.relative_position_index)
        new.traced = bool(getattr(attn, "traced", False))
        move_hooks(attn, new)
        return new

    def project(self, windows: Tensor) -> Tensor:
        """q, k and v, with ``qkv``'s weight and its bias without the k part (the whole bias while :attr:`traced`).

        As torchvision does, ``qkv``'s weight and bias are used directly (its forward hooks do not run).
        """
        bias: Tensor | None = self.qkv.bias
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


def _coords_table(wh: int, ww: int, device: torch.device | str | None) -> Tensor:
    """``[1, 2Wh-1, 2Ww-1, 2]``: each relative offset scaled to [-8, 8], then ``sign * log2(|.| + 1) / 3``."""
    dy = torch.arange(-(wh - 1), wh, dtype=torch.float32) / (wh - 1)
    dx = torch.arange(-(ww - 1), ww, dtype=torch.float32) / (ww - 1)
    table = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1).unsqueeze(0) * 8
    return (torch.sign(table) * torch.log2(table.abs() + 1.0) / 3.0).to(device)


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
