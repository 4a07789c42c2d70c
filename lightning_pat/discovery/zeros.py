"""Which values are zero where a unit is dropped: the test that lets a sum over a channel axis stay exact.

A masked model holds zeros in every member of a dropped unit (a writer's rows and bias, a per-channel scale's
entries, a reader's columns). A *sum* over a channel axis (an L2 norm's ``x.pow(2).sum(-1)``, nGPT's unit-norm
projections in Dory) is exact under the shrink when the summed values are zero in the dropped channels: the masked
sum adds zeros where the shrunk one has nothing. A *mean* is not (it divides by the width), nor is a maximum.

:func:`zero_where_dropped` answers that for one node and one space by walking back from the node through the ops that
keep zeros in place: a writer whose rows and bias are members of the space (``linear``, a convolution), a parameter
that is a member itself (a per-channel scale), unary ops with ``f(0) = 0`` (``relu``, ``silu``, ``gelu``, ``square``,
casts and copies), the layout ops, a product with any zero factor, a quotient with a zero numerator, a sum or
difference of zero terms only, ``pow`` by a positive exponent, and the batched products of attention (``matmul``,
``bmm``, ``scaled_dot_product_attention``) whose zero operand holds the space on an axis they do not contract. Any
other op answers no.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from lightning_pat.discovery.labels import Labelling
from lightning_pat.discovery.nodes import op_name

#: f(0) = 0, one tensor operand.
_KEEPS_ZERO = {
    "relu", "relu6", "gelu", "silu", "tanh", "hardtanh", "hardswish", "leaky_relu", "elu", "selu", "celu", "mish",
    "neg", "abs", "sqrt", "square", "erf", "sign", "dropout", "feature_dropout", "alpha_dropout", "clone",
    "contiguous", "detach", "alias", "_to_copy", "to", "lift_fresh_copy", "identity", "native_dropout", "type_as",
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "permute", "transpose", "t",
    "expand", "slice", "split", "split_with_sizes", "chunk", "unbind", "repeat_interleave", "repeat",
}  # fmt: skip
#: Writers: the output channels are the weight's rows (with the bias, if any).
_WRITERS = {"linear": (1, 2), "convolution": (1, 2), "conv1d": (1, 2), "conv2d": (1, 2), "conv3d": (1, 2)}
#: Products over a contracted axis: (first operand's contracted axis, second operand's).
_PRODUCTS = {"matmul": (-1, -2), "bmm": (-1, -2)}
_DEPTH = 400  # enough for any chain between a writer and a norm; deeper answers no


def _holds(w: Labelling, node: Any, root: int) -> bool:
    """Whether an axis of ``node``'s labels holds a segment of space ``root``."""
    return any(lab is not None and any(w.find(seg[0]) == root for seg in lab) for lab in w.label_of(node) or ())


def _member(w: Labelling, param: str | None, root: int) -> bool:
    """Whether channels of ``param``'s first axis are members of space ``root`` (zero in the masked model)."""
    return param is not None and any(k[0] == param and k[1] == 0 and w.find(s) == root for k, s in w.members.items())


def zero_where_dropped(w: Labelling, node: Any, space: int) -> bool:
    """Whether ``node``'s value is zero wherever an axis labelled with ``space`` is at a dropped unit (masked model).

    Args:
        w: The labelling of the walk (its labels and members so far).
        node: A graph node (anything else answers no, except the literal ``0``).
        space: A space id.

    Returns:
        ``True`` only where the ops from the members of ``space`` to ``node`` keep the masked zeros in place.
    """
    return _zero(w, node, w.find(space), {}, 0)


def _zero(w: Labelling, node: Any, root: int, memo: dict[Node, bool], depth: int) -> bool:
    if not isinstance(node, Node):
        return isinstance(node, (int, float)) and node == 0
    if node in memo:
        return memo[node]
    memo[node] = False  # a cycle or a deep chain answers no
    if depth > _DEPTH:
        return False
    memo[node] = found = _rule(w, node, root, memo, depth + 1)
    return found


def _rule(w: Labelling, node: Node, root: int, memo: dict[Node, bool], depth: int) -> bool:
    if node.op == "placeholder":
        return _member(w, w.param_of(node), root)
    if node.op != "call_function":
        return False
    op = op_name(node)
    op = op[:-1] if op.endswith("_") and not op.endswith("__") else op
    args = node.args
    if op == "getitem":  # a part of a split, a dropout's output
        return _zero(w, args[0], root, memo, depth)
    if op in _WRITERS:
        weight, bias = (args[i] if len(args) > i else None for i in _WRITERS[op])
        return _member(w, w.param_of(weight), root) and (bias is None or _member(w, w.param_of(bias), root))
    if op in _KEEPS_ZERO:
        return _zero(w, args[0], root, memo, depth)
    if op == "mul":
        return any(_zero(w, a, root, memo, depth) for a in args if isinstance(a, Node))
    if op in ("div", "true_divide"):
        return _zero(w, args[0], root, memo, depth)
    if op in ("add", "sub"):
        return all(_zero(w, a, root, memo, depth) for a in args[:2])
    if op == "pow":
        exponent = args[1] if len(args) > 1 else None
        return isinstance(exponent, (int, float)) and exponent > 0 and _zero(w, args[0], root, memo, depth)
    if op in _PRODUCTS:
        return any(
            isinstance(a, Node)
            and _holds(w, a, root)
            and not _holds_at(w, a, root, axis)
            and _zero(w, a, root, memo, depth)
            for a, axis in zip(args[:2], _PRODUCTS[op], strict=False)
        )
    if op == "scaled_dot_product_attention":  # zero values of a head give that head zero outputs
        value = args[2] if len(args) > 2 else None
        return _zero(w, value, root, memo, depth) and not _holds_at(w, value, root, -1)
    return False


def _holds_at(w: Labelling, node: Any, root: int, axis: int) -> bool:
    """Whether axis ``axis`` of ``node``'s labels holds a segment of space ``root``."""
    labels = w.label_of(node) or ()
    if not labels:
        return False
    lab = labels[axis % len(labels)]
    return lab is not None and any(w.find(seg[0]) == root for seg in lab)
