"""Cluster declarations: the plain-data :class:`Cluster` and its static checks (no model needed).

A :class:`Cluster` is plain data (YAML-friendly). :func:`check_declaration` checks its fields, types, ranges and regex
syntax; :func:`~lightning_pat.core.spec.resolve.resolve_clusters` expands it against a module's parameters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_pat.core.spec.patterns import split_dim, split_slice


@dataclass
class Cluster:
    r"""A declaration of coupled units: every listed slice that reads or writes one shared index space.

    Args:
        name: Name of the cluster. With named regex groups, a format string such as ``"mlp.{layer}"``.
        writers: Patterns of members whose channel axis is dim 0 (rows of a 2-D weight, output channels of a
            convolution) or the only axis of a 1-D tensor (a writer's bias, a norm weight).
        readers: Patterns of members whose channel axis is dim 1 (input channels of a Linear or a convolution).
            In either list a pattern may set its member's channel axis explicitly with ``@d`` (fused 3-D expert
            weights: ``"...experts.down_proj@2"``); such members are served by the materializing path only.
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
            base = split_dim(split_slice(pattern)[0])[0]
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
