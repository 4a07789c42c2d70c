"""Channel labels and their bookkeeping, the state that the discovery walk's handlers read and write.

A tensor dim's *label* is a tuple of segments ``(space, units, block)`` (``None``: not a channel axis that is
tracked); a *space* is one index space of units in a union-find. :class:`Labelling` holds the spaces, the parameter
members of each space and the labels of the nodes visited so far; :class:`~lightning_pat.discovery.walk.Walk` fills
it by visiting the graph, and the op handlers (:mod:`~lightning_pat.discovery.tensor_ops`,
:mod:`~lightning_pat.discovery.weights`, :mod:`~lightning_pat.discovery.conv`,
:mod:`~lightning_pat.discovery.attention`) are functions of a :class:`Labelling`, a node and the node's output shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import Node

from lightning_pat.discovery.nodes import shape_of
from lightning_pat.discovery.trace import Trace

Segment = tuple[int, int, int]  # (space id, units, block); only units * block (the length) is relied on
Label = tuple[Segment, ...] | None  # None: not a channel axis we track


@dataclass
class Space:
    """One index space of units and, if it may not be pruned, the reasons."""

    units: int
    reasons: list[str] = field(default_factory=list)


class Labelling:
    """The channel labels of one trace: spaces (union-find), their parameter members, the visited nodes' labels."""

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

    def coarsen(self, s: int, units: int, why: str) -> None:
        """Make a unit of space ``s`` cover whole entries of an axis of ``units`` entries (a head of ``D`` channels).

        As :meth:`union` with a fresh space of ``units`` units, without joining one: a space coarsened into heads can
        still be cut into parts (:func:`~lightning_pat.discovery.attention.cut_label`).
        """
        root = self.spaces[self.find(s)]
        small, large = sorted((root.units, units))
        if large % small:
            self.poison_space(s, f"{why} joins {root.units} and {units} channels")
        root.units = small

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

    def fresh_all(self, shape: tuple[int, ...] | None, reason: str) -> tuple[Label, ...] | None:
        """Poisoned labels for every dim of ``shape``."""
        return None if shape is None else tuple(self.fresh(s, reason) for s in shape)

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
        shape = shape_of(arg.meta.get("val"))
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


#: An op's handler: the labels of a call's value (a tuple per dim, a list of those for a tuple output), or
#: ``NotImplemented`` where the call is not the case it understands; from the labelling, the node and its output shape.
Handler = Callable[[Labelling, Node, tuple[int, ...] | None], Any]
