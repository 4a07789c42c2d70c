"""Handlers of the ops that read no parameter: they carry a label on, join two, or poison what they mix.

Elementwise ops carry their operand's labels (an op of two labelled tensors joins their spaces, a broadcast of a
one-channel axis poisons it); pooling, reductions and softmax poison the axes they mix; the layout ops (``view``,
``permute``, ``expand``, ``slice``, ``cat``, ``stack``, ``pad``, ``roll``, ``index_select``, ``gather`` along an
axis of positions) move labels with their axes (a ``slice`` of a channel axis cuts it into parts, as ``split``
does). A ``view`` that splits a channel axis into heads is read by
:func:`~lightning_pat.discovery.attention.split_axis` and :func:`~lightning_pat.discovery.attention.packed_heads`.
"""

from __future__ import annotations

import math
from typing import Any, cast

from torch.fx import Node

from lightning_pat.discovery.attention import cut_label, packed_heads, split_axis
from lightning_pat.discovery.labels import Handler, Label, Labelling, Segment
from lightning_pat.discovery.nodes import flat as _flat
from lightning_pat.discovery.nodes import node_shape
from lightning_pat.discovery.nodes import op_name as _op_name
from lightning_pat.discovery.nodes import shape_of as _shape
from lightning_pat.discovery.trace import OPAQUE_SELECTION
from lightning_pat.discovery.zeros import zero_where_dropped

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
    "masked_fill",
}
_POOL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d", "upsample_trilinear3d",
    "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa",
}  # fmt: skip
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
#: Op names (public for the walk's per-channel scales): elementwise ops of tensors, unary ops, reshapes.
ELEMENTWISE = frozenset(_BINARY)
UNARY = frozenset(_UNARY)
VIEWS = frozenset(_VIEWS)
_REDUCE = {"mean", "sum", "amax", "amin", "var", "std", "max", "min", "prod", "logsumexp", "norm", "linalg_vector_norm"}


def _unary(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    if any(isinstance(a, Node) for a in _flat((node.args[1:], tuple(node.kwargs.values())))):
        return NotImplemented  # another tensor takes part (a PReLU weight, a tensor bound): not a unary op
    lab = w.label_of(node.args[0])
    if out is None:  # e.g. native_dropout returns (out, mask)
        val = node.meta.get("val")
        return [lab, lab] if isinstance(val, (list, tuple)) else NotImplemented
    return lab if lab is not None and len(lab) == len(out) else NotImplemented


def _elementwise(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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
        for _, part in present:
            label = w.join(label, part, f"`{op}`") if part is not None else label
        if label is not None and any(lab is None for _, lab in present):
            w.poison(label, f"`{op}` with a tensor whose channels are not traced")
        result[-i] = label
    return tuple(result)


def _pool(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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


def _reduce(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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
    dims = sorted({d % len(shape) for d in cast("list[int]", dims)}) if shape else []  # ints (checked above)
    lab = w.ndim_label(node.args[0], len(shape))
    for d in dims:
        if not _sums_zeros(w, node, lab[d]):
            w.poison(lab[d], f"`{op}` reduces over a channel axis")
    keep = [lab[d] for d in range(len(shape)) if d not in dims]
    if len(out) == len(shape):  # keepdim
        keep = [None if d in dims else lab[d] for d in range(len(shape))]
    if len(keep) != len(out):
        return NotImplemented
    return tuple(keep)


def _sums_zeros(w: Labelling, node: Node, label: Label) -> bool:
    """Whether a reduction over an axis of ``label`` is exact under the shrink.

    It is for a sum (or a vector norm of a positive order) of values that are zero in every dropped channel
    (:func:`~lightning_pat.discovery.zeros.zero_where_dropped`: an L2 norm over an MLP's width or over all heads, as in
    Dory's sub-norms); a mean never is.
    """
    op = _op_name(node)
    if label is None or op not in ("sum", "linalg_vector_norm", "norm"):
        return False
    if op != "sum":
        order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", node.kwargs.get("p", 2))
        if not isinstance(order, (int, float)) or order <= 0:
            return False
    return all(zero_where_dropped(w, node.args[0], seg[0]) for seg in label)


def _view(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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
        if len(labelled) == 1 and labelled[0] != gi[0] and gi[0] == 0 and len(gj) == 1:
            # heads merged into the batch axis, (B, H, ...) -> (B*H, ...) (Bloom's bmm): B copies of the head label
            k = gi.index(labelled[0])
            trailing = math.prod(shape[d] for d in gi[k + 1 :])
            segs = cast("tuple[Segment, ...]", lab[labelled[0]])  # labelled
            result[gj[0]] = tuple((s, u, b * trailing) for s, u, b in segs) * math.prod(shape[d] for d in gi[:k])
            continue
        if len(labelled) == 1 and labelled[0] == gi[0]:
            trailing = math.prod(shape[d] for d in gi[1:])
            segs = cast("tuple[Segment, ...]", lab[gi[0]])  # labelled
            merged: Label = tuple((s, u, b * trailing) for s, u, b in segs)
            if len(gj) == 1:
                result[gj[0]] = merged
                continue
            if (base := _repeated(merged, out[gj[0]])) is not None and len(gj) == 2:
                result[gj[1]] = base  # (B*H, ...) -> (B, H, ...): the batch copies of a head label apart again
                continue
            if len(gj) >= 3 and _parts_first(node, gj) and (heads := packed_heads(w, merged, [out[d] for d in gj])):
                result[gj[1]] = heads  # (parts, heads, head_dim, ...): a packed QKV; the parts axis lies inside a unit
                continue
            if (split := split_axis(w, merged, out[gj[0]])) is not None:
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


def _repeated(label: Label, copies: int) -> Label:
    """The label that ``label`` is ``copies`` copies of, one after the other, or ``None``."""
    if label is None or copies < 2 or len(label) % copies:
        return None
    base = label[: len(label) // copies]
    return base if base * copies == label else None


#: Ops that keep a tensor's axes where they are (followed by :func:`_parts_first`).
_SAME_AXES = {"clone", "contiguous", "alias", "detach", "_to_copy", "to", "type_as", "dropout"}
#: Ops that pick entries along one axis (``dim`` their second argument).
_PICKS = {"select", "unbind", "slice", "split", "split_with_sizes", "chunk"}


def _parts_first(node: Node, axes: list[int], depth: int = 6) -> bool:
    """Whether the reshape ``node`` into ``(..., a0, a1, ...)`` (at ``axes``) has its parts on the first of them.

    A packed projection reshaped into three axes or more: timm's ``(3, heads, head_dim)`` picks the parts from the
    first (``unbind``/``select`` after a ``permute``), Bloom's ``(heads, 3, head_dim)`` from the second. The users are
    followed through ``permute``/``transpose`` and copies to the first op that picks along one of the axes; ``True``
    when it is the first axis, or when none is found (the layout read so far).
    """
    frontier: list[tuple[Node, list[int]]] = [(node, list(axes))]
    for _ in range(depth):
        following: list[tuple[Node, list[int]]] = []
        for n, where in frontier:
            for user in n.users:
                op = _op_name(user)
                ndim = len(_shape(n.meta.get("val")) or ())
                if op in _PICKS and ndim:
                    dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
                    if isinstance(dim, int) and dim % ndim in where:
                        return dim % ndim == where[0]
                elif op == "permute" and ndim:
                    order = [d % ndim for d in cast("list[int]", user.args[1])]
                    following.append((user, [order.index(d) for d in where]))
                elif op == "transpose" and ndim:
                    a, b = cast(int, user.args[1]) % ndim, cast(int, user.args[2]) % ndim
                    following.append((user, [b if d == a else a if d == b else d for d in where]))
                elif op in _SAME_AXES:
                    following.append((user, where))
        frontier = following
    return True


def _permute(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None:
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    op = _op_name(node)
    n = len(shape)
    if op == "permute":
        order = [d % n for d in cast("list[int]", node.args[1])]
    elif op in ("t", "numpy_T"):  # `W.t()`, `W.T`: every dim reversed
        order = list(range(n))[::-1]
    else:  # transpose
        a, b = cast(int, node.args[1]) % n, cast(int, node.args[2]) % n
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    return tuple(lab[d] for d in order)


def _expand(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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


def _slice(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or (out is None and _op_name(node) != "unbind"):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    dim = cast(int, node.args[1] if len(node.args) > 1 else 0) % len(shape)
    op = _op_name(node)
    if op == "unbind":
        w.poison(lab[dim], "`unbind` picks channels one by one")
        rest = tuple(lab[:dim] + lab[dim + 1 :])
        return [rest] * shape[dim]
    if op == "select":
        w.poison(lab[dim], "`select` picks one channel")
        del lab[dim]
        return tuple(lab)
    size = cast("tuple[int, ...]", out)[dim]  # known: only unbind's is None
    if size != shape[dim] and lab[dim] is not None:  # an untracked axis (inside a unit) stays untracked
        part = _slice_part(w, node, lab[dim], shape[dim])
        if part is None:
            w.poison(lab[dim], "`slice` keeps part of a channel axis")
            part = w.fresh(size, "`slice` keeps part of a channel axis")
        lab[dim] = part
    return tuple(lab)


def _slice_part(w: Labelling, node: Node, label: Label, length: int) -> Label:
    """The label of ``x[..., start:stop]`` of a channel axis (step 1), or ``None``.

    The axis is cut at ``start`` and ``stop`` (:func:`~lightning_pat.discovery.attention.cut_label`: Phi-3's fused
    ``qkv_proj`` sliced into q, k and v; each part a space of its own) and the part kept is returned.
    """
    start = node.args[2] if len(node.args) > 2 else None
    stop = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if label is None or step != 1 or not all(isinstance(b, (int, type(None))) for b in (start, stop)):
        return None
    first, last = cast("int | None", start), cast("int | None", stop)  # ints or None (checked above)
    lo = 0 if first is None else first + length if first < 0 else first
    hi = length if last is None else last + length if last < 0 else last
    lo, hi = min(max(lo, 0), length), min(max(hi, 0), length)
    if hi <= lo:
        return None
    sizes = [n for n in (lo, hi - lo, length - hi) if n]
    parts = cut_label(w, label, sizes)
    return None if parts is None else parts[1 if lo else 0]


def _index_select(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``index_select(x, dim, index)``: entries picked along ``dim`` (a position table), the other axes carried.

    A channel axis picked from is poisoned; the picked axis is untracked (its entries are positions, not channels).
    """
    src, dim, index = node.args[0], node.args[1], node.args[2]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None or len(out) != len(shape) or not isinstance(dim, int):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    d = dim % len(shape)
    w.poison(lab[d], f"`{_op_name(node)}` picks channels")
    for label in w.label_of(index) or ():
        w.poison(label, f"`{_op_name(node)}` picks entries by channels")
    lab[d] = None
    return tuple(lab)


def _broadcast_index(index: Any, d: int) -> bool:
    """Whether axis ``d`` of a gather's ``index`` is one entry broadcast (``expand`` of a size-1 axis)."""
    if not isinstance(index, Node) or _op_name(index) != "expand" or not isinstance(index.args[0], Node):
        return False
    src, out = _shape(index.args[0].meta.get("val")), _shape(index.meta.get("val"))
    if src is None or out is None:
        return False
    at = d - (len(out) - len(src))
    return at < 0 or src[at] == 1


def _gather(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``gather(x, dim, index)``: entries of ``x`` picked along ``dim`` by position, apart at each entry of the others.

    Inkling's relative-position bias picks one row of distances per head. A channel axis picked from is poisoned;
    another axis keeps its label where the index spans it whole and is the same at each of its entries (broadcast by
    ``expand``: the shrunk model broadcasts it to the kept channels), and is poisoned otherwise. The picked axis is
    untracked.
    """
    src, dim, index = node.args[0], node.args[1], node.args[2]
    shape, ishape = node_shape(src), node_shape(index)
    if shape is None or ishape is None or out is None or len(out) != len(shape) or not isinstance(dim, int):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    ilab = w.ndim_label(index, len(ishape))
    d = dim % len(shape)
    op = _op_name(node)
    result: list[Label] = [None] * len(out)
    for k, label in enumerate(lab):
        if ilab[k] is not None:
            w.poison(ilab[k], f"`{op}` picks entries by channels")
        if label is None:
            continue
        if k == d:
            w.poison(label, f"`{op}` picks channels")
        elif ishape[k] != shape[k] or not _broadcast_index(index, k):
            w.poison(label, f"`{op}` picks differently along a channel axis")
        else:
            result[k] = label
    return tuple(result)


def _roll(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
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


def _new_constant(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``new_zeros``/``zeros_like``...: a constant of the input's shape (the input's channels are not read)."""
    if any(isinstance(a, Node) for a in _flat((node.args[1:], tuple(node.kwargs.values())))):
        return NotImplemented
    return None if out is None else (None,) * len(out)


def _type_as(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``a.type_as(b)``: ``a``'s values in ``b``'s dtype (``b``'s values are not read)."""
    lab = w.label_of(node.args[0])
    return lab if out is not None and lab is not None and len(lab) == len(out) else NotImplemented


def _selection(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """A data-dependent selection traced as one op (:data:`~lightning_pat.discovery.trace.OPAQUE_SELECTION`).

    What it reads is poisoned (its module's own parameters read those channels unseen); its output, a boolean or
    integer selection, carries no channels.
    """
    module = node.args[3] if len(node.args) > 3 else node.kwargs.get("module", "")
    reason = f"read by {module!r}, a data-dependent selection traced as an opaque op (its parameters are left whole)"
    for arg in _flat(node.args[0]):
        for lab in w.label_of(arg) or ():
            w.poison(lab, reason)
    return None if out is None else (None,) * len(out)


def _copy(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``dst.copy_(src)``: ``dst``'s axes are ``src``'s; where ``dst`` is a ``slice`` of a tensor, that tensor's too.

    MLA's keys (Dots3-note: ``key_states[..., :nope].copy_(k_nope)`` into a ``new_empty`` tensor): the written slice
    and the tensor it views are the copied channels on every axis the slices keep whole; an axis a slice cuts keeps
    its label, and a tracked channel axis copied into part of it is poisoned.
    """
    dst, src = node.args[0], node.args[1]
    if not isinstance(dst, Node) or not isinstance(src, Node) or out is None:
        return NotImplemented
    src_shape = _shape(src.meta.get("val"))
    if src_shape is None or len(src_shape) > len(out):
        return NotImplemented
    lead = len(out) - len(src_shape)
    src_lab = (None,) * lead + w.ndim_label(src, len(src_shape))
    lab = [w.join(a, b, "`copy_`") for a, b in zip(w.ndim_label(dst, len(out)), src_lab, strict=True)]
    w.labels[dst] = tuple(lab)
    base, cut = dst, set()
    while _op_name(base) == "slice" and isinstance(base.args[0], Node):  # views of the same storage
        base_shape = _shape(base.args[0].meta.get("val"))
        if base_shape is None or len(base_shape) != len(out):
            break
        cut.add(cast(int, base.args[1] if len(base.args) > 1 else 0) % len(out))
        base = base.args[0]
    if base is not dst:
        written = list(w.ndim_label(base, len(out)))
        for d in range(len(out)):
            if d in cut:
                w.poison(lab[d], "`copy_` writes a channel axis into part of another")
            else:
                written[d] = w.join(written[d], lab[d], "`copy_`")
        w.labels[base] = tuple(written)
    return tuple(lab)


def _cat(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    args = cast("list[Any]", node.args[0])
    tensors = [t for t in args if isinstance(t, Node) and _shape(t.meta.get("val")) != (0,)]  # legacy empties
    shapes = cast("list[tuple[int, ...]]", [_shape(t.meta.get("val")) for t in tensors])  # None: refused below
    if out is None or any(s is None or len(s) != len(out) for s in shapes):
        return NotImplemented
    dim = cast(int, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
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


def _stack(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``stack(tensors, dim)``: a new axis at ``dim`` (untracked: it indexes the tensors), the others joined.

    The tensors' axes are the same channels at each index (GPT-J's and CodeGen's rotary ``stack((-x2, x1), -1)`` of
    one head axis), so their labels are joined; a labelled axis stacked with an untraced one is poisoned (a dropped
    channel of one would not drop the other's).
    """
    args = cast("list[Any]", node.args[0])
    tensors = [t for t in args if isinstance(t, Node)]
    shapes = [_shape(t.meta.get("val")) for t in tensors]
    if out is None or not tensors or len(tensors) != len(args) or any(s is None or s != shapes[0] for s in shapes):
        return NotImplemented
    shape = cast("tuple[int, ...]", shapes[0])  # every shape is known and the same (checked above)
    if len(out) != len(shape) + 1:
        return NotImplemented
    dim = cast(int, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(out)
    labs = [w.ndim_label(t, len(shape)) for t in tensors]
    result: list[Label] = []
    for d in range(len(shape)):
        label: Label = None
        for lab in labs:
            label = w.join(label, lab[d], "`stack`")
        if label is not None and shape[d] > 1 and any(lab[d] is None for lab in labs):
            w.poison(label, "`stack` with a tensor whose channels are not traced")
        result.append(label)
    result.insert(dim, None)
    return tuple(result)


def _pad(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    shape = _shape(src.meta.get("val")) if isinstance(src, Node) else None
    if shape is None or out is None or len(out) != len(shape):
        return NotImplemented
    lab = list(w.ndim_label(src, len(shape)))
    padded = len(cast("list[int]", node.args[1])) // 2
    for d in range(len(shape) - padded, len(shape)):
        if out[d] != shape[d] and lab[d] is not None:
            w.poison(lab[d], "`pad` pads a channel axis")
            lab[d] = w.fresh(out[d], "`pad` pads a channel axis")
    return tuple(lab)


def _softmax(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    src = node.args[0]
    if out is None:
        return NotImplemented
    lab = w.ndim_label(src, len(out))
    dim = cast(int, node.args[1]) % len(out)
    w.poison(lab[dim], f"`{_op_name(node)}` mixes channels")
    return tuple(lab)


#: op -> handler.
HANDLERS: dict[str, Handler] = {
    "permute": _permute,
    "transpose": _permute,
    "t": _permute,
    "numpy_T": _permute,
    "expand": _expand,
    "expand_as": _expand,  # F.normalize: the norm expanded to its input's shape
    "slice": _slice,
    "select": _slice,
    "unbind": _slice,
    "cat": _cat,
    "copy": _copy,
    "stack": _stack,
    "roll": _roll,
    "index_select": _index_select,
    "gather": _gather,
    "flip": _roll,
    **dict.fromkeys(
        ("new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like"), _new_constant
    ),
    OPAQUE_SELECTION: _selection,
    "type_as": _type_as,
    "constant_pad_nd": _pad,
    "pad": _pad,
    "softmax": _softmax,
    "_softmax": _softmax,
    "log_softmax": _softmax,
    "_log_softmax": _softmax,
}
#: Op families sharing one handler (looked up after the handlers by name).
FAMILIES: tuple[tuple[set[str], Handler], ...] = (
    (_UNARY, _unary),
    (_BINARY, _elementwise),
    (_POOL, _pool),
    (_VIEWS, _view),
    (_REDUCE, _reduce),
)
