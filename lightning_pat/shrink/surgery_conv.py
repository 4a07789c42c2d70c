"""Shrink rules for convolutional modules: ``nn.Conv1d/2d/3d`` (dense and depthwise) and ``GroupNorm``.

Used by :mod:`lightning_pat.shrink.surgery` (which finds the modules, validates every cut before the first change and
gives the parameters their new data); this module only knows what each module kind allows and which metadata and
buffers follow the parameters:

* a convolution loses output channels (weight dim 0 with its bias) and, if ``groups == 1``, input channels (weight
  dim 1); a depthwise convolution (``groups == in_channels``, ``out_channels = k * in_channels``) loses whole groups
  of ``k`` output channels, and its ``in_channels`` / ``groups`` follow (the input channels are the cluster's units);
  other grouped convolutions are refused;
* (an affine ``BatchNorm``, whose running statistics follow its channels, is one of the surgery's own kinds);
* a ``GroupNorm`` loses whole groups only (``num_groups`` follows).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

#: (kind, attribute) -> dims that may be cut.
CONV_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("conv", "weight"): (0, 1),
    ("conv", "bias"): (0,),
    ("groupnorm", "weight"): (0,),
    ("groupnorm", "bias"): (0,),
}
#: kind -> the (attr, dim) pairs that must be cut identically.
CONV_TIED_AXES: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "conv": (("weight", 0), ("bias", 0)),
    "groupnorm": (("weight", 0), ("bias", 0)),
}


def conv_kind(module: nn.Module) -> str | None:
    """``"conv"``, ``"groupnorm"`` or ``None`` (transposed convolutions are ``None``)."""
    if isinstance(module, _ConvNd) and not module.transposed:
        return "conv"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    return None


def is_depthwise(conv: _ConvNd) -> bool:
    """Whether ``conv`` convolves every input channel on its own (``groups == in_channels > 1``)."""
    return conv.groups > 1 and conv.groups == conv.in_channels


def _whole_blocks(kept: Tensor, block: int) -> bool:
    if kept.numel() % block:
        return False
    rows = kept.cpu().view(-1, block)
    return bool(torch.equal(rows, (rows[:, :1] // block) * block + torch.arange(block)))


def check_conv_edit(name: str, module: nn.Module, kind: str, cuts: dict[str, dict[int, Tensor]]) -> None:
    """Refuse cuts a convolution or norm cannot take (called before anything changes).

    Raises:
        ValueError: A grouped (not depthwise) convolution is cut, a depthwise convolution would lose part of a group
            or its input axis, a norm without a weight is cut, or a ``GroupNorm`` would lose part of a group.
    """
    where = f"Shrink: module {name!r} ({type(module).__name__})"
    if kind == "conv" and module.groups > 1:
        if not is_depthwise(module):
            raise ValueError(
                f"{where} is a grouped convolution (groups={module.groups}, in_channels={module.in_channels}); "
                "only dense (groups=1) and depthwise (groups=in_channels) convolutions can be shrunk. Remove its "
                "parameters from the clusters."
            )
        if 1 in cuts.get("weight", {}):
            raise ValueError(f"{where}: a depthwise convolution's weight has one input channel per group; cut dim 0.")
        kept = cuts.get("weight", {}).get(0)
        mult = module.out_channels // module.groups
        if kept is not None and not _whole_blocks(kept, mult):
            raise ValueError(
                f"{where}: a depthwise convolution with channel multiplier {mult} must lose whole groups of {mult} "
                "output channels (one input channel each); declare its rows with a block of that size (`num_units` = "
                "in_channels)."
            )
    if kind == "groupnorm":
        kept = cuts.get("weight", cuts.get("bias", {})).get(0)
        size = module.num_channels // module.num_groups
        if kept is not None and not _whole_blocks(kept, size):
            raise ValueError(
                f"{where}: GroupNorm normalises groups of {size} channels, so only whole groups can be dropped "
                f"(num_groups={module.num_groups}); declare the cluster with `num_units={module.num_groups}`."
            )


def rewrite_conv(module: nn.Module, kind: str, old_width: int) -> None:
    """Update a convolution's or GroupNorm's metadata after the parameters got their new data.

    Args:
        module: The module, its parameters already cut.
        kind: Its kind (:func:`conv_kind`).
        old_width: ``weight.shape[0]`` before the cut.
    """
    w = module.weight
    if kind == "conv":
        if module.groups > 1:  # depthwise (checked): the groups follow the output channels
            mult = old_width // module.groups
            module.groups = w.shape[0] // mult
            module.in_channels = module.groups
        else:
            module.in_channels = w.shape[1]
        module.out_channels = w.shape[0]
    elif kind == "groupnorm":
        size = old_width // module.num_groups
        module.num_channels = w.shape[0]
        module.num_groups = w.shape[0] // size
