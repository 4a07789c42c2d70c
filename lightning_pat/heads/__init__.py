"""Attention modules that hold their head count explicitly (floor 1: torch only; used by discovery and the shrink).

``parts`` (hooks taken over, relative position index), one module per stock attention (``mha``:
``nn.MultiheadAttention``; ``window``: torchvision's Swin V1/V2; ``maxvit``: torchvision's MaxViT), and ``replace``
(put one of them in place of the stock module, holding the same parameters).
"""

from lightning_pat.heads.maxvit import MAXVIT_ATTENTION, MaxVitAttention, is_maxvit_attention
from lightning_pat.heads.mha import HeadsMultiheadAttention, mha_refusal
from lightning_pat.heads.replace import replace_attention
from lightning_pat.heads.window import (
    SWIN_ATTENTION,
    SWIN_V2_ATTENTION,
    WindowAttention,
    WindowAttentionV2,
    is_swin_attention,
    is_swin_v2_attention,
)

__all__ = [
    "MAXVIT_ATTENTION", "SWIN_ATTENTION", "SWIN_V2_ATTENTION", "HeadsMultiheadAttention", "MaxVitAttention",
    "WindowAttention", "WindowAttentionV2", "is_maxvit_attention", "is_swin_attention", "is_swin_v2_attention",
    "mha_refusal", "replace_attention",
]  # fmt: skip
