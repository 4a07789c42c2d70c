r"""Member patterns: exact names, globs, ``re:`` regexes and channel-axis slices, matched against parameter names.

Pattern forms (each entry of ``writers`` / ``readers``):

* an exact parameter name: ``"model.layers.0.mlp.up_proj.weight"``
* a glob with ``*`` and ``?``: ``"model.layers.*.mlp.up_proj.weight"``
* a full-match regex prefixed with ``re:``; named groups expand one declaration into one cluster per distinct
  group value: ``"re:model\\.layers\\.(?P<layer>\\d+)\\.mlp\\.up_proj\\.weight"`` with ``name="mlp.{layer}"``
* any of the above followed by a slice of the channel axis: ``"...c_attn.weight[0:768]"`` (elements) or
  ``"...c_attn.weight[1/3]"`` (the second of three equal chunks), for packed tensors such as a fused QKV.
* any of the above with an explicit channel-axis dim ``@d`` before the slice, for a member whose channel axis is not
  its role's (a writer's dim 0, a reader's dim 1): ``"...experts.down_proj@2"`` (the intermediate channels of fused
  3-D expert weights ``(E, H, I)``), ``"...experts.gate_up_proj@1[0/2]"``. Only the materializing path serves them.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Sequence

from lightning_pat.core.spec.resolved import Role

#: A member pattern's trailing slice: ``[a:b]`` as ``(a, b)``, ``[i/n]`` (chunk i of n) as ``(i, n, "chunk")``.
SliceSpec = tuple[int, int] | tuple[int, int, str]
#: One pattern match: (role, parameter name, its slice, the pattern's named groups, its explicit dim or ``None``).
Entry = tuple[Role, str, SliceSpec | None, dict[str, str], int | None]
#: The named-group values a cluster is expanded by, sorted.
GroupKey = tuple[tuple[str, str], ...]

#: Module name segments that wrappers insert into parameter names (activation checkpointing, FSDP1, ``torch.compile``).
WRAPPER_NAMES: tuple[str, ...] = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")

_DIM_RE = re.compile(r"^(?P<pattern>.*)@(?P<dim>\d+)$")
_SLICE_RE = re.compile(r"^(?P<pattern>.*)\[(?:(?P<start>\d+):(?P<stop>\d+)|(?P<index>\d+)/(?P<parts>\d+))\]$")


def split_slice(pattern: str) -> tuple[str, SliceSpec | None]:
    """Split a trailing ``[a:b]`` / ``[i/n]`` off a pattern.

    Args:
        pattern: A member pattern, with or without a trailing slice.

    Returns:
        The pattern without its slice, and the slice (``None`` if it has none).

    Example::

        >>> split_slice("h.0.attn.c_attn.weight[1/3]")
        ('h.0.attn.c_attn.weight', (1, 3, 'chunk'))
    """
    match = _SLICE_RE.match(pattern)
    if match is None:
        return pattern, None
    if match["start"] is not None:
        return match["pattern"], (int(match["start"]), int(match["stop"]))
    return match["pattern"], (int(match["index"]), int(match["parts"]), "chunk")


def split_dim(pattern: str) -> tuple[str, int | None]:
    """Split an explicit channel-axis dim ``@d`` off a pattern whose slice was split off already.

    Example::

        >>> split_dim("layers.0.mlp.experts.down_proj@2")
        ('layers.0.mlp.experts.down_proj', 2)
    """
    match = _DIM_RE.match(pattern)
    return (pattern, None) if match is None else (match["pattern"], int(match["dim"]))


def match_pattern(pattern: str, names: Iterable[str]) -> list[tuple[str, dict[str, str]]]:
    """Names matched by ``pattern`` (exact, glob or ``re:``, without a slice) with their named regex groups.

    Args:
        pattern: An exact name, a glob or a full-match regex prefixed with ``re:``.
        names: The candidate parameter names.

    Returns:
        ``(name, groups)`` for each matched name, in the order of ``names``.
    """
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


def no_match_error(cluster: str, role: str, pattern: str, names: Sequence[str]) -> ValueError:
    """The error for a pattern that matches no parameter, with close names as a hint.

    Args:
        cluster: The cluster's name.
        role: ``"writer"`` or ``"reader"``.
        pattern: The pattern as declared.
        names: The model's parameter names.

    Returns:
        The error (to raise).
    """
    base = pattern[3:] if pattern.startswith("re:") else pattern
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.5)
    hint = f" Close parameter names: {close}." if close else ""
    return ValueError(
        f"Cluster {cluster!r}: {role} pattern {pattern!r} matches no parameter of the model.{hint} "
        "Use an exact name, a glob (`*`, `?`) or a full-match regex prefixed with `re:`."
    )


def expand(
    cluster: str, roles: Sequence[tuple[Role, Sequence[str]]], names: Sequence[str]
) -> dict[GroupKey, list[Entry]]:
    """Group pattern matches by their named-group values.

    Matches without named groups are shared by every group.

    Args:
        cluster: The declaration's name (for the error message).
        roles: ``(role, patterns)`` pairs, writers first.
        names: The model's parameter names.

    Returns:
        The entries of each group, keyed by its sorted group values (``()`` alone if no pattern has named groups).

    Raises:
        ValueError: If a pattern matches no parameter.
    """
    grouped: dict[GroupKey, list[Entry]] = {}
    shared: list[Entry] = []
    for role, patterns in roles:
        for pattern in patterns:
            base, slice_spec = split_slice(pattern)
            base, dim = split_dim(base)
            matches = match_pattern(base, names)
            if not matches:
                raise no_match_error(cluster, role, pattern, names)
            for name, groups in matches:
                entry = (role, name, slice_spec, groups, dim)
                if groups:
                    grouped.setdefault(tuple(sorted(groups.items())), []).append(entry)
                else:
                    shared.append(entry)
    if not grouped:
        return {(): shared}
    return {key: shared + entries for key, entries in grouped.items()}
