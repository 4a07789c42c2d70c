"""torchvision's MaxViT partition attention with explicit heads: :class:`MaxVitAttention`.

See :mod:`lightning_pat.heads.replace` for why and when the shrink puts it in place of the stock module.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pat.heads.parts import move_hooks, relative_index

#: The partition attention class of torchvision's MaxViT that :class:`MaxVitAttention` reproduces.
MAXVIT_ATTENTION = ("torchvision.models.maxvit", "RelativePositionalMultiHeadAttention")


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

    relative_position_index: Tensor

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
        index = relative_index(self.size, self.size, device).reshape(max_seq_len, max_seq_len)
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
        to_qkv, merge = cast(nn.Linear, attn.to_qkv), cast(nn.Linear, attn.merge)
        table = cast(nn.Parameter, attn.relative_position_bias_table)
        heads = int(table.shape[1])
        rows, inner = to_qkv.out_features, merge.in_features
        if heads < 1 or rows != 3 * inner or inner % heads:
            raise ValueError(
                f"MaxVitAttention: to_qkv rows {rows}, merge columns {inner} and {heads} heads (bias table columns) "
                "are not whole heads of one head count."
            )
        new = cls(to_qkv.in_features, heads, inner // heads, int(cast(int, attn.max_seq_len)), device="meta")
        new.scale_factor = float(cast(float, attn.scale_factor))
        new.to_qkv, new.merge = to_qkv, merge
        new.relative_position_bias_table = table
        new.relative_position_index = cast(Tensor, attn.relative_position_index)
        move_hooks(attn, new)
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
        merged: Tensor = self.merge(out)
        return merged
