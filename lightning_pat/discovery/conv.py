"""Channel labels through convolutions: dense, depthwise, grouped and transposed (``ConvTranspose1d/2d/3d``).

A handler of the discovery walk (:mod:`~lightning_pat.discovery.walk`), on its
:class:`~lightning_pat.discovery.labels.Labelling`.

The weight may reach the convolution through ops that only drop and add size-1 axes (:func:`weight_param`).

* ``groups == 1``: the input channels are read (weight dim 1, transposed: dim 0) and a new space of output channels
  is written (weight dim 0 and the bias, transposed: weight dim 1 and the bias).
* ``groups > 1`` (depthwise is the case of one input channel per group): a unit is one or more **whole groups**.
  The input's space is coarsened so that a unit never splits a group, the weight's output rows of each group (a
  transposed convolution: its input rows) and the bias join the input's space, and the output carries the same
  space, a group being ``out_channels / groups`` channels. Dropping a whole group removes its input channels, its
  filters and its output channels, and leaves every other group's computation untouched, so the shrunk convolution
  (``groups`` - dropped groups) is exact. Pruning the same number of channels inside every group instead would need
  a unit made of channels spread over all groups (channel ``j`` of each group), which a cluster's units (blocks of
  consecutive channels) cannot express, and a grouped convolution cannot take groups of different widths.
"""

from __future__ import annotations

from typing import Any, cast

from torch.fx import Node

from lightning_pat.discovery.labels import Handler, Label, Labelling
from lightning_pat.discovery.nodes import node_shape, op_name

#: op -> index of the ``groups`` argument (``aten.convolution``: also ``transposed`` at 6).
_GROUPS_AT = {"convolution": 8, "conv_transpose1d": 6, "conv_transpose2d": 6, "conv_transpose3d": 6}


def _layout(node: Node) -> tuple[bool, int]:
    """``(transposed, groups)`` of a convolution call."""
    op, args = op_name(node), list(node.args)
    at = _GROUPS_AT.get(op, 6)
    groups = args[at] if len(args) > at else node.kwargs.get("groups", 1)
    transposed = bool(args[6]) if op == "convolution" else op.startswith("conv_transpose")
    return transposed, int(cast(int, groups))


#: Ops that only drop or add size-1 axes, or change the dtype: a convolution weight reached through them is the
#: parameter itself (transformers' ``causal_conv1d_fn``: ``conv1d.weight.squeeze(1)``, then ``weight.unsqueeze(1)``).
SAME_WEIGHT = frozenset(("squeeze", "unsqueeze", "_to_copy", "to", "alias", "clone", "contiguous", "detach"))


def weight_param(w: Labelling, arg: Any) -> str | None:
    """The parameter a convolution's ``weight`` argument is: itself, or through :data:`SAME_WEIGHT` ops to its shape."""
    name, node = w.param_of(arg), arg
    while name is None and isinstance(node, Node) and node.op == "call_function" and op_name(node) in SAME_WEIGHT:
        node = node.args[0]
        name = w.param_of(node)
    return name if name is not None and node_shape(node) == node_shape(arg) else None


def feeds_weight(w: Labelling, node: Node) -> bool:
    """Whether every use of ``node`` reaches a convolution's weight slot through :data:`SAME_WEIGHT` ops only.

    There the weight must be a parameter of its shape (:func:`weight_param`).
    """
    users = list(node.users)
    return bool(users) and all(
        (
            op_name(u) in _CONVS
            and u.args[1] is node
            and node not in (*u.args[:1], *u.args[2:])
            and weight_param(w, node) is not None
        )
        or (op_name(u) in SAME_WEIGHT and u.args[0] is node and feeds_weight(w, u))
        for u in users
    )


def conv(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """Labels of a convolution's output (see the module docstring); registers the weight and bias as members."""
    args = list(node.args)
    x, weight, bias = args[0], args[1], args[2] if len(args) > 2 else None
    wname, bname = weight_param(w, weight), w.param_of(bias)
    shape, wshape = node_shape(x), node_shape(weight)
    if wname is None or (bias is not None and bname is None) or out is None or shape is None or wshape is None:
        return NotImplemented
    transposed, groups = _layout(node)
    cdim = 1 if len(shape) == len(wshape) else 0  # unbatched input: channels first
    lab = w.ndim_label(x, len(shape))
    result: list[Label] = [lab[0] if cdim == 1 else None] + [None] * (len(out) - 1)
    in_dim, out_dim = (0, 1) if transposed else (1, 0)  # the weight's input- and output-channel dims
    out_c = out[cdim]
    if groups == 1:
        w.add_segments(wname, "in", in_dim, lab[cdim])
        space = w.new_space(out_c)
        w.add_member(wname, "out", out_dim, 0, out_c, space)
        if bname is not None:
            w.add_member(bname, "out", 0, 0, out_c, space)
        result[cdim] = ((space, out_c, 1),)
        return tuple(result)
    result[cdim] = _grouped(w, lab[cdim], shape[cdim], out_c, groups, transposed, wname, bname)
    return tuple(result)


def _grouped(
    w: Labelling, label: Label, in_c: int, out_c: int, groups: int, transposed: bool, wname: str, bname: str | None
) -> Label:
    """Whole groups are the units: the input's segments join the rows of their groups (see the module docstring)."""
    kind = "transposed convolution" if transposed else "convolution"
    where = f"grouped {kind} ({groups} groups)"
    if label is None:
        reason = f"{where} reads channels that are not traced (the model's input): its groups cannot be dropped"
        return w.fresh(out_c, reason)
    in_per, out_per = in_c // groups, out_c // groups
    segments = []
    start = 0
    for space, units, block in label:
        length = units * block
        if length % in_per or start % in_per:
            reason = f"{where}: a part of {length} concatenated channels does not hold whole groups of {in_per}"
            w.poison(label, reason)
            return w.fresh(out_c, reason)
        first, count = start // in_per, length // in_per
        w.union(space, w.new_space(count), where)  # a unit is a whole number of groups
        if transposed:  # the weight's rows are input channels
            w.add_member(wname, "out", 0, start, start + length, space)
        else:
            w.add_member(wname, "out", 0, first * out_per, (first + count) * out_per, space)
        if bname is not None:
            w.add_member(bname, "out", 0, first * out_per, (first + count) * out_per, space)
        segments.append((space, count, out_per))
        start += length
    return tuple(segments)


_CONVS = (
    "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
)  # fmt: skip
#: op -> handler.
HANDLERS: dict[str, Handler] = dict.fromkeys(_CONVS, conv)
#: Argument positions that are weight slots (a parameter there is not "used directly"): the weight and the bias.
SLOTS: dict[str, tuple[int, ...]] = dict.fromkeys(_CONVS, (1, 2))
