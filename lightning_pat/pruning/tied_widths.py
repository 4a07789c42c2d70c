"""Widths one stock config field sets, kept as one: tied declarations of ``clusters="auto"`` (issue 37).

Jamba's ``intermediate_size`` is the width of its dense MLPs and of its experts' channels: ``"auto"`` finds them as two
declarations, and a ratio or a size target could keep two widths, which its stock config cannot hold.
:func:`stock_clusters` leaves out what the stock config cannot express
(:func:`~lightning_pat.shrink.stock_config.stock_expressible`), then :func:`tie_widths` gives the declarations one
field ties (:func:`~lightning_pat.shrink.stock_config.tied_declarations`) one label and one ``multiple_of``: one
width for the ratio path, the size solver, the callback's schedule and ranked widths.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Sequence
from typing import Any, cast

from lightning_pat.core.spec import Cluster, resolve_clusters
from lightning_pat.core.spec.patterns import split_dim, split_slice
from lightning_pat.shrink.stock_config import stock_expressible, tied_declarations

log = logging.getLogger(__name__)


def layer_template(cluster: Cluster) -> Cluster | None:
    r"""``cluster`` (exact member names) as a declaration over every index of its name's first integer segment.

    ``model.layers.0.mlp.c_fc`` with members ``model.layers.0.…`` becomes ``model.layers.{layer}.mlp.c_fc`` with
    members ``re:model\.layers\.(?P<layer>\d+)\.…`` (slices and ``@d`` kept); ``None`` if the name has no integer
    segment or a member is a pattern already or lies outside that index's subtree.
    """
    parts = cluster.name.split(".")
    at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if at is None:
        return None
    prefix = "".join(f"{p}." for p in parts[:at])
    head = f"{prefix}{parts[at]}."

    def template(member: str) -> str | None:
        base = split_slice(member)[0]
        name = split_dim(base)[0]
        if not name.startswith(head) or name.startswith("re:") or any(c in name for c in "*?["):
            return None
        return f"re:{re.escape(prefix)}(?P<layer>\\d+)\\.{re.escape(name[len(head) :])}{member[len(name) :]}"

    writers, readers = [template(m) for m in cluster.writers], [template(m) for m in cluster.readers]
    if any(t is None for t in (*writers, *readers)):
        return None
    name = prefix + "{layer}." + ".".join(parts[at + 1 :]) if at + 1 < len(parts) else prefix + "{layer}"
    return dataclasses.replace(
        cluster, name=name, writers=cast("list[str]", writers), readers=cast("list[str]", readers)
    )


def _placeholders(name: str) -> set[str]:
    return set(re.findall(r"\{([^}]*)\}", name))


def _templated(decl: Cluster) -> Cluster | None:
    """``decl`` if its name has placeholders, else named by its layer index (``None`` if it has none).

    A discovered ``model.layers.0.feed_forward.gate_proj`` becomes ``model.layers.{layer}.feed_forward.gate_proj``
    whose patterns hold the group ``layer`` pinned to ``0`` (:func:`_layer_template`): the same clusters, a name
    template another declaration's name can replace.
    """
    if _placeholders(decl.name):
        return decl
    template = layer_template(decl)
    if template is None:
        return None
    index = next(part for part in decl.name.split(".") if part.isdigit())

    def pin(patterns: list[str]) -> list[str]:
        return [p.replace("(?P<layer>\\d+)", f"(?P<layer>{index})", 1) for p in patterns]

    return dataclasses.replace(template, writers=pin(template.writers), readers=pin(template.readers))


def _resolved_shape(model: Any, decl: Cluster) -> list[tuple[Any, ...]]:
    """What ``decl`` resolves to, names and ``multiple_of`` aside (sorted by fields: Members do not order)."""
    fields = [
        (rc.num_units, rc.unit_groups, tuple(dataclasses.astuple(m) for m in rc.members))
        for rc in resolve_clusters(model, [decl])
    ]
    return sorted(fields)


#: The group :func:`tagged_declaration` adds: it tells apart the clusters of a declaration named after another's.
_TAG = "tied"
_SPECIAL = set("()[]{}|?*+^$")


def _as_regex(pattern: str) -> tuple[str, str] | None:
    """``(regex, suffix)`` of a member pattern (its ``@dim`` and slice kept apart as ``suffix``); ``None``: a glob."""
    base, _ = split_slice(pattern)
    core, _ = split_dim(base)
    suffix = pattern[len(core) :]
    if core.startswith("re:"):
        return core[3:], suffix
    return None if any(c in core for c in "*?") else (re.escape(core), suffix)


def tagged_declaration(decl: Cluster, lead_name: str) -> Cluster | None:
    r"""``decl`` named after ``lead_name`` (the same label) with a group ``tied`` that keeps its clusters' names apart.

    The literal start every pattern of ``decl`` has in common (``model\.H_module\.`` of HRM's H-module MLPs, tied
    to its L-module's by one ``intermediate_size``; the whole name of Phi-4-multimodal's vision head MLP, tied to its
    encoder layers') becomes the group ``tied``; the name is ``lead_name`` without the placeholders ``decl`` has no
    group for, plus ``.{tied}``: its label (placeholders dropped) is the leader's, an expanded name is its own.
    ``None`` where the patterns have no such start (a glob, or nothing in common).
    """
    parts = [_as_regex(p) for p in (*decl.writers, *decl.readers)]
    if any(part is None for part in parts) or _TAG in _placeholders(lead_name):
        return None
    regexes = [cast(tuple[str, str], part)[0] for part in parts]
    common = os.path.commonprefix(regexes)
    cut = next((i for i, c in enumerate(common) if c in _SPECIAL and (i == 0 or common[i - 1] != "\\")), len(common))
    start = common[:cut]
    while start.endswith("\\") and not start.endswith("\\\\"):  # never split an escape
        start = start[:-1]
    if not start:
        return None
    groups = set(re.findall(r"\(\?P<(\w+)>", "".join(regexes)))
    name = lead_name
    for gone in _placeholders(lead_name) - groups:
        name = re.sub(r"[._-]?\{" + re.escape(gone) + r"\}", "", name)

    def tag(part: tuple[str, str]) -> str:
        regex, suffix = part
        return f"re:(?P<{_TAG}>{start}){regex[len(start) :]}{suffix}"

    members = [tag(cast(tuple[str, str], part)) for part in parts]
    return dataclasses.replace(
        decl, name=f"{name}.{{{_TAG}}}", writers=members[: len(decl.writers)], readers=members[len(decl.writers) :]
    )


def _tie(model: Any, decls: Sequence[Cluster]) -> tuple[dict[int, Cluster], dict[int, str]]:
    """Tied declarations (one stock config field sets their widths) as declarations of one label and one width.

    The first declaration whose name has placeholders leads (else the first, named by its layer index); each other
    is given its name (its own patterns, named by its layer index where its name had none: :func:`_templated`), so
    that every cluster of the group is labelled as one declaration's (one group of the size solver, one ranked
    budget), and all take the least common multiple of their ``multiple_of``: one ratio keeps one count of equal
    unit counts.

    Returns:
        Index in ``decls`` -> the declaration it becomes (one left out is not among them), and index -> why that
        declaration is left out (a unit count other than the leader's, or names that cannot be made one
        declaration's).
    """
    lead_at = next((i for i, d in enumerate(decls) if _placeholders(d.name)), 0)
    lead = _templated(decls[lead_at])
    lead_name = decls[lead_at].name
    if lead is None or _resolved_shape(model, lead) != _resolved_shape(model, decls[lead_at]):
        lead = decls[lead_at]
    counts = {(rc.num_units, rc.unit_groups) for rc in resolve_clusters(model, [lead])}
    out, left_out = {lead_at: lead}, {}
    for i, decl in enumerate(decls):
        if i == lead_at:
            continue
        found = {(rc.num_units, rc.unit_groups) for rc in resolve_clusters(model, [decl])}
        why = f"one field of the stock config sets its width and that of {lead_name!r}"
        if len(counts) > 1 or found != counts:
            left_out[i] = f"{why}, but it has {sorted(found)} units (and groups), {lead_name!r} {sorted(counts)}"
            continue
        renamed = _templated(decl)
        if renamed is not None and _placeholders(renamed.name) == _placeholders(lead.name):
            renamed = dataclasses.replace(renamed, name=lead.name)
        try:
            same = renamed is not None and _resolved_shape(model, renamed) == _resolved_shape(model, decl)
            resolve_clusters(model, [*out.values(), renamed] if renamed is not None else list(out.values()))
        except ValueError:
            same = False
        if not same or renamed is None or renamed.name != lead.name:
            renamed = tagged_declaration(decl, lead.name)  # HRM's H- and L-module MLPs: a group tells them apart
            try:
                same = renamed is not None and _resolved_shape(model, renamed) == _resolved_shape(model, decl)
                resolve_clusters(model, [*out.values(), renamed] if renamed is not None else list(out.values()))
            except ValueError:
                same = False
        if not same or renamed is None:
            left_out[i] = f"{why}, but their clusters cannot be named as one declaration's"
            continue
        out[i] = renamed
    if left_out:  # the others' cut would set the field this one's width is built from: none of them is cut
        j = min(left_out)
        return {}, {
            i: left_out.get(i, f"tied to {decls[j].name!r}, which is not cut: {left_out[j]}") for i in range(len(decls))
        }
    multiple = math.lcm(*(d.multiple_of for d in out.values()))
    return {i: dataclasses.replace(d, multiple_of=multiple) for i, d in out.items()}, left_out


def tie_widths(model: Any, clusters: list[Cluster]) -> list[Cluster]:
    """``clusters``, those whose widths one stock config field sets made to keep one width.

    The ties are found by :func:`~lightning_pat.shrink.stock_config.tied_declarations`.

    Jamba's dense MLPs and its experts' channels are both ``intermediate_size``: found as two declarations (a
    discovered MLP, the MoE preset's expert channels), a ratio or a size target could keep two widths, which its
    stock config cannot hold. Tied declarations become declarations of one label (one width for the size solver,
    the callback's schedule and ranked widths) with one ``multiple_of`` (one count for a ratio); see :func:`_tie`.
    One that cannot keep the others' width (other unit counts) is left out, with a warning: never an export stock
    ``from_pretrained`` refuses.
    """
    groups = tied_declarations(model, clusters)
    if not groups:
        return clusters
    names = [c.name for c in clusters]
    keys = [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    out = list(clusters)
    dropped: dict[int, str] = {}
    for group in groups:
        at = [keys.index(k) for k in group]
        tied, left_out = _tie(model, [clusters[i] for i in at])
        for j, decl in tied.items():
            out[at[j]] = decl
        dropped.update({at[j]: why for j, why in left_out.items()})
        if len(tied) > 1:
            log.info("clusters='auto': %s keep one width (one stock config field sets them; multiple_of=%d)",
                     [clusters[at[j]].name for j in tied], next(iter(tied.values())).multiple_of)  # fmt: skip
    reasons = {clusters[i].name: why for i, why in dropped.items()}
    if reasons:
        log.warning(
            "clusters='auto': %d clusters of %s are not cut, because its stock config cannot hold their width beside "
            "another's (stock from_pretrained could not load the result): %s. Declare them by hand and export with "
            "lightning_pat.save_pretrained / load_pretrained to cut them anyway.",
            len(reasons), type(model).__name__, "; ".join(f"{n}: {why}" for n, why in reasons.items()),
        )  # fmt: skip
    return [c for i, c in enumerate(out) if i not in dropped]


def stock_clusters(model: Any, clusters: list[Cluster]) -> list[Cluster]:
    """``clusters="auto"``'s declarations for a stock config: what it cannot express left out, tied widths made one.

    :func:`~lightning_pat.shrink.stock_config.stock_expressible`, then :func:`tie_widths`.
    """
    return tie_widths(model, stock_expressible(model, clusters))
