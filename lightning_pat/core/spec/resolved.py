"""Resolved clusters: concrete members, their serialization and fingerprints.

A :class:`ResolvedCluster` is what :func:`~lightning_pat.core.spec.resolve.resolve_clusters` makes of a declaration:
its :class:`Member` slices of named parameters and its unit count. It writes itself as plain types
(:meth:`ResolvedCluster.to_dict`, inverted by :meth:`ResolvedCluster.from_dict`) and hashes what defines it
(:meth:`ResolvedCluster.fingerprint`, for resume checks).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["writer", "reader"]


@dataclass(frozen=True)
class Member:
    """One slice of one parameter in a resolved cluster.

    Attributes:
        name: The parameter name (the first name under which a tied tensor is registered).
        role: ``"writer"`` (channel axis is dim 0) or ``"reader"`` (channel axis is dim 1).
        dim: Tensor dim of the channel axis.
        start: First channel of the member's slice along ``dim``.
        stop: One past the last channel of the slice.
        block: Channels per unit in this member.
        shape: Global shape of the parameter.
        aliases: Other names of the same (tied) tensor.
    """

    name: str
    role: Role
    dim: int
    start: int
    stop: int
    block: int
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()

    @property
    def other_numel(self) -> int:
        """Elements per channel (the product of the non-channel dims)."""
        numel = 1
        for i, size in enumerate(self.shape):
            if i != self.dim:
                numel *= size
        return numel

    @property
    def unit_numel(self) -> int:
        """Elements of one unit in this member."""
        return self.block * self.other_numel


@dataclass(frozen=True)
class ResolvedCluster:
    """A validated cluster with concrete members.

    Attributes:
        name: Expanded cluster name.
        members: The members, in declaration order (writers first).
        num_units: Number of units ``C``.
        target: Per-cluster target override, or ``None``.
        multiple_of: Rounding of the kept unit count (a multiple of ``unit_groups``: the declaration's
            ``multiple_of`` and ``unit_groups``' least common multiple).
        budget: Shared-budget name, or ``None`` for a per-cluster budget.
        min_kept: In a shared budget, the units this cluster keeps at least (a multiple of ``multiple_of``; 0: no
            floor). Set by ``target_params`` with ``target_widths="ranked"``.
        unit_groups: Equal groups of consecutive units that every selection thins by the same count (1: none).
    """

    name: str
    members: tuple[Member, ...]
    num_units: int
    target: float | None = None
    multiple_of: int = 1
    budget: str | None = None
    min_kept: int = 0
    unit_groups: int = 1

    @property
    def unit_numel(self) -> int:
        """``G``: elements of one unit over all members."""
        return sum(m.unit_numel for m in self.members)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Distinct parameter names of the members, in order."""
        return tuple(dict.fromkeys(m.name for m in self.members))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (JSON/YAML-able); :meth:`from_dict` inverts it exactly.

        Example::

            >>> rc = ResolvedCluster("h", (Member("a.weight", "writer", 0, 0, 4, 1, (4, 2)),), num_units=4)
            >>> ResolvedCluster.from_dict(rc.to_dict()) == rc
            True
        """
        out = {
            "name": self.name,
            "members": [
                {
                    "name": m.name,
                    "role": m.role,
                    "dim": m.dim,
                    "start": m.start,
                    "stop": m.stop,
                    "block": m.block,
                    "shape": list(m.shape),
                    "aliases": list(m.aliases),
                }
                for m in self.members
            ],
            "num_units": self.num_units,
            "target": self.target,
            "multiple_of": self.multiple_of,
            "budget": self.budget,
        }
        if self.min_kept:
            out["min_kept"] = self.min_kept
        if self.unit_groups > 1:
            out["unit_groups"] = self.unit_groups
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedCluster:
        """Rebuild a cluster written by :meth:`to_dict`.

        Args:
            data: The mapping.

        Returns:
            The cluster.

        Raises:
            ValueError: If a field is missing or has the wrong type.
        """
        try:
            members = tuple(
                Member(
                    name=str(m["name"]),
                    role=m["role"],
                    dim=int(m["dim"]),
                    start=int(m["start"]),
                    stop=int(m["stop"]),
                    block=int(m["block"]),
                    shape=tuple(int(s) for s in m["shape"]),
                    aliases=tuple(str(a) for a in m.get("aliases", ())),
                )
                for m in data["members"]
            )
            target = data.get("target")
            return cls(
                name=str(data["name"]),
                members=members,
                num_units=int(data["num_units"]),
                target=None if target is None else float(target),
                multiple_of=int(data.get("multiple_of", 1)),
                budget=data.get("budget"),
                min_kept=int(data.get("min_kept", 0)),
                unit_groups=int(data.get("unit_groups", 1)),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"Cannot rebuild a ResolvedCluster from {dict(data)!r}: missing or invalid field {err}; pass what "
                "`ResolvedCluster.to_dict()` wrote."
            ) from err

    def fingerprint(self) -> str:
        """A short stable hash of everything that defines the cluster (for resume checks)."""
        payload = {
            "name": self.name,
            "C": self.num_units,
            "members": [[m.name, m.dim, m.start, m.stop, m.block, list(m.shape)] for m in self.members],
            "target": self.target,
            "multiple_of": self.multiple_of,
            "budget": self.budget,
        }
        if self.min_kept:  # absent when 0: fingerprints of earlier checkpoints stay valid
            payload["min_kept"] = self.min_kept
        if self.unit_groups > 1:  # likewise absent when 1
            payload["unit_groups"] = self.unit_groups
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
