r"""Cluster declarations, pattern expansion, validation and resolved clusters.

A :class:`Cluster` is plain data (YAML-friendly). :func:`resolve_clusters` expands it against a module's named
parameters into :class:`ResolvedCluster` objects, validating every member before anything is mutated.

Pattern forms (each entry of ``writers`` / ``readers``):

* an exact parameter name: ``"model.layers.0.mlp.up_proj.weight"``
* a glob with ``*`` and ``?``: ``"model.layers.*.mlp.up_proj.weight"``
* a full-match regex prefixed with ``re:``; named groups expand one declaration into one cluster per distinct
  group value: ``"re:model\\.layers\\.(?P<layer>\\d+)\\.mlp\\.up_proj\\.weight"`` with ``name="mlp.{layer}"``
* any of the above followed by a slice of the channel axis: ``"...c_attn.weight[0:768]"`` (elements) or
  ``"...c_attn.weight[1/3]"`` (the second of three equal chunks), for packed tensors such as a fused QKV.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

Role = Literal["writer", "reader"]
#: A member pattern's trailing slice: ``[a:b]`` as ``(a, b)``, ``[i/n]`` as ``(i, n, "/")``.
SliceSpec = tuple[int, int] | tuple[int, int, str]
#: One pattern match: (role, parameter name, its slice, the pattern's named groups).
Entry = tuple[Role, str, SliceSpec | None, dict[str, str]]
#: The named-group values a cluster is expanded by, sorted.
GroupKey = tuple[tuple[str, str], ...]

#: Module name segments that wrappers insert into parameter names (activation checkpointing, FSDP1, ``torch.compile``).
WRAPPER_NAMES: tuple[str, ...] = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")

_SLICE_RE = re.compile(r"^(?P<pattern>.*)\[(?:(?P<start>\d+):(?P<stop>\d+)|(?P<index>\d+)/(?P<parts>\d+))\]$")


@dataclass
class Cluster:
    r"""A declaration of coupled units: every listed slice that reads or writes one shared index space.

    Args:
        name: Name of the cluster. With named regex groups, a format string such as ``"mlp.{layer}"``.
        writers: Patterns of members whose channel axis is dim 0 (rows of a 2-D weight, output channels of a
            convolution) or the only axis of a 1-D tensor (a writer's bias, a norm weight).
        readers: Patterns of members whose channel axis is dim 1 (input channels of a Linear or a convolution).
        head_dim: If set, a unit is a block of channels: the number of units ``C`` is the shortest member's
            channel-axis length divided by ``head_dim``, and every member's block is its length divided by ``C``.
            This covers heads (all blocks ``head_dim``) and GQA query groups (``q``/``o`` blocks are
            ``n_rep * head_dim``, ``k``/``v`` blocks ``head_dim``).
        num_units: Explicit number of units ``C``; each member's block is its channel-axis length divided by it.
        target: Per-cluster final target sparsity in ``[0, 1]``, overriding the global one.
        multiple_of: The kept unit count is rounded down to a multiple of this whenever units are dropped.
        budget: Clusters with the same budget name share one drop count (ranked jointly), so their widths differ.
        unit_groups: The ``C`` units form this many equal groups of consecutive units (the KV groups of GQA query
            heads: query head ``h`` reads KV head ``h // n_rep``). Every selection drops the same number of units
            from each group (in each group its lowest-scored units, ties by index), so the kept count is a multiple
            of ``unit_groups`` (of its least common multiple with ``multiple_of``).

    Example::

        >>> Cluster(name="mlp.{layer}", writers=["re:layers\\.(?P<layer>\\d+)\\.up\\.weight"],
        ...         readers=["re:layers\\.(?P<layer>\\d+)\\.down\\.weight"]).name
        'mlp.{layer}'
    """

    name: str
    writers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    head_dim: int | None = None
    num_units: int | None = None
    target: float | None = None
    multiple_of: int = 1
    budget: str | None = None
    unit_groups: int = 1


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


def found_clusters(clusters: Any) -> Any:
    """The declarations of a :class:`~lightning_pat.discover` result (its ``clusters``), else ``clusters`` itself.

    A ``Discovery`` (anything with ``clusters`` and ``left_out``) is accepted wherever declarations are:
    ``prune_clusters(model, discover(model, x), 0.5)``.
    """
    if hasattr(clusters, "clusters") and hasattr(clusters, "left_out") and not isinstance(clusters, Mapping):
        return list(clusters.clusters)
    return clusters


def as_cluster(obj: Cluster | Mapping[str, Any]) -> Cluster:
    """``obj`` as a :class:`Cluster` (a mapping of its fields is constructed).

    Raises:
        ValueError: If the mapping has unknown fields.
        TypeError: If ``obj`` is neither a Cluster nor a mapping.
    """
    if isinstance(obj, Cluster):
        return obj
    if isinstance(obj, Mapping):
        try:
            return Cluster(**obj)
        except TypeError as err:
            raise ValueError(f"Cannot build a Cluster from {dict(obj)!r}: {err}.") from err
    raise TypeError(f"Expected a `Cluster` or a mapping of its fields, got {type(obj).__name__}.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_declaration(decl: Cluster) -> None:
    where = f"Cluster {decl.name!r}"
    if not isinstance(decl.name, str) or not decl.name:
        raise ValueError(f"Cluster name must be a non-empty string, got {decl.name!r}.")
    if not decl.writers and not decl.readers:
        raise ValueError(f"{where} is empty: list at least one pattern in `writers` or `readers`.")
    for key in ("writers", "readers"):
        patterns = getattr(decl, key)
        if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"{where}: `{key}` must be a list of non-empty pattern strings, got {patterns!r}.")
        for pattern in patterns:
            base = _split_slice(pattern)[0]
            if base.startswith("re:"):
                try:
                    re.compile(base[3:])
                except re.error as err:
                    raise ValueError(
                        f"{where}: {key[:-1]} pattern {pattern!r} is not a valid regular expression ({err}); fix it, "
                        "or drop the `re:` prefix to use an exact name or a glob."
                    ) from err
    for key in ("head_dim", "num_units"):
        value = getattr(decl, key)
        if value is not None and (not _is_int(value) or value <= 0):
            raise ValueError(f"{where}: `{key}` must be a positive int or None, got {value!r}.")
    if decl.head_dim is not None and decl.num_units is not None:
        raise ValueError(f"{where}: set `head_dim` or `num_units`, not both.")
    if decl.budget is not None and (not isinstance(decl.budget, str) or not decl.budget):
        raise ValueError(f"{where}: `budget` must be a non-empty name (str) or None, got {decl.budget!r}.")
    for key in ("multiple_of", "unit_groups"):
        if not _is_int(getattr(decl, key)) or getattr(decl, key) < 1:
            raise ValueError(f"{where}: `{key}` must be a positive int, got {getattr(decl, key)!r}.")
    if decl.target is not None and (
        isinstance(decl.target, bool) or not isinstance(decl.target, (int, float)) or not 0.0 <= decl.target <= 1.0
    ):
        raise ValueError(f"{where}: `target` must be a number in [0, 1], got {decl.target!r}.")


def check_declaration(decl: Cluster | Mapping[str, Any]) -> Cluster:
    """Static checks of one declaration (no model needed): fields, types, ranges, regex syntax.

    Returns:
        The declaration as a :class:`Cluster`.

    Raises:
        ValueError: If a field is missing, unknown, of the wrong type or out of range, or a regex does not compile.
        TypeError: If ``decl`` is neither a ``Cluster`` nor a mapping.
    """
    cluster = as_cluster(decl)
    _check_declaration(cluster)
    return cluster


def _split_slice(pattern: str) -> tuple[str, SliceSpec | None]:
    """Split a trailing ``[a:b]`` / ``[i/n]`` off a pattern."""
    match = _SLICE_RE.match(pattern)
    if match is None:
        return pattern, None
    if match["start"] is not None:
        return match["pattern"], (int(match["start"]), int(match["stop"]))
    return match["pattern"], (int(match["index"]), int(match["parts"]), "chunk")


def _match(pattern: str, names: Iterable[str]) -> list[tuple[str, dict[str, str]]]:
    """Names matched by ``pattern`` with their named regex groups."""
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        out = []
        for n in names:
            m = regex.fullmatch(n)
            if m is not None:
                out.append((n, {k: v for k, v in m.groupdict().items() if v is not None}))
        return out
    if any(ch in pattern for ch in "*?["):
        return [(n, {}) for n in names if fnmatch.fnmatchcase(n, pattern)]
    return [(n, {}) for n in names if n == pattern]


def _no_match_error(cluster: str, role: str, pattern: str, names: Sequence[str]) -> ValueError:
    base = pattern[3:] if pattern.startswith("re:") else pattern
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.5)
    hint = f" Close parameter names: {close}." if close else ""
    return ValueError(
        f"Cluster {cluster!r}: {role} pattern {pattern!r} matches no parameter of the model.{hint} "
        "Use an exact name, a glob (`*`, `?`) or a full-match regex prefixed with `re:`."
    )


def _channel_range(
    cluster: str, name: str, dim: int, shape: tuple[int, ...], spec: SliceSpec | None
) -> tuple[int, int]:
    length = shape[dim]
    if spec is None:
        return 0, length
    if len(spec) == 3:
        index, parts, _ = spec
        if parts <= 0 or index >= parts or length % parts:
            raise ValueError(
                f"Cluster {cluster!r}, member {name!r}: chunk [{index}/{parts}] is invalid for channel-axis "
                f"length {length}; the index must be < parts and parts must divide the length."
            )
        step = length // parts
        return index * step, (index + 1) * step
    start, stop = spec
    if not 0 <= start < stop <= length:
        raise ValueError(
            f"Cluster {cluster!r}, member {name!r}: slice [{start}:{stop}] is outside the channel axis "
            f"(dim {dim}, length {length}); use 0 <= start < stop <= {length}."
        )
    return start, stop


def _check_tensor(cluster: str, name: str, tensor: torch.Tensor, role: Role) -> int:
    """Validate a member tensor and return its channel-axis dim."""
    where = f"Cluster {cluster!r}, member {name!r}"
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{where}: expected a floating-point parameter, found dtype {tensor.dtype}; exclude it.")
    if tensor.is_meta or (hasattr(tensor, "to_local") and tensor.to_local().is_meta):
        raise ValueError(
            f"{where}: the parameter is on the meta device; resolve clusters after the weights are materialized "
            "(the callback does this in `setup`, after `configure_model`)."
        )
    if tensor.dim() == 0:
        raise ValueError(f"{where}: a 0-D (scalar) parameter has no channel axis; exclude it.")
    if role == "reader":
        if tensor.dim() < 2:
            raise ValueError(
                f"{where}: a reader's channel axis is dim 1, but the tensor is 1-D (shape {tuple(tensor.shape)}); "
                "list 1-D tensors (biases, norm weights) under `writers`."
            )
        return 1
    return 0


def _num_units(decl: Cluster, cluster: str, lengths: dict[str, int]) -> int:
    if decl.num_units is not None:
        num = decl.num_units
    elif decl.head_dim is not None:
        shortest = min(lengths.values())
        if shortest % decl.head_dim:
            raise ValueError(
                f"Cluster {cluster!r}: head_dim {decl.head_dim} does not divide the shortest channel-axis length "
                f"{shortest}; member lengths {lengths}."
            )
        num = shortest // decl.head_dim
    else:
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"Cluster {cluster!r}: members have different channel-axis lengths {lengths}, so they do not share "
                "one index space; list only members of the same width, or set `head_dim`/`num_units` for blocks."
            )
        num = next(iter(lengths.values()))
    bad = {n: length for n, length in lengths.items() if length % num}
    if bad:
        raise ValueError(
            f"Cluster {cluster!r}: channel-axis lengths {bad} are not divisible by the unit count C={num} "
            f"(all lengths: {lengths}); every member must hold a whole number of channels per unit."
        )
    return num


def _expand(decl: Cluster, names: Sequence[str]) -> dict[GroupKey, list[Entry]]:
    """Group pattern matches by their named-group values."""
    grouped: dict[GroupKey, list[Entry]] = {}
    shared: list[Entry] = []
    roles: tuple[tuple[Role, Sequence[str]], ...] = (("writer", decl.writers), ("reader", decl.readers))
    for role, patterns in roles:
        for pattern in patterns:
            base, slice_spec = _split_slice(pattern)
            matches = _match(base, names)
            if not matches:
                raise _no_match_error(decl.name, role, pattern, names)
            for name, groups in matches:
                entry = (role, name, slice_spec, groups)
                if groups:
                    grouped.setdefault(tuple(sorted(groups.items())), []).append(entry)
                else:
                    shared.append(entry)
    if not grouped:
        return {(): shared}
    return {key: shared + entries for key, entries in grouped.items()}


def _natural_key(text: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


def resolve_clusters(
    model: nn.Module | Mapping[str, torch.Tensor],
    clusters: Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]],
) -> list[ResolvedCluster]:
    """Expand cluster declarations against a module's parameters and validate them.

    Nothing is mutated. Tied parameters (one tensor under two names) count once per axis.

    Args:
        model: The module whose ``named_parameters`` are matched (DTensor parameters are fine), or a mapping of
            parameter names to tensors.
        clusters: One declaration, a mapping of its fields, or a sequence of them.

    Returns:
        The resolved clusters, in declaration order, expanded groups in natural order.

    Raises:
        ValueError: If a pattern matches nothing (close names are suggested), a cluster is empty, members give
            different or non-divisible unit counts, a member is not floating point, is on the meta device or has
            an unsupported rank, the same parameter appears twice on the same axis (in one or two clusters),
            a target is outside ``[0, 1]``, expanded names collide, or a shared budget mixes targets.
        TypeError: If a declaration is neither a ``Cluster`` nor a mapping.

    Example::

        >>> import torch.nn as nn
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        >>> [rc] = resolve_clusters(mlp, Cluster(name="hidden", writers=["0.weight", "0.bias"], readers=["2.weight"]))
        >>> rc.num_units, rc.unit_numel
        (8, 9)
    """
    clusters = found_clusters(clusters)
    decls = [as_cluster(c) for c in ([clusters] if isinstance(clusters, (Cluster, Mapping)) else clusters)]
    params: dict[str, torch.Tensor] = (
        dict(model.named_parameters(remove_duplicate=False)) if isinstance(model, nn.Module) else dict(model)
    )
    names = list(params)
    first_name: dict[int, str] = {}
    for n, p in params.items():
        first_name.setdefault(id(p), n)

    resolved: list[ResolvedCluster] = []
    owners: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}  # (tensor id, dim) -> [(cluster, name, a, b)]
    for decl in decls:
        _check_declaration(decl)
        for key, entries in sorted(_expand(decl, names).items(), key=lambda kv: _natural_key(str(kv[0]))):
            groups = dict(key)
            try:
                cname = decl.name.format(**groups)  # a placeholder without a matching group is an error
            except (KeyError, IndexError) as err:
                raise ValueError(
                    f"Cluster {decl.name!r}: the name refers to group {err} that the patterns do not define; "
                    f"available groups: {sorted(groups)}."
                ) from err
            members = _build_members(decl, cname, entries, params, first_name, owners)
            resolved.append(members)
    seen: dict[str, int] = {}
    for rc in resolved:
        if rc.name in seen:
            raise ValueError(
                f"Cluster name {rc.name!r} occurs twice after expansion; put the named regex groups in the name "
                "(e.g. `name='mlp.{layer}'`) or give each declaration its own name."
            )
        seen[rc.name] = 1
    _check_budgets(resolved)
    return resolved


def _build_members(
    decl: Cluster,
    cname: str,
    entries: list[Entry],
    params: dict[str, torch.Tensor],
    first_name: dict[int, str],
    owners: dict[tuple[int, int], list[tuple[str, str, int, int]]],
) -> ResolvedCluster:
    raw: list[tuple[Role, str, int, int, int, tuple[int, ...]]] = []
    aliases: dict[tuple[int, int, int, int], list[str]] = {}
    for role, name, slice_spec, _ in entries:
        tensor = params[name]
        dim = _check_tensor(cname, name, tensor, role)
        shape = tuple(tensor.shape)
        start, stop = _channel_range(cname, name, dim, shape, slice_spec)
        key = (id(tensor), dim, start, stop)
        if key in aliases:
            if name in aliases[key]:
                raise ValueError(
                    f"Cluster {cname!r}: parameter {name!r} is listed twice on dim {dim}; remove the duplicate "
                    "pattern (one parameter may join a cluster once per axis)."
                )
            aliases[key].append(name)  # tied tensor under another name: counts once
            continue
        for other_cluster, other_name, a, b in owners.get((id(tensor), dim), []):
            if start < b and a < stop:
                where = "this cluster" if other_cluster == cname else f"cluster {other_cluster!r}"
                raise ValueError(
                    f"Cluster {cname!r}: parameter {name!r} (dim {dim}, channels [{start}:{stop}]) already belongs "
                    f"to {where} as {other_name!r} on the same axis; a channel can be pruned by one cluster only. "
                    "Remove one of the two declarations."
                )
        owners.setdefault((id(tensor), dim), []).append((cname, name, start, stop))
        aliases[key] = [name]
        raw.append((role, first_name[id(tensor)], dim, start, stop, shape))
        _check_same_layout(cname, name, tensor, params[raw[0][1]] if raw else tensor)
    lengths: dict[str, int] = {}
    for _, n, d, a, b, shape in raw:
        label = f"{n}[{a}:{b}]" if (a, b) != (0, shape[d]) else n
        lengths[label if label not in lengths else f"{label} (dim {d})"] = b - a  # one parameter on both axes
    num = _num_units(decl, cname, lengths)
    members = []
    for role, name, dim, start, stop, shape in raw:
        alias_list = aliases[(id(params[name]), dim, start, stop)]
        extra = tuple(a for a in alias_list if a != name)
        members.append(Member(name, role, dim, start, stop, (stop - start) // num, shape, extra))
    if num % decl.unit_groups:
        raise ValueError(
            f"Cluster {cname!r}: `unit_groups={decl.unit_groups}` does not divide its {num} units; every group must "
            "hold the same number of consecutive units (for GQA query heads: the KV head count)."
        )
    return ResolvedCluster(
        name=cname,
        members=tuple(members),
        num_units=num,
        target=None if decl.target is None else float(decl.target),
        multiple_of=math.lcm(decl.multiple_of, decl.unit_groups),
        budget=decl.budget,
        unit_groups=decl.unit_groups,
    )


def _check_same_layout(cname: str, name: str, tensor: torch.Tensor, first: torch.Tensor) -> None:
    """All members of a cluster must be plain tensors on one device, or DTensors on one mesh."""
    is_dt = hasattr(tensor, "device_mesh")
    first_dt = hasattr(first, "device_mesh")
    if is_dt != first_dt:
        raise ValueError(
            f"Cluster {cname!r}, member {name!r}: mixes DTensor and plain-tensor members; shard all members of a "
            "cluster the same way (e.g. apply `fully_shard` to every module holding them)."
        )
    mesh, first_mesh = getattr(tensor, "device_mesh", None), getattr(first, "device_mesh", None)
    if is_dt and mesh != first_mesh:
        raise ValueError(
            f"Cluster {cname!r}, member {name!r}: lives on mesh {mesh}, other members on {first_mesh}; all members "
            "of a cluster must share one DeviceMesh."
        )
    if tensor.device != first.device:
        raise ValueError(
            f"Cluster {cname!r}, member {name!r}: is on {tensor.device}, other members on {first.device}; move the "
            "module to one device before pruning."
        )


def _check_budgets(resolved: Sequence[ResolvedCluster]) -> None:
    by_budget: dict[str, list[ResolvedCluster]] = {}
    for rc in resolved:
        if rc.budget is not None:
            by_budget.setdefault(rc.budget, []).append(rc)
    for budget, group in by_budget.items():
        targets = {rc.target for rc in group}
        if len(targets) > 1:
            raise ValueError(
                f"Budget {budget!r}: clusters {[rc.name for rc in group]} declare different targets {targets}; "
                "clusters sharing a budget share one target."
            )


def ensure_resolved(
    model: nn.Module | Mapping[str, torch.Tensor],
    clusters: Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]] | Sequence[ResolvedCluster],
) -> list[ResolvedCluster]:
    """``clusters`` if they are all resolved already, else :func:`resolve_clusters` of them against ``model``.

    Raises:
        ValueError: As for :func:`resolve_clusters`.
    """
    clusters = found_clusters(clusters)
    items = [clusters] if isinstance(clusters, (Cluster, Mapping)) else list(clusters)
    if items and all(isinstance(c, ResolvedCluster) for c in items):
        return list(items)  # type: ignore[arg-type]
    return resolve_clusters(model, items)  # type: ignore[arg-type]
