"""Label propagation over a traced graph, for :mod:`lightning_pat.discovery.entry` (see its module docstring).

A tensor dim's *label* is a tuple of segments ``(space, units, block)`` (``None``: not a channel axis that is
tracked); a *space* is one index space of units in a union-find. :class:`Walk` visits the graph's nodes in order and
applies one handler per ATen op; an op without a handler poisons every label it touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.fx import Node

from lightning_pat.discovery.attention import HANDLERS as _ATTENTION
from lightning_pat.discovery.attention import packed_heads, split_axis
from lightning_pat.discovery.conv import conv as _conv
from lightning_pat.discovery.nodes import flat as _flat
from lightning_pat.discovery.nodes import op_name as _op_name
from lightning_pat.discovery.nodes import shape_of as _shape
from lightning_pat.discovery.trace import Trace

Segment = tuple[int, int, int]  # (space id, units, block); only units * block (the length) is relied on
Label = tuple[Segment, ...] | None  # None: not a channel axis we track


# ---------------------------------------------------------------------------------------------------- op tables
_UNARY = {
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "hardswish",
    "hardsigmoid", "leaky_relu", "elu", "selu", "celu", "mish", "softplus", "neg", "abs", "exp", "log",
    "sqrt", "rsqrt", "square", "erf", "reciprocal", "sign", "dropout", "feature_dropout", "alpha_dropout", "clone",
    "contiguous", "detach", "alias", "_to_copy", "to", "clamp", "clamp_min", "clamp_max", "lift_fresh_copy",
    "identity",
}  # fmt: skip
_BINARY = {
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "true_divide",
    "rsub",
    "maximum",
    "minimum",
    "pow",
    "where",
}
_POOL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d", "upsample_trilinear3d",
    "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa",
}  # fmt: skip
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
_BATCH_NORMS = {
    "batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit", "native_batch_norm", "instance_norm", "_native_batch_norm_legit_no_stats",
}  # fmt: skip
_REDUCE = {"mean", "sum", "amax", "amin", "var", "std", "max", "min", "prod", "logsumexp", "norm", "linalg_vector_norm"}
_IGNORE = {"_assert_tensor_metadata", "sym_size", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}


# ---------------------------------------------------------------------------------------------------- the walk
@dataclass
class Space:
    """One index space of units and, if it may not be pruned, the reasons."""

    units: int
    reasons: list[str] = field(default_factory=list)


class Walk:
    """Label propagation over one trace."""

    def __init__(self, tr: Trace) -> None:
        self.trace = tr
        self.spaces: list[Space] = []
        self.parent: list[int] = []
        self.labels: dict[Node, Any] = {}  # node -> tuple of labels per dim, or a list of those for tuple outputs
        self.members: dict[tuple[str, int, int, int], int] = {}  # (param, dim, start, stop) -> space
        self.flows: dict[tuple[str, int, int, int], str] = {}  # "in" (reads the channels) or "out" (writes them)
        self.direct: dict[str, str] = {}  # parameter used outside a weight slot -> why
        self.untraced_reads: dict[tuple[str, int], str] = {}  # (param, dim) read at a call site of untraced channels

    # -- union-find
    def new_space(self, units: int, reason: str | None = None) -> int:
        """Open a space of ``units`` units (poisoned with ``reason`` if given); its id."""
        self.spaces.append(Space(units, [reason] if reason else []))
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, s: int) -> int:
        """The root of space ``s``."""
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: int, b: int, why: str) -> None:
        """Join two spaces (a coarser unit count wins where one divides the other, else both are poisoned)."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        lo, hi = min(ra, rb), max(ra, rb)
        self.parent[hi] = lo
        sa, sb = self.spaces[lo], self.spaces[hi]
        sa.reasons.extend(r for r in sb.reasons if r not in sa.reasons)
        small, large = sorted((sa.units, sb.units))
        if large % small:
            self.poison_space(lo, f"{why} joins {sa.units} and {sb.units} channels")
        sa.units = small  # a coarser unit (e.g. a depthwise multiplier's block) covers the finer one

    def poison_space(self, s: int, reason: str) -> None:
        """Mark space ``s`` as not prunable, with a reason."""
        reasons = self.spaces[self.find(s)].reasons
        if reason not in reasons:
            reasons.append(reason)

    def poison(self, label: Label, reason: str) -> None:
        """Poison every space of a label."""
        for seg in label or ():
            self.poison_space(seg[0], reason)

    def fresh(self, size: int, reason: str) -> Label:
        """A label on a new, poisoned space of ``size`` channels (``None`` for a size-1 axis)."""
        return ((self.new_space(size, reason), size, 1),) if size > 1 else None

    def join(self, a: Label, b: Label, why: str) -> Label:
        """Two labels of one axis are the same channels: join their spaces segment by segment."""
        if a is None or b is None:
            return a if b is None else b
        if [u * blk for _, u, blk in a] != [u * blk for _, u, blk in b]:
            self.poison(a, f"{why} of differently laid out channels")
            self.poison(b, f"{why} of differently laid out channels")
            return a
        for (sa, _, _), (sb, _, _) in zip(a, b, strict=True):
            self.union(sa, sb, why)
        return a

    # -- members
    def add_member(self, param: str, flow: str, dim: int, start: int, stop: int, space: int) -> None:
        """Register channels ``[start, stop)`` of ``param`` on ``dim`` as a member of ``space``."""
        key = (param, dim, start, stop)
        for (p, d, a, b), s in list(self.members.items()):
            if p == param and d == dim and (a, b) != (start, stop) and a < stop and start < b:
                reason = f"{param} is used with overlapping channel slices [{a}:{b}] and [{start}:{stop}]"
                self.poison_space(s, reason)
                self.poison_space(space, reason)
        if key in self.members:
            self.union(self.members[key], space, f"shared parameter {param}")
        else:
            self.members[key] = space
            self.flows[key] = flow

    def add_segments(self, param: str, flow: str, dim: int, label: Label, scale: int = 1) -> None:
        """Register ``param``'s channel axis as members of the label's segments (lengths times ``scale``).

        A reader (``flow="in"``) of untraced channels (``label`` is ``None``: the model's input, a size-1 axis, an
        axis inside a unit) is remembered: if another call site of the same parameter puts its columns in a cluster,
        the shrink would cut them on this call site too, so that cluster is poisoned (:func:`poison_untraced_reads`).
        """
        if label is None and flow == "in":
            why = f"{param} also reads channels that are not traced (the model's input, a normalised axis)"
            self.untraced_reads.setdefault((param, dim), why)
        offset = 0
        for space, units, block in label or ():
            length = units * block * scale
            self.add_member(param, flow, dim, offset, offset + length, space)
            offset += length

    def poison_untraced_reads(self) -> None:
        """Poison the spaces of every member read elsewhere from untraced channels (see :meth:`add_segments`)."""
        for (param, dim, _, _), space in self.members.items():
            reason = self.untraced_reads.get((param, dim))
            if reason is not None:
                self.poison_space(space, reason)

    # -- node values
    def label_of(self, arg: Any) -> tuple[Label, ...] | None:
        """The per-dim labels of a node's (tensor) value, or ``None``."""
        if isinstance(arg, Node):
            value = self.labels.get(arg)
            return value if isinstance(value, tuple) else None
        return None

    def ndim_label(self, arg: Any, ndim: int) -> tuple[Label, ...]:
        """The labels of ``arg``, or ``None`` for every one of its ``ndim`` dims."""
        got = self.label_of(arg)
        if got is None or len(got) != ndim:
            return (None,) * ndim
        shape = _shape(arg.meta.get("val"))
        if shape is None:
            return got
        checked = list(got)
        for d, label in enumerate(got):  # a safety net: a label must cover its axis exactly
            if label is not None and sum(u * b for _, u, b in label) != shape[d]:
                self.poison(label, "channel bookkeeping lost track of this axis")
                checked[d] = self.fresh(shape[d], "channel bookkeeping lost track of this axis")
        return tuple(checked)

    def param_of(self, arg: Any) -> str | None:
        """The parameter name a node stands for, if it is a parameter placeholder."""
        if isinstance(arg, Node) and arg.op == "placeholder":
            return self.trace.params.get(arg.name)
        return None

    def run(self) -> None:
        """Visit every node in order; the output's labels are poisoned (outputs are never pruned)."""
        for node in self.trace.graph.nodes:
            if node.op == "placeholder":
                self.labels[node] = self.placeholder(node)
            elif node.op == "call_function":
                self.labels[node] = self.call(node)
            elif node.op == "output":
                for arg in _flat(node.args):
                    for lab in self.label_of(arg) or ():
                        self.poison(lab, "reaches the model's output")
        self.poison_untraced_reads()

    def placeholder(self, node: Node) -> tuple[Label, ...] | None:
        """Labels of an input: untracked for model inputs, poisoned for parameters, buffers and constants."""
        shape = _shape(node.meta.get("val"))
        if shape is None:
            return None
        name = node.name
        if name in self.trace.params:
            why = f"parameter {self.trace.params[name]} is used directly in forward"
        elif name in self.trace.buffers:
            why = f"buffer {self.trace.buffers[name]} is used directly in forward"
        elif name in self.trace.constants:
            why = "a tensor constant is used in forward"
        else:
            return (None,) * len(shape)  # a model input: not a channel axis of any parameter
        return tuple(self.fresh(s, why) for s in shape)

    # -- dispatch
    def call(self, node: Node) -> Any:
        """Labels of a call's value, through its handler (or :meth:`unknown`)."""
        op = _op_name(node)
        if op.endswith("_") and not op.endswith("__"):  # in place (relu_, dropout_, add_): as the functional op
            op = op[:-1]
        if op == "getitem":
            src, idx = node.args
            value = self.labels.get(src)
            return value[idx] if isinstance(value, list) and idx < len(value) else None
        if op in _IGNORE:
            return None
        handler = _HANDLERS.get(op) or next((h for ops, h in _FAMILIES if op in ops), None)
        out_shape = _shape(node.meta.get("val"))
        self.note_direct(node, op, handler)
        if handler is not None:
            result = handler(self, node, out_shape)
            if result is not NotImplemented:
                return result
        return self.unknown(node, op)

    def note_direct(self, node: Node, op: str, handler: Any) -> None:
        """Parameters used outside a weight slot of an op we understand."""
        slots = _SLOTS.get(op if handler is not _batch_norm else "batch_norm", ())
        for i, arg in enumerate(node.args):
            name = self.param_of(arg)
            if name is not None and i not in slots:
                self.direct.setdefault(name, f"parameter {name} is used directly in forward ({op})")
        for arg in node.kwargs.values():
            name = self.param_of(arg)
            if name is not None:
                self.direct.setdefault(name, f"parameter {name} is used directly in forward ({op})")

    def unknown(self, node: Node, op: str) -> Any:
        """An op discovery does not understand: poison what goes in, return poisoned labels."""
        reason = f"flows through `{op}`, which discovery does not see through"
        for arg in _flat((node.args, tuple(node.kwargs.values()))):
            for lab in self.label_of(arg) or ():
                self.poison(lab, reason)
            name = self.param_of(arg)
            if name is not None:
                self.direct.setdefault(name, f"parameter {name} is used directly in forward ({op})")
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            return [self.fresh_all(_shape(v), reason) for v in val]
        return self.fresh_all(_shape(val), reason)

    def fresh_all(self, shape: tuple[int, ...] | None, reason: str) -> tuple[Label, ...] | None:
        """Poisoned labels for every dim of ``shape``."""
        return None if shape is None else tuple(self.fresh(s, reason) for s in shape)


# ---------------------------------------------------------------------------------------------------- handlers
def _unary(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    if any(isinstance(a, Node) for a in _flat((node.args[1:], tuple(node.kwargs.values())))):
        return NotImplemented  # another tensor takes part (a PReLU weight, a tensor bound): not a unary op
    lab = w.label_of(node.args[0])
    if out is None:  # e.g. native_dropout returns (out, mask)
        val = node.meta.get("val")
        return [lab, lab] if isinstance(val, (list, tuple)) else NotImplemented
    return lab if lab is not None and len(lab) == len(out) else NotImplemented


def _elementwise(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    if out is None:
        return NotImplemented
    op = _op_name(node)
    result: list[Label] = [None] * len(out)
    operands = [a for a in node.args if isinstance(a, Node)]
    labelled = []
    for arg in operands:
        shape = _shape(arg.meta.get("val"))
        if shape is None:
            return NotImplemented
        lab = w.ndim_label(arg, len(shape))
        labelled.append((shape, lab))
    for i in range(1, len(out) + 1):
        for s, lab in labelled:
            if len(s) >= i and s[-i] == 1 and out[-i] > 1 and lab[-i] is not None:
                w.poison(lab[-i], f"`{op}` broadcasts a one-channel axis")
        present = [(s[-i], lab[-i]) for s, lab in labelled if len(s) >= i and s[-i] > 1]
        label: Label = None
        for _, lab in present:
            label = w.join(label, lab, f"`{op}`") if lab is not None else label
        if label is not None and any(lab is None for _, lab in present):
            w.poison(label, f"`{op}` with a tensor whose channels are not traced")
        result[-i] = label
    return tuple(result)


def _pool(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    op = _op_name(node)
    spatial = next((int(ch) for ch in op if ch.isdigit()), 2)
    shape = _shape(node.args[0].meta.get("val")) if isinstance(node.args[0], Node) else None
    if shape is None:
        return NotImplemented
    lab = list(w.ndim_label(node.args[0], len(shape)))
    for d in range(len(shape) - spatial, len(shape)):
        w.poison(lab[d], f"`{op}` over a channel axis")
        lab[d] = None
    result = tuple(lab)
    return [result, None] if op.endswith("with_indices") else result


def _reduce(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    op = _op_name(node)
    shape = _shape(node.args[0].meta.get("val")) if isinstance(node.args[0], Node) else None
    if shape is None or out is None:
        return NotImplemented
    at = 2 if op in ("norm", "linalg_vector_norm") else 1  # norm(x, p, dim), linalg_vector_norm(x, ord, dim)
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims) or not dims:
        dims = list(range(len(shape)))
    dims = sorted({d % len(shape) for d in dims}) if shape else []
    lab = w.ndim_label(node.args[0], len(shape))
    for d in dims:
        w.poison(lab[d], f"`{op}` reduces over a channel axis")
    keep = [lab[d] for d in range(len(shape)) if d not in dims]
    if len(out) == len(shape):  # keepdim
        keep = [None if d in dims else lab[d] for d in range(len(shape))]
    if len(keep) != len(out):
        return NotImplemented
    return tuple(keep)


def _view(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None or math.prod(shape) != math.prod(out):
        return NotImplemented
    lab = w.ndim_label(src, len(shape))
    result: list[Label] = [None] * len(out)
    for d, size in enumerate(shape):
        if size == 1 and lab[d] is not None:
            w.poison(lab[d], "a one-channel axis is reshaped")
    i_dims = [d for d, s in enumerate(shape) if s > 1]
    o_dims = [d for d, s in enumerate(out) if s > 1]
    i = j = 0
    while i < len(i_dims) or j < len(o_dims):
        gi, gj = [i_dims[i]], [o_dims[j]]
        pi, pj = shape[i_dims[i]], out[o_dims[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i_dims[i])
                pi *= shape[i_dims[i]]
                i += 1
            else:
                gj.append(o_dims[j])
                pj *= out[o_dims[j]]
                j += 1
        labelled = [d for d in gi if lab[d] is not None]
        if not labelled:
            continue
        if len(gj) == 1 and len(labelled) == 1 and labelled[0] == gi[0]:
            trailing = math.prod(shape[d] for d in gi[1:])
            result[gj[0]] = tuple((s, u, b * trailing) for s, u, b in lab[gi[0]])
            continue
        if len(gi) == 1 and len(gj) >= 3 and (heads := packed_heads(w, lab[gi[0]], [out[d] for d in gj], node)):
            result[gj[1]] = heads  # (parts, heads, head_dim, ...): a packed QKV; the parts axis lies inside a unit
            continue
        if len(gi) == 1 and (split := split_axis(w, lab[gi[0]], out[gj[0]])) is not None:
            result[gj[0]] = split  # heads: the first axis carries whole units, the others stay inside a unit
            continue
        reason = (
            "a channel axis is split into several axes (e.g. attention heads)"
            if len(gi) == 1
            else "a reshape merges a channel axis behind another axis (channels-last flatten)"
        )
        for d in labelled:
            w.poison(lab[d], reason)
        for d in gj:
            result[d] = w.fresh(out[d], reason)
    return tuple(result)


def _permute(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None:
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    op = _op_name(node)
    n = len(shape)
    if op == "permute":
        order = [d % n for d in node.args[1]]
    elif op == "t":
        order = list(range(n))[::-1]
    else:  # transpose
        a, b = node.args[1] % n, node.args[2] % n
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    return tuple(lab[d] for d in order)


def _expand(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None:
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    lead = len(out) - len(shape)
    for d, size in enumerate(shape):
        if size == 1 and out[lead + d] > 1 and lab[d] is not None:  # one channel broadcast to many
            w.poison(lab[d], "`expand` broadcasts a one-channel axis")
            lab[d] = w.fresh(out[lead + d], "`expand` broadcasts a one-channel axis")
    return (None,) * lead + tuple(lab)


def _slice(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or (out is None and _op_name(node) != "unbind"):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape)
    op = _op_name(node)
    if op == "unbind":
        w.poison(lab[dim], "`unbind` picks channels one by one")
        rest = tuple(lab[:dim] + lab[dim + 1 :])
        return [rest] * shape[dim]
    if op == "select":
        w.poison(lab[dim], "`select` picks one channel")
        del lab[dim]
        return tuple(lab)
    if out[dim] != shape[dim]:
        w.poison(lab[dim], "`slice` keeps part of a channel axis")
        lab[dim] = w.fresh(out[dim], "`slice` keeps part of a channel axis")
    return tuple(lab)


def _roll(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    """``roll``/``flip`` move entries along their dims: a channel axis among them is poisoned, the others carried."""
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None or len(out) != len(shape):
        return NotImplemented
    op = _op_name(node)
    dims = node.args[2] if op == "roll" and len(node.args) > 2 else node.args[1] if op == "flip" else None
    dims = node.kwargs.get("dims", dims)
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims:
        return NotImplemented  # roll without dims flattens the tensor
    lab = list(w.ndim_label(src, len(shape)))
    for d in dims:
        w.poison(lab[d % len(shape)], f"`{op}` moves channels")
        lab[d % len(shape)] = None
    return tuple(lab)


def _new_constant(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    """``new_zeros``/``zeros_like``...: a constant of the input's shape (the input's channels are not read)."""
    if any(isinstance(a, Node) for a in _flat((node.args[1:], tuple(node.kwargs.values())))):
        return NotImplemented
    return None if out is None else (None,) * len(out)


def _cat(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    tensors = [t for t in node.args[0] if isinstance(t, Node) and _shape(t.meta.get("val")) != (0,)]  # legacy empties
    shapes = [_shape(t.meta.get("val")) for t in tensors]
    if out is None or any(s is None or len(s) != len(out) for s in shapes):
        return NotImplemented
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
    labs = [w.ndim_label(t, len(out)) for t in tensors]
    result: list[Label] = [None] * len(out)
    for d in range(len(out)):
        if d == dim:
            if all(lab[d] is None for lab in labs):
                continue
            segs: list[Segment] = []
            for s, lab in zip(shapes, labs, strict=True):
                part = lab[d] if lab[d] is not None else w.fresh(s[d], "concatenated with untraced channels")
                segs.extend(part or ())
            result[d] = tuple(segs)
        else:
            label: Label = None
            for lab in labs:
                label = w.join(label, lab[d], "`cat`")
            result[d] = label
    return tuple(result)


def _pad(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None or len(out) != len(shape):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    padded = len(node.args[1]) // 2
    for d in range(len(shape) - padded, len(shape)):
        if out[d] != shape[d] and lab[d] is not None:
            w.poison(lab[d], "`pad` pads a channel axis")
            lab[d] = w.fresh(out[d], "`pad` pads a channel axis")
    return tuple(lab)


def _softmax(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    if out is None:
        return NotImplemented
    lab = w.ndim_label(src, len(out))
    dim = node.args[1] % len(out)
    w.poison(lab[dim], f"`{_op_name(node)}` mixes channels")
    return tuple(lab)


def _linear(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    wname, bname = w.param_of(weight), w.param_of(bias)
    if wname is None or (bias is not None and bname is None) or out is None:
        return NotImplemented
    shape = _shape(x.meta.get("val"))
    lab = w.ndim_label(x, len(shape))
    w.add_segments(wname, "in", 1, lab[-1])
    space = w.new_space(out[-1])
    w.add_member(wname, "out", 0, 0, out[-1], space)
    if bname is not None:
        w.add_member(bname, "out", 0, 0, out[-1], space)
    return (*lab[:-1], ((space, out[-1], 1),))


def _addmm(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    """``addmm(bias, x, W)`` / ``mm(x, W)`` with a parameter ``W`` of shape ``[in, out]`` (transformers ``Conv1D``)."""
    bias, x, weight = (node.args[0], node.args[1], node.args[2]) if _op_name(node) == "addmm" else (None, *node.args)
    wname, bname = w.param_of(weight), w.param_of(bias)
    if wname is None or (bias is not None and bname is None) or out is None or len(out) != 2:
        return NotImplemented
    lab = w.ndim_label(x, 2)
    w.add_segments(wname, "in", 0, lab[1])
    space = w.new_space(out[1])
    w.add_member(wname, "out", 1, 0, out[1], space)
    if bname is not None:
        w.add_member(bname, "out", 0, 0, out[1], space)
    return (lab[0], ((space, out[1], 1),))


def _embedding(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    wname = w.param_of(node.args[0])
    if wname is None or out is None:
        return NotImplemented
    space = w.new_space(out[-1])
    w.add_member(wname, "out", 1, 0, out[-1], space)
    return (None,) * (len(out) - 1) + (((space, out[-1], 1),),)


def _batch_norm(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    x, weight, bias = node.args[0], node.args[1], node.args[2]
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


def _group_norm(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    x, groups = node.args[0], node.args[1]
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


def _layer_norm(w: Walk, node: Node, out: tuple[int, ...] | None) -> Any:
    x, normalized = node.args[0], node.args[1]
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


_HANDLERS = {
    "linear": _linear,
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "convolution": _conv,
    "conv_transpose1d": _conv,
    "conv_transpose2d": _conv,
    "conv_transpose3d": _conv,
    "embedding": _embedding,
    "addmm": _addmm,
    "mm": _addmm,
    "group_norm": _group_norm,
    "layer_norm": _layer_norm,
    "rms_norm": _layer_norm,
    "permute": _permute,
    "transpose": _permute,
    "t": _permute,
    "expand": _expand,
    "slice": _slice,
    "select": _slice,
    "unbind": _slice,
    "cat": _cat,
    "roll": _roll,
    "flip": _roll,
    **dict.fromkeys(
        ("new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like"), _new_constant
    ),
    "constant_pad_nd": _pad,
    "pad": _pad,
    "softmax": _softmax,
    "_softmax": _softmax,
    "log_softmax": _softmax,
    "_log_softmax": _softmax,
    **_ATTENTION,
}
#: Op families sharing one handler (looked up after ``_HANDLERS``).
_FAMILIES = (
    (_UNARY, _unary),
    (_BINARY, _elementwise),
    (_POOL, _pool),
    (_VIEWS, _view),
    (_BATCH_NORMS, _batch_norm),
    (_REDUCE, _reduce),
)
#: Argument positions that are weight slots (a parameter there is not "used directly").
_SLOTS: dict[str, tuple[int, ...]] = {
    "linear": (1, 2),
    "conv1d": (1, 2),
    "conv2d": (1, 2),
    "conv3d": (1, 2),
    "convolution": (1, 2),
    "conv_transpose1d": (1, 2),
    "conv_transpose2d": (1, 2),
    "conv_transpose3d": (1, 2),
    "embedding": (0,),
    "addmm": (0, 2),
    "mm": (1,),
    "batch_norm": (1, 2),
    "group_norm": (2, 3),
    "layer_norm": (2, 3),
    "rms_norm": (2,),
}
