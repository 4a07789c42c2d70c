"""Handlers of the ops that take parameters in weight slots: ``linear``, ``addmm``/``mm``, ``embedding``, the norms.

A writer (a ``linear``'s or an embedding's output) opens a space with its weight's rows (an embedding: its columns)
and the bias as members; a reader joins its input's label with the weight's input channels; a norm's affine weight
and bias join the channels they scale. LayerNorm and RMSNorm normalise over the channel axis, and a norm without
affine parameters would not keep a dropped channel zero: both poison it. Convolutions are in
:mod:`~lightning_pat.discovery.conv`.
"""

from __future__ import annotations

from typing import Any, cast

from torch.fx import Node

from lightning_pat.discovery.labels import Handler, Labelling
from lightning_pat.discovery.nodes import op_name as _op_name
from lightning_pat.discovery.nodes import shape_of as _shape

_BATCH_NORMS = {
    "batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit", "native_batch_norm", "instance_norm", "_native_batch_norm_legit_no_stats",
}  # fmt: skip


def _linear(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    x, weight = cast(Node, node.args[0]), node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    wname, bname = w.param_of(weight), w.param_of(bias)
    if wname is None or (bias is not None and bname is None) or out is None:
        return NotImplemented
    shape = cast("tuple[int, ...]", _shape(x.meta.get("val")))  # the input of a traced linear has a static shape
    lab = w.ndim_label(x, len(shape))
    w.add_segments(wname, "in", 1, lab[-1])
    space = w.new_space(out[-1])
    w.add_member(wname, "out", 0, 0, out[-1], space)
    if bname is not None:
        w.add_member(bname, "out", 0, 0, out[-1], space)
    return (*lab[:-1], ((space, out[-1], 1),))


#: Ops that transpose a 2-D tensor (``W.T``, ``W.t()``, ``W.permute(1, 0)``, ``W.transpose(0, 1)``).
TRANSPOSES = frozenset(("t", "permute", "transpose", "numpy_T"))


def transposed_param(w: Labelling, arg: Any) -> str | None:
    """The 2-D parameter ``arg`` is the transpose of (Falcon's ``x @ self.weight.T``), else ``None``."""
    if not isinstance(arg, Node) or arg.op != "call_function" or _op_name(arg) not in TRANSPOSES or not arg.args:
        return None
    name = w.param_of(arg.args[0])
    shape = _shape(arg.args[0].meta.get("val")) if isinstance(arg.args[0], Node) else None
    return name if name is not None and shape is not None and len(shape) == 2 else None


def _addmm(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``addmm(bias, x, W)`` / ``mm(x, W)`` with a parameter ``W`` of shape ``[in, out]``.

    ``W`` is a parameter ``[in, out]`` (transformers ``Conv1D``), or the transpose of a parameter ``[out, in]``
    (``x @ weight.T``, Falcon's linear layers).
    """
    bias, x, weight = (node.args[0], node.args[1], node.args[2]) if _op_name(node) == "addmm" else (None, *node.args)
    wname, bname = w.param_of(weight), w.param_of(bias)
    in_dim, out_dim = 0, 1
    if wname is None and (wname := transposed_param(w, weight)) is not None:
        in_dim, out_dim = 1, 0
    if wname is None or (bias is not None and bname is None) or out is None or len(out) != 2:
        return NotImplemented
    lab = w.ndim_label(x, 2)
    w.add_segments(wname, "in", in_dim, lab[1])
    space = w.new_space(out[1])
    w.add_member(wname, "out", out_dim, 0, out[1], space)
    if bname is not None:
        w.add_member(bname, "out", 0, 0, out[1], space)
    return (lab[0], ((space, out[1], 1),))


def matmul_transposed(w: Labelling, node: Node, wname: str, out: tuple[int, ...] | None) -> Any:
    """``matmul(x, W.T)`` with a parameter ``W`` ``[out, in]``: a linear layer without bias (Falcon's)."""
    x = node.args[0]
    shape = _shape(x.meta.get("val")) if isinstance(x, Node) else None
    if shape is None or out is None or len(shape) < 1:
        return NotImplemented
    lab = w.ndim_label(x, len(shape))
    w.add_segments(wname, "in", 1, lab[-1])
    space = w.new_space(out[-1])
    w.add_member(wname, "out", 0, 0, out[-1], space)
    return (*lab[:-1], ((space, out[-1], 1),))


def _embedding(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    wname = w.param_of(node.args[0])
    if wname is None or out is None:
        return NotImplemented
    space = w.new_space(out[-1])
    w.add_member(wname, "out", 1, 0, out[-1], space)
    return (None,) * (len(out) - 1) + (((space, out[-1], 1),),)


def _batch_norm(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    x, weight, bias = cast(Node, node.args[0]), node.args[1], node.args[2]
    shape = _shape(x.meta.get("val"))
    if shape is None:
        return NotImplemented
    lab = w.ndim_label(x, len(shape))
    cdim = 1 if len(shape) > 1 else 0
    wname, bname = w.param_of(weight), w.param_of(bias)
    op = _op_name(node)
    if wname is None or bname is None or op == "instance_norm":
        w.poison(lab[cdim], f"`{op}` without affine weight and bias (a dropped channel would not be zero)")
    else:
        w.add_segments(wname, "out", 0, lab[cdim])
        w.add_segments(bname, "out", 0, lab[cdim])
    val = node.meta.get("val")
    return [lab, None, None, None, None][: len(val)] if isinstance(val, (list, tuple)) else lab


def _group_norm(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    x, groups = cast(Node, node.args[0]), cast(int, node.args[1])
    weight = node.args[2] if len(node.args) > 2 else None
    bias = node.args[3] if len(node.args) > 3 else None
    shape = _shape(x.meta.get("val"))
    if shape is None:
        return NotImplemented
    lab = w.ndim_label(x, len(shape))
    wname, bname = w.param_of(weight), w.param_of(bias)
    if lab[1] is None:
        return lab
    if wname is None or bname is None:
        w.poison(lab[1], "GroupNorm without affine weight and bias (a dropped channel would not be zero)")
    elif groups != shape[1] and len(lab[1]) != 1:
        w.poison(lab[1], f"GroupNorm ({groups} groups) over concatenated channels: groups could straddle the parts")
    else:
        if groups != shape[1]:  # a unit is a whole group (or several): statistics of the kept groups are unchanged
            w.union(lab[1][0][0], w.new_space(groups), f"GroupNorm with {groups} groups")
        w.add_segments(wname, "out", 0, lab[1])
        w.add_segments(bname, "out", 0, lab[1])
    return lab


def _layer_norm(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    x, normalized = cast(Node, node.args[0]), cast("list[int]", node.args[1])
    shape = _shape(x.meta.get("val"))
    if shape is None:
        return NotImplemented
    lab = w.ndim_label(x, len(shape))
    reason = (
        "LayerNorm normalises over this channel axis (a shrink could not be exact)"
        if _op_name(node) == "layer_norm"
        else "RMSNorm normalises over this channel axis (a residual stream: prune it with a preset's residual=True)"
    )
    for d in range(len(shape) - len(normalized), len(shape)):
        w.poison(lab[d], reason)
    return lab


#: op -> handler.
HANDLERS: dict[str, Handler] = {
    "linear": _linear,
    "embedding": _embedding,
    "addmm": _addmm,
    "mm": _addmm,
    "group_norm": _group_norm,
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,
}
#: Op families sharing one handler (looked up after the handlers by name).
FAMILIES: tuple[tuple[set[str], Handler], ...] = ((_BATCH_NORMS, _batch_norm),)
#: Argument positions that are weight slots (a parameter there is not "used directly").
SLOTS: dict[str, tuple[int, ...]] = {
    "linear": (1, 2),
    "embedding": (0,),
    "addmm": (0, 2),
    "mm": (1,),
    **dict.fromkeys(_BATCH_NORMS, (1, 2)),
    "group_norm": (2, 3),
    "layer_norm": (2, 3),
    "rms_norm": (2,),
}
