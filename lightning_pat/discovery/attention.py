"""Attention heads in the discovery walk (handlers on its :class:`~lightning_pat.discovery.labels.Labelling`).

Reshapes into heads, products of activations, ``split`` of a packed projection, ``repeat_interleave`` and
``scaled_dot_product_attention``.

A reshape that splits a channel axis ``C`` into ``(H, D, ...)`` (:func:`split_axis`) gives the first axis the
channels' space, coarsened so that a unit is a whole number of its entries (a head: ``D`` channels), and leaves the
other axes untracked: they lie inside one unit. From there the head axis is tracked like any channel axis: ops that
treat it as a batch axis (elementwise ops, RoPE's slices and concatenations of ``D``, softmax over keys, matmul and
``scaled_dot_product_attention`` whose batch axes are joined) keep it, and anything that mixes heads (a reduction or
softmax over heads, a reshape that puts it behind another axis, an op discovery does not know) poisons it. The
reshape back to ``(B, T, H*D)`` turns it into channels again, read by the output projection.

Why whole heads are exact: a dropped head's q/k/v rows and biases are zero and the output projection's columns for it
are zero, so whatever the head computes (any finite value: attention over zero keys is uniform over zero values) is
multiplied by zero columns; every kept head computes on exactly its own channels, because nothing on the way mixes
the head axis. Shrinking removes the head from every member; the shrink updates the head counts of Llama-style
(``q/k/v/o_proj`` with ``head_dim``, transformers' ViT too) and GPT-2 attention modules, and replaces
``nn.MultiheadAttention``, torchvision's Swin V1/V2 window attention and MaxViT's attention by modules of its own
(:mod:`lightning_pat.heads.replace`, which discovery traces in their place). A per-head parameter such a
module uses directly (Swin V2's logit scale ``[heads, 1, 1]``, multiplied into the logits) is declared by the module
and enters the walk as a member of a space of its own (:attr:`~lightning_pat.discovery.trace.Trace.per_head`), which
the product with the logits joins with their head axis. A custom forward that hard-codes the head count
(``view(b, t, 4, d)`` instead of ``view(b, t, -1, d)``) cannot run shrunk.

GQA: ``repeat_kv`` (``expand`` + ``reshape``), ``repeat_interleave`` and ``scaled_dot_product_attention(...,
enable_gqa=True)`` map query head ``h`` to KV head ``h // n_rep``; joining the query's head axis with the repeated
KV head axis coarsens the unit to a whole query group (one KV head and its ``n_rep`` query heads), as the presets do.

A packed projection (GPT-2's ``c_attn``, a fused QKV ``Linear``, a GLU's fused gate/up) is cut by ``split`` or by
slices (Phi-3's ``qkv[..., :q_size]``): the space the projection opened is refined into one space per part (its
rows/columns and bias sliced), and every label holding it so far is rewritten part by part, so another reader of the
packed output reads the parts. The heads may come first: Falcon's ``view(B, T, H + 2, D)`` then
``split([H, 1, 1])`` cuts the head axis (a space coarsened into heads keeps its members whole, so it can still be
cut). Bloom's ``(heads, 3, head_dim)`` layout is told from timm's ``(3, heads, head_dim)`` by the axis its users pick
from (``select``/``unbind``); its heads merged into the batch axis for ``bmm``/``baddbmm`` are carried as copies of
the head label, and ``baddbmm``'s added ALiBi bias (computed from the head count) poisons them.
"""

from __future__ import annotations

from typing import Any, cast

from torch.fx import Node

from lightning_pat.discovery import weights
from lightning_pat.discovery.labels import Handler, Label, Labelling, Segment
from lightning_pat.discovery.nodes import node_shape, op_name


def split_axis(w: Labelling, label: Label, first: int) -> Label:
    """The label of the first axis when a channel axis of ``label`` is reshaped into ``(first, ...)``, or ``None``.

    Every segment must hold whole entries of the first axis; each segment's space is coarsened so that a unit is a
    whole number of entries.
    """
    if label is None or first < 2:
        return None
    length = sum(u * b for _, u, b in label)
    if length % first:
        return None
    per = length // first  # channels per entry of the first axis (a head's D)
    segments: list[Segment] = []
    offset = 0
    for space, units, block in label:
        size = units * block
        if size % per or offset % per:
            return None
        w.coarsen(space, size // per, "a reshape into heads")
        segments.append((space, size // per, 1))
        offset += size
    return tuple(segments)


def packed_heads(w: Labelling, label: Label, sizes: list[int]) -> Label:
    """The head axis when a packed projection's channels are reshaped into ``(parts, heads, head_dim, ...)``.

    A fused QKV ``Linear`` reshaped as ``(B, N, 3, H, D)`` (timm's and torchvision Swin's attention; then ``permute``
    and ``unbind``/``select`` of the parts): its space is cut into the ``parts`` (as ``split`` would), the parts are
    joined (head ``h`` of q, of k and of v is one unit) and the second axis carries the heads; the parts axis and the
    axes after the heads lie inside a unit (untracked). ``None`` (and nothing changed) unless the label is one
    segment that can be cut into whole heads.
    """
    parts, heads = sizes[0], sizes[1]
    if label is None or len(label) != 1 or parts < 2 or heads < 2:
        return None
    length = label[0][1] * label[0][2]
    if length % parts or (length // parts) % heads:
        return None
    pieces = cut_label(w, label, [length // parts] * parts)
    if pieces is None:
        return None
    joined = pieces[0]
    for other in pieces[1:]:
        joined = w.join(joined, other, "the parts of a packed projection")
    return split_axis(w, joined, heads)


# ---------------------------------------------------------------------------------------------------- batch axes
def _join_batch(
    w: Labelling, operands: list[tuple[tuple[int, ...], tuple[Label, ...]]], out: tuple[int, ...], op: str
) -> list[Label]:
    """Right-aligned broadcast join of leading (batch) axes; labels of ``out``'s axes."""
    result: list[Label] = [None] * len(out)
    for i in range(1, len(out) + 1):
        label: Label = None
        for shape, lab in operands:
            if len(shape) < i:
                continue
            if shape[-i] == 1 and out[-i] > 1:
                w.poison(lab[-i], f"`{op}` broadcasts a one-channel axis")
            elif lab[-i] is not None:
                label = w.join(label, lab[-i], f"`{op}`")
        result[-i] = label
    return result


def _contract(w: Labelling, labels: list[Label], op: str) -> None:
    for label in labels:
        w.poison(label, f"`{op}` sums over a channel axis of two activations")


def _matmul(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``matmul``/``bmm`` of two activations with at least 2 dims: batch axes joined, the contracted axis poisoned.

    ``matmul(x, W.T)`` of a 2-D parameter ``W`` is a linear layer (:func:`~lightning_pat.discovery.weights.
    matmul_transposed`).
    """
    a, b = node.args[0], node.args[1]
    if op_name(node) == "matmul" and (wname := weights.transposed_param(w, b)) is not None:
        return weights.matmul_transposed(w, node, wname, out)  # `x @ weight.T`: a linear layer
    sa, sb = node_shape(a), node_shape(b)
    if out is None or sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
        return NotImplemented
    la, lb = w.ndim_label(a, len(sa)), w.ndim_label(b, len(sb))
    op = op_name(node)
    _contract(w, [la[-1], lb[-2]], op)
    batch = _join_batch(w, [(sa[:-2], la[:-2]), (sb[:-2], lb[:-2])], out[:-2], op)
    return (*batch, la[-2], lb[-1])


def _baddbmm(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``baddbmm(input, batch1, batch2)``: ``bmm(batch1, batch2)`` (:func:`_matmul`) plus ``input``, broadcast.

    Bloom adds its ALiBi bias this way, one row per (batch, head): a labelled axis added to an axis of ``input``
    whose channels are not traced is poisoned (the bias of a head is not cut with it).
    """
    bias, a, b = node.args[0], node.args[1], node.args[2]
    sa, sb, sbias = node_shape(a), node_shape(b), node_shape(bias)
    if out is None or sa is None or sb is None or sbias is None or len(sa) != 3 or len(sb) != 3:
        return NotImplemented
    la, lb = w.ndim_label(a, 3), w.ndim_label(b, 3)
    op = op_name(node)
    _contract(w, [la[-1], lb[-2]], op)
    product = (*_join_batch(w, [(sa[:-2], la[:-2]), (sb[:-2], lb[:-2])], out[:-2], op), la[-2], lb[-1])
    lbias = w.ndim_label(bias, len(sbias))
    result: list[Label] = list(product)
    for i in range(1, min(len(out), len(sbias)) + 1):
        theirs, ours = lbias[-i], result[-i]
        if sbias[-i] == 1 and out[-i] > 1:
            w.poison(theirs, f"`{op}` broadcasts a one-channel axis")
        elif ours is None:
            result[-i] = theirs
        elif theirs is None or [u * b for _, u, b in theirs] != [u * b for _, u, b in ours]:
            w.poison(ours, f"`{op}` adds a tensor computed apart from these channels (e.g. a per-head ALiBi bias)")
        else:
            result[-i] = w.join(ours, theirs, f"`{op}`")
    return tuple(result)


def _repeat_each(label: Label, times: int) -> Label:
    return None if label is None else tuple((s, u, b * times) for s, u, b in label)


def _sdpa(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``scaled_dot_product_attention(q, k, v, attn_mask, ...)``: heads and batch joined over q, k and v."""
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    shapes = [node_shape(t) for t in (q, k, v)]
    if out is None or any(s is None or len(s) < 3 for s in shapes) or isinstance(node.meta.get("val"), (list, tuple)):
        return NotImplemented
    sq, sk, sv = cast("list[tuple[int, ...]]", shapes)  # none is None (checked above)
    lq, lk, lv = (w.ndim_label(t, len(s)) for t, s in zip((q, k, v), (sq, sk, sv), strict=True))
    op = op_name(node)
    _contract(w, [lq[-1], lk[-1], lk[-2], lv[-2]], op)  # q.k over D, weights.v over the keys
    for lab in w.ndim_label(mask, len(node_shape(mask) or ())) if isinstance(mask, Node) else ():
        w.poison(lab, f"`{op}`'s attention mask carries channels")
    heads_q, heads_kv = sq[-3], sk[-3]
    if heads_kv != heads_q:  # enable_gqa: query head h reads KV head h // n_rep
        if heads_q % heads_kv or sv[-3] != heads_kv:
            return NotImplemented
        n_rep = heads_q // heads_kv
        lk = (*lk[:-3], _repeat_each(lk[-3], n_rep), *lk[-2:])
        lv = (*lv[:-3], _repeat_each(lv[-3], n_rep), *lv[-2:])
        sk = (*sk[:-3], heads_q, *sk[-2:])
        sv = (*sv[:-3], heads_q, *sv[-2:])
    batch = _join_batch(w, [(sq[:-2], lq[:-2]), (sk[:-2], lk[:-2]), (sv[:-2], lv[:-2])], out[:-2], op)
    return (*batch, lq[-2], lv[-1])


def _repeat_interleave(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``repeat_interleave(x, n, dim)``: entry ``i`` becomes entries ``[i*n, (i+1)*n)`` (KV heads for GQA)."""
    x, repeats = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    shape = node_shape(x)
    if out is None or shape is None or not isinstance(repeats, int) or not isinstance(dim, int):
        return NotImplemented
    lab = list(w.ndim_label(x, len(shape)))
    lab[dim % len(shape)] = _repeat_each(lab[dim % len(shape)], repeats)
    return tuple(lab)


# ---------------------------------------------------------------------------------------------------- split
def _referencing(w: Labelling, spaces: frozenset[int]) -> list[Node]:
    """The nodes visited so far whose labels hold one of ``spaces``."""

    def holds(value: Any) -> bool:
        if isinstance(value, list):
            return any(holds(v) for v in value)
        return isinstance(value, tuple) and any(
            lab is not None and any(s in spaces for s, _, _ in lab) for lab in value
        )

    return [n for n, value in w.labels.items() if holds(value)]


def _rewrite(value: Any, space: int, units: int, parts: list[tuple[int, int]]) -> Any:
    """A node's labels with every segment of ``space`` replaced by its parts ``(part space, units)``, in order."""
    if isinstance(value, list):
        return [_rewrite(v, space, units, parts) for v in value]
    if not isinstance(value, tuple):
        return value
    out: list[Label] = []
    for lab in value:
        if lab is None or all(s != space for s, _, _ in lab):
            out.append(lab)
            continue
        segs: list[Segment] = []
        for s, u, b in lab:
            per = u * b // units  # entries of this axis per unit of the space
            segs.extend([(p, n, per) for p, n in parts] if s == space else [(s, u, b)])
        out.append(tuple(segs))
    return tuple(out)


def _refine(w: Labelling, space: int, length: int, cuts: list[int]) -> list[int] | None:
    """Split ``space`` (a segment of ``length`` channels) at ``cuts`` into new spaces, one per part, or ``None``.

    ``space`` and every space joined with it (a fused projection's rows added to an adapter's, Zamba 2's
    ``gate_up_proj`` and its LoRA-style ``gate_up_proj_adapter_list``) are one index space: each is cut at the same
    units. Only a space cut between its units, whose members each hold a whole multiple of ``length`` (a
    projection's rows, columns, bias), can be refined. The labels of the nodes visited so far that hold it are
    rewritten with the parts, so later readers of the packed channels (the other slices of a fused projection) read
    them part by part.
    """
    root = w.find(space)
    joined = frozenset(s for s in range(len(w.parent)) if w.find(s) == root)
    units = w.spaces[root].units
    block = length // units
    if length % units or any(c % block for c in cuts):
        return None
    keys = [k for k, s in w.members.items() if s in joined]
    if any((stop - start) % length for _, _, start, stop in keys):
        return None
    holders = _referencing(w, joined)
    if any(
        u * b % units
        for n in holders
        for value in (w.labels[n] if isinstance(w.labels[n], list) else [w.labels[n]])
        for lab in value or ()
        for s, u, b in lab or ()
        if s in joined
    ):
        return None  # a holder's axis does not hold whole units
    bounds = [0, *cuts, length]
    sizes = [(hi - lo) // block for lo, hi in zip(bounds, bounds[1:], strict=False)]
    parts = [w.new_space(n) for n in sizes]
    for part in parts:
        w.spaces[part].reasons.extend(w.spaces[root].reasons)
    for key in keys:
        param, dim, start, stop = key
        scale = (stop - start) // length
        flow = w.flows.pop(key)
        del w.members[key]
        for part, lo, hi in zip(parts, bounds, bounds[1:], strict=False):
            w.members[(param, dim, start + lo * scale, start + hi * scale)] = part
            w.flows[(param, dim, start + lo * scale, start + hi * scale)] = flow
    for n in holders:
        for s in joined:
            w.labels[n] = _rewrite(w.labels[n], s, units, list(zip(parts, sizes, strict=True)))
    return parts


def cut_label(w: Labelling, label: Label, sizes: list[int]) -> list[Label] | None:
    """The labels of consecutive parts of sizes ``sizes`` of an axis labelled ``label``, or ``None``.

    A space that a boundary falls inside is refined into one space per part (:func:`_refine`); ``None`` (and nothing
    changed for that space) where it cannot be.
    """
    segments: list[Segment] = []
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    offset = 0
    for space, units, block in label or ():
        size = units * block
        inner = [c - offset for c in bounds if offset < c < offset + size]
        if not inner:
            segments.append((space, units, block))
        else:
            parts = _refine(w, space, size, inner)
            if parts is None:
                return None
            edges = [0, *inner, size]
            segments.extend((p, (hi - lo) // block, block) for p, lo, hi in zip(parts, edges, edges[1:], strict=False))
        offset += size
    out: list[Label] = []
    for size in sizes:
        part: list[Segment] = []
        while size > 0:
            seg = segments.pop(0)
            part.append(seg)
            size -= seg[1] * seg[2]
        if size:
            return None
        out.append(tuple(part))
    return out


def _split(w: Labelling, node: Node, out: tuple[int, ...] | None) -> Any:
    """``split`` / ``split_with_sizes`` / ``chunk``: the parts of a channel axis (a packed QKV) get their own spaces."""
    x = node.args[0]
    shape = node_shape(x)
    values = node.meta.get("val")
    if shape is None or not isinstance(values, (list, tuple)):
        return NotImplemented
    dim = cast(int, node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    dim %= len(shape)
    sizes = [int(v.shape[dim]) for v in values]
    lab = w.ndim_label(x, len(shape))
    parts = [None] * len(sizes) if lab[dim] is None else cut_label(w, lab[dim], sizes)
    if parts is None:
        reason = f"`{op_name(node)}` cuts a channel axis inside a unit, or one joined with other channels"
        w.poison(lab[dim], reason)
        parts = [w.fresh(s, reason) for s in sizes]
    return [(*lab[:dim], part, *lab[dim + 1 :]) for part in parts]


#: op -> handler.
HANDLERS: dict[str, Handler] = {
    "matmul": _matmul,
    "bmm": _matmul,
    "baddbmm": _baddbmm,
    "scaled_dot_product_attention": _sdpa,
    "repeat_interleave": _repeat_interleave,
    "split": _split,
    "split_with_sizes": _split,
    "chunk": _split,
}
