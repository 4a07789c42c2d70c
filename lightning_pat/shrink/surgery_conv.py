"""Shrink rules for convolutional modules: ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and ``GroupNorm``.

Used by :mod:`lightning_pat.shrink.edits` (which finds the modules and validates every cut before the first change)
and :mod:`lightning_pat.shrink.surgery` (which gives the parameters their new data); this module only knows what each
module kind allows and which metadata and buffers follow the parameters:

* a convolution loses output channels (weight dim 0 with its bias) and, if ``groups == 1``, input channels (weight
  dim 1); a grouped convolution (depthwise included) loses whole groups only: the rows of a group (``out_channels /
  groups`` of them, with their bias), while its weight keeps dim 1 (``in_channels / groups``); ``groups``,
  ``in_channels`` and ``out_channels`` follow (the group's input channels go with the writers of its input);
* a transposed convolution (weight ``[in, out / groups, *kernel]``) loses input channels on weight dim 0 and, if
  ``groups == 1``, output channels on weight dim 1 with its bias; grouped, it loses whole groups: the weight rows of
  a group's input channels and the bias of its output channels, which must name the same groups;
* (an affine ``BatchNorm``, whose running statistics follow its channels, is one of the surgery's own kinds);
* a ``GroupNorm`` loses whole groups only (``num_groups`` follows).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

#: (kind, attribute) -> dims that may be cut.
CONV_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("conv", "weight"): (0, 1),
    ("conv", "bias"): (0,),
    ("conv_t", "weight"): (0, 1),
    ("conv_t", "bias"): (0,),
    ("conv_tg", "weight"): (0,),
    ("conv_tg", "bias"): (0,),
    ("groupnorm", "weight"): (0,),
    ("groupnorm", "bias"): (0,),
}
#: The kinds this module rewrites.
CONV_KINDS: frozenset[str] = frozenset(kind for kind, _ in CONV_DIMS)
#: kind -> the (attr, dim) pairs that must be cut identically.
CONV_TIED_AXES: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "conv": (("weight", 0), ("bias", 0)),
    "conv_t": (("weight", 1), ("bias", 0)),
    "groupnorm": (("weight", 0), ("bias", 0)),
}


def conv_kind(module: nn.Module) -> str | None:
    """``"conv"``, ``"conv_t"`` (transposed), ``"conv_tg"`` (transposed, grouped), ``"groupnorm"`` or ``None``."""
    if isinstance(module, _ConvNd):
        if not module.transposed:
            return "conv"
        return "conv_t" if module.groups == 1 else "conv_tg"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    return None


def _whole_blocks(kept: Tensor, block: int) -> bool:
    if kept.numel() % block:
        return False
    rows = kept.cpu().view(-1, block)
    return bool(torch.equal(rows, (rows[:, :1] // block) * block + torch.arange(block)))


def _groups_kept(kept: Tensor, block: int) -> Tensor:
    return kept.cpu().view(-1, block)[:, 0] // block


def _check_grouped(where: str, module: _ConvNd, kind: str, cuts: dict[str, dict[int, Tensor]]) -> None:
    """A grouped convolution loses whole groups: rows of whole groups, a bias naming the same groups, no dim 1 cut."""
    in_per, out_per = module.in_channels // module.groups, module.out_channels // module.groups
    if 1 in cuts.get("weight", {}):
        raise ValueError(
            f"{where}: a grouped convolution (groups={module.groups}) keeps its weight's dim 1 (the channels of one "
            "group); drop whole groups instead: cut weight dim 0 and the bias, and the channels the groups read."
        )
    rows = cuts.get("weight", {}).get(0)
    block = in_per if kind == "conv_tg" else out_per  # what one group holds on weight dim 0
    if rows is not None and not _whole_blocks(rows, block):
        raise ValueError(
            f"{where}: a grouped convolution (groups={module.groups}) must lose whole groups of {block} weight rows; "
            f"declare the cluster with one unit per group (`num_units` = {module.groups}, or fewer) or let "
            "`lightning_pat.discover` find it."
        )
    bias = cuts.get("bias", {}).get(0)
    if kind == "conv_tg" and module.bias is not None:
        groups = None if rows is None else _groups_kept(rows, in_per)
        bias_groups = None if bias is None or not _whole_blocks(bias, out_per) else _groups_kept(bias, out_per)
        if groups is None or bias_groups is None or not torch.equal(groups, bias_groups):
            raise ValueError(
                f"{where}: a grouped transposed convolution loses whole groups: the weight rows of a group's input "
                f"channels ({in_per} per group) and the bias of its output channels ({out_per} per group) must drop "
                "the same groups; list both in one cluster."
            )


def check_conv_edit(name: str, module: nn.Module, kind: str, cuts: dict[str, dict[int, Tensor]]) -> None:
    """Refuse cuts a convolution or norm cannot take (called before anything changes).

    Raises:
        ValueError: A grouped convolution (depthwise included) would lose part of a group or its weight's dim 1, a
            grouped transposed convolution's weight rows and bias would drop different groups, or a ``GroupNorm``
            would lose part of a group.
    """
    where = f"Shrink: module {name!r} ({type(module).__name__})"
    if kind in ("conv", "conv_tg") and cast(_ConvNd, module).groups > 1:  # the kind is conv_kind(module)
        _check_grouped(where, cast(_ConvNd, module), kind, cuts)
    if kind == "groupnorm":
        norm = cast(nn.GroupNorm, module)
        kept = cuts.get("weight", cuts.get("bias", {})).get(0)
        size = norm.num_channels // norm.num_groups
        if kept is not None and not _whole_blocks(kept, size):
            raise ValueError(
                f"{where}: GroupNorm normalises groups of {size} channels, so only whole groups can be dropped "
                f"(num_groups={norm.num_groups}); declare the cluster with `num_units={norm.num_groups}`."
            )


def rewrite_conv(module: nn.Module, kind: str, old_width: int) -> None:
    """Update a convolution's or GroupNorm's metadata after the parameters got their new data.

    Args:
        module: The module, its parameters already cut.
        kind: Its kind (:func:`conv_kind`).
        old_width: ``weight.shape[0]`` before the cut.
    """
    conv, norm = cast(_ConvNd, module), cast(nn.GroupNorm, module)  # which one: the kind (conv_kind) says
    w = conv.weight
    if kind in ("conv", "conv_t", "conv_tg") and conv.groups > 1:  # checked: whole groups of rows were cut
        conv.groups = w.shape[0] // (old_width // conv.groups)
    if kind == "conv":
        conv.in_channels = conv.groups * w.shape[1]
        conv.out_channels = w.shape[0]
    elif kind in ("conv_t", "conv_tg"):  # weight [in, out / groups, *kernel]
        conv.in_channels = w.shape[0]
        conv.out_channels = conv.groups * w.shape[1]
    elif kind == "groupnorm":
        size = old_width // norm.num_groups
        norm.num_channels = w.shape[0]
        norm.num_groups = w.shape[0] // size
