"""The pruning state's schema: every field of a saved state checked before any of it is used (pure, no Lightning).

A state (written by :func:`lightning_pat.training.state.build`, read back by a resume, ``lightning-pat shrink`` and
:func:`lightning_pat.shrink`) comes from a file, so it is untrusted: a hand-edited or foreign checkpoint must be an
error naming the field, what was expected and what was found, never a wrong mask, a wrong schedule position or an
``IndexError`` deep in the masking code. :func:`check_state` checks

* the keys (no unknown entry), and each field's type and range: ``step`` an int in ``[0, global_step]``, ``gamma`` and
  ``gamma_prox`` finite sums of learning rates, ``shrunk`` a bool, the saved ``options``;
* ``clusters`` (each rebuilds into a :class:`~lightning_pat.core.spec.ResolvedCluster` with consistent member slices)
  against ``fingerprints`` (the same names; each fingerprint recomputed from its cluster);
* ``dropped``: known cluster names, distinct int indices in ``[0, C)``, no cluster emptied unless its target is 1
  (a shared budget is checked on its total); ``factors``: ``[C]`` float tensors in ``[0, 1]``;
* ``latents`` (:mod:`lightning_pat.training.latent`), ``activation``, ``taylor``, ``layer_scores`` and
  ``expert_scores`` (the scorers, :class:`~lightning_pat.scoring.collector.Collector`) only by their owners, whose
  checks a resume passes in (:attr:`StateContext.entries`): core readers (a shrink) do not use them;
* ``allocation`` (:func:`allocation_entry`): a size solved by importance during training, its step, the size options
  it was solved for and the solution, or ``None``.

Every check is local and the same on every rank for the same state (the caller makes the ranks agree). Errors are
:class:`~lightning_pat.core.state_fields.StateError` (a ``ValueError``), raised by the field readers of
:mod:`lightning_pat.core.state_fields`; reading a state out of a checkpoint is :mod:`lightning_pat.core.saved_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pat.core.choices import CHOICES, RANGES, SWITCHES
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.state_fields import FieldChecker, StateError, describe

#: The entries of a state (see :mod:`lightning_pat.training.state`).
KEYS: tuple[str, ...] = (
    "step", "gamma", "gamma_prox", "dropped", "factors", "fingerprints", "clusters", "options", "latents", "shrunk",
    "activation", "taylor", "layer_scores", "allocation", "expert_scores",
)  # fmt: skip
#: The entries a restored state must hold (the others default to empty; a shrink needs only ``dropped``).
REQUIRED: tuple[str, ...] = ("step", "dropped")
#: Latent formats (see :mod:`lightning_pat.training.state`).
LATENT_FORMATS: tuple[str, ...] = ("local", "tensors", "per_rank", "full", "dcp")


#: The check of an entry its owner reads: ``check(entry, what)`` raises a :class:`StateError` naming the field.
EntryCheck = Callable[[object, str], None]


@dataclass(frozen=True)
class StateContext:
    """What the run restoring a state knows (each field optional: ``None`` skips the checks that need it).

    Attributes:
        global_step: The trainer's optimizer steps so far: ``step`` may not exceed it.
        clusters: The run's resolved clusters (names and unit counts for ``dropped``, ``factors``, ``taylor``);
            by default the state's own ``clusters``.
        entries: The checks of the entries that core readers do not use, by their owners (the latent copies:
            :func:`lightning_pat.training.latent.check_entry`; the scorers' statistics:
            :meth:`lightning_pat.training.collectors.Collectors.checks`): entry name -> ``check(entry, what)``,
            called with the entry (``None`` if the state has none) after the core entries passed. An entry without
            a check here is not checked (``lightning-pat shrink`` reads none of them).
    """

    global_step: int | None = None
    clusters: Sequence[ResolvedCluster] | None = None
    entries: Mapping[str, EntryCheck] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- clusters
def _cluster(check: FieldChecker, raw: object, where: str) -> ResolvedCluster:
    data = check.mapping(raw, where)
    assert data is not None
    for key in ("name", "members", "num_units"):
        if key not in data:
            raise check.fail(where, f"has no {key!r} entry")
    if not isinstance(data["name"], str) or not data["name"]:
        raise check.fail(f"{where}.name", f"must be a non-empty str, got {describe(data['name'])}")
    name = data["name"]
    num_units = check.integer(data["num_units"], f"clusters[{name!r}].num_units", low=1)
    check.integer(data.get("multiple_of", 1), f"clusters[{name!r}].multiple_of", low=1)
    check.integer(data.get("min_kept", 0), f"clusters[{name!r}].min_kept", low=0, high=num_units)
    if data.get("target") is not None:
        check.real(data["target"], f"clusters[{name!r}].target", low=0.0, high=1.0)
    if data.get("budget") is not None and not isinstance(data["budget"], str):
        raise check.fail(f"clusters[{name!r}].budget", f"must be a str or None, got {describe(data['budget'])}")
    members = check.sequence(data["members"], f"clusters[{name!r}].members")
    if not members:
        raise check.fail(f"clusters[{name!r}].members", "is empty")
    for i, raw_member in enumerate(members):
        at = f"clusters[{name!r}].members[{i}]"
        member = check.mapping(raw_member, at)
        assert member is not None
        if not isinstance(member.get("name"), str) or not member["name"]:
            raise check.fail(f"{at}.name", f"must be a parameter name, got {describe(member.get('name'))}")
        if member.get("role") not in ("writer", "reader"):
            raise check.fail(f"{at}.role", f"must be 'writer' or 'reader', got {describe(member.get('role'))}")
        shape = check.sequence(member.get("shape"), f"{at}.shape")
        if not shape:
            raise check.fail(f"{at}.shape", "is empty")
        dims = [check.integer(s, f"{at}.shape", low=1) for s in shape]
        dim = check.integer(member.get("dim"), f"{at}.dim", high=len(dims) - 1)
        start = check.integer(member.get("start"), f"{at}.start")
        stop = check.integer(member.get("stop"), f"{at}.stop", low=start + 1, high=dims[dim])
        block = check.integer(member.get("block"), f"{at}.block", low=1)
        if block * num_units != stop - start:
            raise check.fail(
                at, f"spans channels [{start}, {stop}) of dim {dim}, not num_units * block = {num_units} * {block}"
            )
        aliases = member.get("aliases", [])
        if not isinstance(aliases, (list, tuple)) or not all(isinstance(a, str) for a in aliases):
            raise check.fail(f"{at}.aliases", f"must be a list of names, got {describe(aliases)}")
    try:
        return ResolvedCluster.from_dict(data)
    except ValueError as err:
        raise check.fail(where, f"does not rebuild into a cluster ({err})") from None


def saved_clusters(state: Mapping[str, Any], *, what: str) -> list[ResolvedCluster]:
    """The state's ``clusters``, each checked and rebuilt, and checked against ``fingerprints``.

    Raises:
        StateError: If an entry is malformed, two clusters share a name, or a cluster's fingerprint is missing or
            differs from the one recomputed from its definition.
    """
    check = FieldChecker(what)
    raw = check.sequence(state.get("clusters", []), "clusters")
    clusters = [_cluster(check, item, f"clusters[{i}]") for i, item in enumerate(raw)]
    names = [rc.name for rc in clusters]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise check.fail("clusters", f"holds clusters {twice[:5]} twice")
    prints = check.mapping(state.get("fingerprints", {}), "fingerprints")
    assert prints is not None
    if "clusters" in state and "fingerprints" in state and set(prints) != set(names):
        missing, extra = sorted(set(names) - set(prints)), sorted(set(prints) - set(names))
        raise check.fail(
            "fingerprints", f"does not name the saved clusters (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for rc in clusters:
        if rc.name in prints and prints[rc.name] != rc.fingerprint():
            raise check.fail(
                f"fingerprints[{rc.name!r}]",
                f"is {prints[rc.name]!r}, but the saved definition of cluster {rc.name!r} has fingerprint "
                f"{rc.fingerprint()!r} (a member, a shape or a target was changed)",
            )
    return clusters


# ---------------------------------------------------------------------------------------------------- the state
def check_state(
    state: object,
    *,
    context: StateContext | None = None,
    what: str = "the checkpoint's pruning state",
    required: Sequence[str] = REQUIRED,
) -> list[ResolvedCluster]:
    """Check a saved pruning state against the schema (and ``context``); nothing is applied or mutated.

    Args:
        state: The state (what the callback's ``state_dict()`` returned, without ``"distill"``).
        context: What the run knows that the state must agree with (see :class:`StateContext`).
        what: The state's name for messages (e.g. ``"CoupledPruningCallback: the checkpoint's pruning state"``).
        required: The entries the state must hold (a resume needs ``step``; a shrink only ``dropped``).

    Returns:
        The state's clusters, rebuilt.

    Raises:
        StateError: Naming the field, what was expected, what was found and the fix.

    Example::

        >>> check_state({"step": 3, "dropped": {}}, context=StateContext(global_step=5))
        []
        >>> try:
        ...     check_state({"step": 9, "dropped": {}}, context=StateContext(global_step=5))
        ... except StateError as err:
        ...     print(str(err).split(";")[0])
        the checkpoint's pruning state: `step` must be in [0, 5], got 9
    """
    ctx = context or StateContext()
    check = FieldChecker(what)
    data = check.mapping(state, "state")
    assert data is not None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise check.fail("state", f"has unknown entries {unknown[:5]} (a state holds {list(KEYS)})")
    missing = [k for k in required if k not in data]
    if missing:
        raise check.fail("state", f"lacks the entries {missing} (keys: {sorted(data)[:8]})")
    check.integer(data.get("step", 0), "step", high=ctx.global_step)
    gamma = check.real(data.get("gamma", 0.0), "gamma", low=0.0)
    check.real(data.get("gamma_prox", 0.0), "gamma_prox", low=0.0, high=gamma)
    if not isinstance(data.get("shrunk", False), bool):
        raise check.fail("shrunk", f"must be a bool, got {describe(data.get('shrunk'))}")
    options = _options(check, data.get("options", {}))
    saved = saved_clusters(data, what=what)
    if ctx.clusters is not None and "fingerprints" in data:
        prints, current = dict(data["fingerprints"]), {rc.name: rc.fingerprint() for rc in ctx.clusters}
        if prints != current:
            changed = sorted(k for k in set(prints) | set(current) if prints.get(k) != current.get(k))
            raise StateError(
                f"{what} was written for different clusters ({changed[:5]} differ); resume with the same cluster "
                "declarations and model, or start a new run."
            )
    clusters = list(ctx.clusters) if ctx.clusters is not None else saved
    units = {rc.name: rc.num_units for rc in clusters}
    known = units if (ctx.clusters is not None or "clusters" in data) else None
    dropped = _dropped(check, data.get("dropped", {}), units, known)
    _not_emptied(check, dropped, clusters, options)
    factors = check.mapping(data.get("factors", {}), "factors", allow_none=True) or {}
    check.names(factors, known, "factors", "clusters")
    for name, value in factors.items():
        tensor = check.tensor(value, f"factors[{name!r}]", shape=(units[name],) if name in units else None)
        if tensor.numel() and (bool((tensor < 0).any()) or bool((tensor > 1).any())):
            raise check.fail(f"factors[{name!r}]", "holds values outside [0, 1] (group-lasso factors)")
    allocation_entry(data, what=what)
    for key, check_entry in ctx.entries.items():  # the entries their owners check (latents, the scorers' statistics)
        check_entry(data.get(key), what)
    return saved


_SIZE_COUNTS: tuple[str, ...] = ("achieved", "target", "total", "minimum", "dropped_layers")


def allocation_entry(state: Mapping[str, Any], *, what: str) -> Mapping[str, Any] | None:
    """The state's ``allocation`` entry, checked: ``None``, or a size solved by importance during training.

    The entry holds ``rule`` (``"importance"``), ``step`` (the selection it was solved at, at most the state's
    ``step``), ``options`` (the size options it was solved for, by name) and ``size`` (the solution's fields:
    :meth:`~lightning_pat.sizing.problem.SizeSolution.to_dict`). The clusters' targets are the state's ``clusters``.

    Raises:
        StateError: If the entry or one of its fields is malformed.
    """
    check = FieldChecker(what)
    entry = check.mapping(state.get("allocation"), "allocation", allow_none=True)
    if entry is None:
        return None
    unknown = sorted(set(entry) - {"rule", "step", "options", "size"})
    if unknown:
        raise check.fail("allocation", f"has unknown entries {unknown}")
    if entry.get("rule") != "importance":
        raise check.fail("allocation.rule", f"must be 'importance', got {describe(entry.get('rule'))}")
    step = state.get("step", 0)
    check.integer(entry.get("step"), "allocation.step", low=1, high=step if isinstance(step, int) else None)
    check.mapping(entry.get("options"), "allocation.options")
    size = check.mapping(entry.get("size"), "allocation.size")
    assert size is not None
    for key in _SIZE_COUNTS:
        check.integer(size.get(key, 0), f"allocation.size.{key}")
    for key in ("below", "above"):
        if size.get(key) is not None:
            check.integer(size[key], f"allocation.size.{key}")
    for key in ("kept", "cluster_kept"):
        counts = check.mapping(size.get(key, {}), f"allocation.size.{key}") or {}
        for name, value in counts.items():
            check.integer(value, f"allocation.size.{key}[{name!r}]")
    fractions = check.mapping(size.get("fractions", {}), "allocation.size.fractions") or {}
    for name, value in fractions.items():
        check.real(value, f"allocation.size.fractions[{name!r}]", low=0.0, high=1.0)
    for key in ("unit", "rule"):
        if not isinstance(size.get(key, ""), str):
            raise check.fail(f"allocation.size.{key}", f"must be a str, got {describe(size.get(key))}")
    if size.get("cost") is not None:
        check.real(size["cost"], "allocation.size.cost", low=0.0)
    return entry


def _options(check: FieldChecker, raw: object) -> Mapping[str, Any]:
    options = check.mapping(raw, "options")
    assert options is not None
    for key, value in options.items():  # the vocabularies and ranges of the options themselves (core.choices)
        where = f"options[{key!r}]"
        bounds = RANGES.get(key)
        if bounds is not None and not (value is None and bounds.none_ok):
            if bounds.integer:
                check.integer(value, where, low=int(bounds.low), high=None if bounds.high is None else int(bounds.high))
            else:
                check.real(value, where, low=bounds.low, high=bounds.high)
        elif key in CHOICES and value not in CHOICES[key]:
            raise check.fail(where, f"must be one of {CHOICES[key]}, got {describe(value)}")
        elif key in SWITCHES and not isinstance(value, bool):
            raise check.fail(where, f"must be a bool, got {describe(value)}")
    return options


def _dropped(
    check: FieldChecker, raw: object, units: Mapping[str, int], known: Collection[str] | None
) -> dict[str, list[int]]:
    dropped = check.mapping(raw, "dropped")
    assert dropped is not None
    check.names(dropped, known, "dropped", "clusters")
    out = {}
    for name, indices in dropped.items():
        where = f"dropped[{name!r}]"
        items = check.sequence(indices, where)
        size = units.get(name)
        bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise check.fail(where, f"must hold int unit indices, got {describe(bad[0])}")
        if len(set(items)) != len(items):
            twice = sorted({i for i in items if items.count(i) > 1})
            raise check.fail(where, f"holds the indices {twice[:5]} more than once")
        if size is not None:
            outside = [i for i in items if not 0 <= i < size]
            if outside:
                raise check.fail(
                    where, f"holds unit indices {sorted(outside)[:5]} outside [0, {size}) (cluster {name!r} has {size})"
                )
        out[name] = sorted(items)
    return out


def _not_emptied(
    check: FieldChecker,
    dropped: Mapping[str, list[int]],
    clusters: Sequence[ResolvedCluster],
    options: Mapping[str, Any],
) -> None:
    """No cluster (a shared budget: its total) loses every unit unless its target is 1 (DESIGN invariant 11)."""
    default = options.get("target_sparsity", 0.0)
    budgets: dict[str, list[ResolvedCluster]] = {}
    for rc in clusters:
        if rc.budget is not None:
            budgets.setdefault(rc.budget, []).append(rc)
            continue
        target = default if rc.target is None else rc.target
        if len(dropped.get(rc.name, ())) == rc.num_units and target < 1.0:
            raise check.fail(
                f"dropped[{rc.name!r}]",
                f"drops every one of the cluster's {rc.num_units} units although its target is {target:g} (below 1): "
                "the shrunk model would lose the cluster entirely",
            )
    for budget, group in budgets.items():
        target = default if group[0].target is None else group[0].target
        total = sum(rc.num_units for rc in group)
        if sum(len(dropped.get(rc.name, ())) for rc in group) == total and target < 1.0:
            raise check.fail(
                "dropped", f"drops every unit of budget {budget!r} ({total} units) although its target is {target:g}"
            )


__all__ = [
    "KEYS", "LATENT_FORMATS", "REQUIRED", "EntryCheck", "StateContext", "StateError", "allocation_entry",
    "check_state",
]  # fmt: skip
