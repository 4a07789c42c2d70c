"""Resolution: cluster declarations expanded against a module's tensors into validated resolved clusters.

:func:`resolve_clusters` expands each :class:`~lightning_pat.core.spec.declaration.Cluster` against a module's named
parameters into :class:`~lightning_pat.core.spec.resolved.ResolvedCluster` objects, validating every member (dtype,
device, rank, slice, unit count, one owner per channel) before anything is mutated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pat.core.spec.declaration import Cluster, as_cluster, check_declaration, found_clusters
from lightning_pat.core.spec.patterns import Entry, SliceSpec, expand
from lightning_pat.core.spec.resolved import Member, ResolvedCluster, Role


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


def _check_tensor(cluster: str, name: str, tensor: torch.Tensor, role: Role, dim: int | None = None) -> int:
    """Validate a member tensor and return its channel-axis dim (``dim`` if the pattern set it with ``@d``)."""
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
    if dim is not None:
        if dim >= tensor.dim():
            raise ValueError(
                f"{where}: the pattern sets channel-axis dim {dim} (`@{dim}`), but the tensor is {tensor.dim()}-D "
                f"(shape {tuple(tensor.shape)}); use a dim in [0, {tensor.dim() - 1}]."
            )
        return dim
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
        check_declaration(decl)
        roles: tuple[tuple[Role, Sequence[str]], ...] = (("writer", decl.writers), ("reader", decl.readers))
        for key, entries in sorted(expand(decl.name, roles, names).items(), key=lambda kv: _natural_key(str(kv[0]))):
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
    for role, name, slice_spec, _, explicit_dim in entries:
        tensor = params[name]
        dim = _check_tensor(cname, name, tensor, role, explicit_dim)
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
