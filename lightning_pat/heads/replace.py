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

from collections.abc import Sequence

from torch import nn

from lightning_pat.heads.maxvit import MaxVitAttention, is_maxvit_attention
from lightning_pat.heads.mha import HeadsMultiheadAttention, mha_refusal
from lightning_pat.heads.window import (
    WindowAttention,
    WindowAttentionV2,
    is_swin_attention,
    is_swin_v2_attention,
)

__all__ = ["replace_attention"]


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
