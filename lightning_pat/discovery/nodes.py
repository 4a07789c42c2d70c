"""Small readers of traced graph nodes shared by the discovery walk's handlers (no state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.fx import Node


def op_name(node: Node) -> str:
    """The ATen op's name without its overload (``aten.view.default`` -> ``"view"``)."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return getattr(target, "__name__", str(target))


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The static shape of a (fake) tensor value, or ``None`` (not a tensor, or symbolic sizes)."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(s) for s in shape)
    except (TypeError, ValueError):  # symbolic sizes
        return None


def node_shape(arg: Any) -> tuple[int, ...] | None:
    """The shape of a node's value (``None`` for a non-node argument)."""
    return shape_of(arg.meta.get("val")) if isinstance(arg, Node) else None


def flat(value: Any) -> Iterable[Any]:
    """The leaves of nested lists, tuples and dicts."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from flat(v)
    else:
        yield value
