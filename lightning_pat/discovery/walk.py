"""Label propagation over a traced graph, for :mod:`lightning_pat.discovery.entry` (see its module docstring).

:class:`Walk` visits the graph's nodes in order and applies one handler per ATen op to its
:class:`~lightning_pat.discovery.labels.Labelling`; an op without a handler poisons every label it touches. The
handlers live with their ops, each module with its tables (``HANDLERS`` by op name; where it has them, ``FAMILIES``
of ops that share one handler and ``SLOTS``, the argument positions that are weight slots):
:mod:`~lightning_pat.discovery.tensor_ops` (ops that read no parameter), :mod:`~lightning_pat.discovery.weights`
(``linear``, ``mm``, ``embedding``, the norms), :mod:`~lightning_pat.discovery.conv` and
:mod:`~lightning_pat.discovery.attention`; this module merges them.
"""

from __future__ import annotations

from typing import Any, cast

from torch.fx import Node

from lightning_pat.discovery import attention, conv, tensor_ops, weights
from lightning_pat.discovery.labels import Handler, Label, Labelling
from lightning_pat.discovery.nodes import flat as _flat
from lightning_pat.discovery.nodes import op_name as _op_name
from lightning_pat.discovery.nodes import shape_of as _shape

#: op -> handler, over every module of handlers.
_HANDLERS: dict[str, Handler] = {**weights.HANDLERS, **conv.HANDLERS, **tensor_ops.HANDLERS, **attention.HANDLERS}
#: Op families sharing one handler (looked up after ``_HANDLERS``).
_FAMILIES = tensor_ops.FAMILIES + weights.FAMILIES
#: Argument positions that are weight slots (a parameter there is not "used directly").
_SLOTS: dict[str, tuple[int, ...]] = {**weights.SLOTS, **conv.SLOTS}
_IGNORE = {"_assert_tensor_metadata", "sym_size", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}


#: Ops a per-channel scale may go through from its placeholder (:func:`scale_vectors`).
_SCALE_USERS = tensor_ops.ELEMENTWISE | tensor_ops.UNARY | tensor_ops.VIEWS


def scale_vectors(w: Labelling) -> frozenset[str]:
    """The per-channel scales of a trace: 1-D parameters used directly, by elementwise ops and views only.

    nGPT-style models (Dory) multiply activations by learned vectors outside any Linear (``up * suv_up``,
    ``q * sqk``, ``gate * s_gate``). Such a vector enters the walk as a member of a space of its own (as a per-head
    parameter does), so the product with a channel axis joins it to that axis's cluster and it is cut with the
    channels; any op that mixes its axis poisons that space like any other. A 1-D parameter in a weight slot (a bias,
    a norm's weight) or read by any other op is not one.
    """
    found = set()
    for node in w.trace.graph.nodes:
        name = w.param_of(node)
        shape = _shape(node.meta.get("val"))
        if name is None or shape is None or len(shape) != 1 or shape[0] < 2 or name in w.trace.per_head:
            continue
        users = list(node.users)
        if users and all(u.op == "call_function" and _op_name(u).rstrip("_") in _SCALE_USERS for u in users):
            found.add(name)
    return frozenset(found)


class Walk(Labelling):
    """Label propagation over one trace."""

    scales: frozenset[str] = frozenset()  # the per-channel scale vectors (:func:`scale_vectors`), set by run()

    def run(self) -> None:
        """Visit every node in order; the output's labels are poisoned (outputs are never pruned).

        The parameters of a module traced as an opaque selection (:attr:`Trace.opaque`) are left whole.
        """
        for param in self.trace.params.values():
            module = next((m for m in self.trace.opaque if param.startswith(f"{m}.")), None)
            if module is not None:
                self.direct.setdefault(param, f"parameter {param}: {self.trace.opaque[module]}")
        self.scales = scale_vectors(self)
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
        head_dim = self.trace.per_head.get(self.trace.params.get(name, ""))
        if head_dim is not None and shape[head_dim] > 1:
            return self.per_head(self.trace.params[name], shape, head_dim)
        if self.trace.params.get(name) in self.scales:
            return self.per_head(self.trace.params[name], shape, 0)
        if name in self.trace.params:
            why = f"parameter {self.trace.params[name]} is used directly in forward"
        elif name in self.trace.buffers:
            why = f"buffer {self.trace.buffers[name]} is used directly in forward"
        elif name in self.trace.constants:
            why = "a tensor constant is used in forward"
        else:
            return (None,) * len(shape)  # a model input: not a channel axis of any parameter
        return tuple(self.fresh(s, why) for s in shape)

    def per_head(self, param: str, shape: tuple[int, ...], head_dim: int) -> tuple[Label, ...]:
        """Labels of a per-head parameter or a per-channel scale used directly: its head (channel) axis a member.

        (:attr:`Trace.per_head`, :func:`scale_vectors`): the axis is a member of a new space.

        The axis is then carried like any channel axis: an elementwise op with the attention logits joins it with
        their head axis; anything that mixes it poisons it.
        """
        space = self.new_space(shape[head_dim])
        self.add_member(param, "out", head_dim, 0, shape[head_dim], space)
        why = f"parameter {param} is used directly in forward"
        return tuple(((space, s, 1),) if d == head_dim else self.fresh(s, why) for d, s in enumerate(shape))

    # -- dispatch
    def call(self, node: Node) -> Any:
        """Labels of a call's value, through its handler (or :meth:`unknown`)."""
        op = _op_name(node)
        if op.endswith("_") and not op.endswith("__"):  # in place (relu_, dropout_, add_): as the functional op
            op = op[:-1]
        if op == "getitem":
            src, idx = cast("tuple[Node, int]", node.args)
            value = self.labels.get(src)
            return value[idx] if isinstance(value, list) and idx < len(value) else None
        if op in _IGNORE:
            return None
        handler = _HANDLERS.get(op) or next((h for ops, h in _FAMILIES if op in ops), None)
        out_shape = _shape(node.meta.get("val"))
        self.note_direct(node, op)
        if handler is not None:
            result = handler(self, node, out_shape)
            if result is not NotImplemented:
                return result
        return self.unknown(node, op)

    def note_direct(self, node: Node, op: str) -> None:
        """Parameters used outside a weight slot of an op we understand.

        A 2-D parameter transposed only to be an ``mm``/``addmm`` weight (``x @ weight.T``) is in a weight slot, and so
        is a parameter reshaped only by size-1 axes on its way to a convolution's weight.
        """
        if op in weights.TRANSPOSES and weights.transposed_param(self, node) is not None:
            users = list(node.users)
            if users and all(
                (_op_name(u) in ("mm", "addmm") and u.args[-1] is node and node not in u.args[:-1])
                or (_op_name(u) == "matmul" and u.args[1] is node and u.args[0] is not node)
                for u in users
            ):
                return
        if op in conv.SAME_WEIGHT and conv.feeds_weight(self, node):
            return  # a convolution's weight with size-1 axes dropped and added back (causal_conv1d_fn's)
        slots = _SLOTS.get(op, ())
        for i, arg in enumerate(node.args):
            name = self.param_of(arg)
            if name is not None and i not in slots and name not in self.trace.per_head and name not in self.scales:
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
