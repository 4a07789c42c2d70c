"""The shrink plan: which indices of which parameter survive, and where a plan comes from.

Pure data, no module surgery (:mod:`lightning_pat.shrink.surgery`): :class:`ShrinkPlan` and :func:`build_plan` turn
resolved clusters and dropped unit indices into per-parameter kept indices; :func:`read_source` and :func:`plan_for`
read clusters and dropped units from a ``PruneResult``, a ``CoupledPruningCallback``, its state or a Lightning
checkpoint dict (a state through :mod:`lightning_pat.core.saved_state`: :func:`read_saved`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.saved_state import SavedState, callback_state, is_checkpoint, is_shrunk, read_state
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.units import unit_channels

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class ShrinkPlan:
    """Which indices of which parameter survive a shrink.

    Attributes:
        keep: Parameter name -> tensor dim -> sorted kept indices (a ``LongTensor``).
        shapes: Parameter name -> shape before the shrink.
    """

    keep: dict[str, dict[int, Tensor]]
    shapes: dict[str, tuple[int, ...]]

    def slice(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` (shaped like parameter ``name`` before the shrink) with only the kept indices, contiguous."""
        out = tensor
        for dim, idx in sorted(self.keep.get(name, {}).items()):
            out = out.index_select(dim, idx.to(out.device))
        return out.contiguous()

    def renamed(self, mapping: Mapping[str, str]) -> ShrinkPlan:
        """The same plan with parameter names replaced through ``mapping`` (names not in it are kept)."""
        return ShrinkPlan(
            keep={mapping.get(n, n): v for n, v in self.keep.items()},
            shapes={mapping.get(n, n): v for n, v in self.shapes.items()},
        )


def build_plan(clusters: Sequence[ResolvedCluster], dropped: Mapping[str, Sequence[int]]) -> ShrinkPlan:
    """Turn resolved clusters and their dropped units into per-parameter kept indices.

    Args:
        clusters: The resolved clusters (``PruneResult.clusters``, ``callback.resolved``).
        dropped: Cluster name -> dropped unit indices (clusters not listed drop nothing).

    Returns:
        The plan; parameters with nothing dropped are left out.

    Raises:
        ValueError: If ``dropped`` names an unknown cluster or an index is outside ``[0, C)``.

    Example::

        >>> from lightning_pat.core.spec import Member
        >>> rc = ResolvedCluster("h", (Member("a.weight", "writer", 0, 0, 4, 1, (4, 2)),), num_units=4)
        >>> build_plan([rc], {"h": [1, 2]}).keep["a.weight"][0].tolist()
        [0, 3]
    """
    by_name = {rc.name: rc for rc in clusters}
    unknown = sorted(set(dropped) - set(by_name))
    if unknown:
        raise ValueError(
            f"`dropped` names clusters {unknown[:5]} that are not among the clusters {sorted(by_name)[:5]}...; pass "
            "the dropped units and the clusters of the same run."
        )
    cut: dict[tuple[str, int], set[int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, units in dropped.items():
        rc = by_name[name]
        units = sorted({int(u) for u in units})
        if not units:
            continue
        if units[0] < 0 or units[-1] >= rc.num_units:
            raise ValueError(
                f"Cluster {name!r}: dropped unit indices must lie in [0, {rc.num_units}), got {units[:8]}; the dropped "
                "units do not belong to these clusters."
            )
        for m in rc.members:
            shapes[m.name] = m.shape
            channels = cut.setdefault((m.name, m.dim), set())
            for u in units:
                channels.update(range(m.start + u * m.block, m.start + (u + 1) * m.block))
    keep: dict[str, dict[int, Tensor]] = {}
    for (name, dim), channels in cut.items():
        kept = [i for i in range(shapes[name][dim]) if i not in channels]
        keep.setdefault(name, {})[dim] = torch.tensor(kept, dtype=torch.long)
    return ShrinkPlan(keep=keep, shapes={n: shapes[n] for n in keep})


# ---------------------------------------------------------------------------------------------------- sources
def read_saved(state: Mapping[str, Any], what: str) -> SavedState:
    """A callback state read for a shrink (``what`` names it in the error): checked against its schema once.

    The schema (:func:`~lightning_pat.core.state_schema.check_state`): the clusters rebuild and match their
    fingerprints, the dropped indices are distinct ints of known clusters in ``[0, C)``, and no cluster is emptied
    unless its target is 1. A state built in memory (its clusters already resolved) is taken as it is.

    Raises:
        ValueError: If the state has no ``clusters`` or no ``dropped`` entry, or does not fit the schema.
    """
    if "clusters" not in state or "dropped" not in state:
        raise ValueError(
            f"shrink: {what} has no {'clusters' if 'clusters' not in state else 'dropped'!r} entry (keys: "
            f"{sorted(state)[:8]}); pass a PruneResult, a CoupledPruningCallback after fit, its state_dict() or a "
            "checkpoint written by a version of lightning_pat that stores the clusters."
        )
    if all(isinstance(rc, ResolvedCluster) for rc in state["clusters"]):  # built in memory (not read from a file)
        dropped = {str(k): [int(i) for i in v] for k, v in state["dropped"].items()}
        return SavedState(clusters=list(state["clusters"]), dropped=dropped, shrunk=is_shrunk(state))
    return read_state(state, what=f"shrink: {what}", required=("dropped",))


def read_source(source: Any) -> tuple[list[ResolvedCluster], dict[str, list[int]]]:
    """The resolved clusters and dropped units held by ``source``.

    Args:
        source: A ``PruneResult``, a ``CoupledPruningCallback`` after ``fit``, the callback's ``state_dict()``, a
            Lightning checkpoint dict (the callback state is found under ``ckpt["callbacks"]``), or a state already
            read (:func:`read_saved`).

    Returns:
        ``(clusters, dropped)``.

    Raises:
        ValueError: If the source holds no clusters, or a checkpoint holds no or several callback states.
        TypeError: If ``source`` is none of the above.
    """
    if isinstance(source, SavedState):  # read (and checked) once by the caller
        return list(source.clusters), {k: list(v) for k, v in source.dropped.items()}
    if isinstance(source, Mapping):
        if is_checkpoint(source):
            saved = read_saved(callback_state(source), "the checkpoint's callback state")
        else:
            saved = read_saved(source, "the mapping")
        return saved.clusters, saved.dropped
    if hasattr(source, "resolved") and hasattr(source, "dropped"):  # the callback, without importing Lightning
        if not source.resolved:
            raise ValueError("shrink: the callback has no resolved clusters; call `trainer.fit` first.")
        return list(source.resolved), {k: list(v) for k, v in source.dropped.items()}
    if hasattr(source, "clusters") and hasattr(source, "dropped"):  # a PruneResult
        if not source.clusters and any(source.dropped.values()):
            raise ValueError("shrink: the PruneResult carries no clusters; get it from `prune_clusters` or a Pruner.")
        return list(source.clusters), {k: list(v) for k, v in source.dropped.items()}
    raise TypeError(
        f"shrink: `source` must be a PruneResult, a CoupledPruningCallback, its state_dict() or a Lightning "
        f"checkpoint dict, got {type(source).__name__}."
    )


def _prefix_for(names: Sequence[str], model_names: set[str]) -> str:
    """The common prefix to strip from ``names`` so that they name ``model``'s parameters (``""`` if none fits)."""
    if not names or all(n in model_names for n in names):
        return ""
    parts = names[0].split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i]) + "."
        if all(n.startswith(prefix) and n[len(prefix) :] in model_names for n in names):
            return prefix
    return ""


def check_source_fits(
    model: nn.Module, clusters: Sequence[ResolvedCluster], dropped: Mapping[str, Sequence[int]], *, what: str
) -> None:
    """A saved pruning state (from a file) must belong to ``model``: its clusters, and its mask in its weights.

    Every member must be a parameter of ``model`` (after stripping a common prefix, as :func:`align_names`) with the
    saved shape, no two members may claim the same channels of one tensor (what resolution guarantees), and every
    dropped unit must be exactly zero in every member: else the shrunk model would not compute what the pruned model
    computed (units that were kept would be cut). Checked before anything changes; tensors on the meta device are
    not read.

    Args:
        model: The model to shrink, with the checkpoint's weights loaded.
        clusters: The saved clusters.
        dropped: The saved mask.
        what: The state's name, for messages.

    Raises:
        ValueError: Naming the cluster, the member and what differs.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    names = [m.name for rc in clusters for m in rc.members]
    prefix = _prefix_for(names, set(params))
    claims: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    nonzero: dict[str, list[str]] = {}
    for rc in clusters:
        units = sorted(set(dropped.get(rc.name, ())))
        for m in rc.members:
            name = m.name[len(prefix) :] if prefix and m.name.startswith(prefix) else m.name
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"shrink: {what} names {m.name!r} (a member of cluster {rc.name!r}), which is not a parameter of "
                    f"{type(model).__name__}; the saved clusters do not belong to this model. Shrink the model the "
                    "checkpoint was written for."
                )
            if tuple(param.shape) != tuple(m.shape):
                raise ValueError(
                    f"shrink: {what}: cluster {rc.name!r} has member {m.name!r} of shape {tuple(m.shape)}, but the "
                    f"model's parameter has shape {tuple(param.shape)}; shrink the model the checkpoint was written "
                    "for."
                )
            for other, start, stop in claims.setdefault((id(param), m.dim), []):
                if start < m.stop and m.start < stop and other != rc.name:
                    raise ValueError(
                        f"shrink: {what}: clusters {other!r} and {rc.name!r} both claim channels "
                        f"[{max(start, m.start)}, {min(stop, m.stop)}) of dim {m.dim} of {m.name!r}; the saved "
                        "clusters were edited or do not belong to this model."
                    )
            claims[(id(param), m.dim)].append((rc.name, m.start, m.stop))
            if not units or param.is_meta:
                continue
            channels = unit_channels(
                m, torch.tensor(units), num_units=rc.num_units, offset=0, length=param.shape[m.dim],
                device=param.device,
            )  # fmt: skip
            if bool(param.detach().index_select(m.dim, channels).any()):
                nonzero.setdefault(rc.name, []).append(m.name)
    if nonzero:
        shown = "; ".join(f"cluster {c!r} in {ms[:3]}" for c, ms in list(nonzero.items())[:5])
        raise ValueError(
            f"shrink: {what}: the dropped units are not zero in the weights ({shown}), so the mask does not belong "
            "to these weights (the checkpoint was edited, or the weights were not loaded) and cutting them would "
            "change the model's output. Shrink an unedited checkpoint of the run, with its weights loaded."
        )


def align_names(plan: ShrinkPlan, model: nn.Module) -> ShrinkPlan:
    """``plan`` with one common prefix stripped from its names when the model is the inner module (``lit.model``)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if not plan.keep or all(n in names for n in plan.keep):
        return plan
    first = next(iter(plan.keep))
    parts = first.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i]) + "."
        if all(n.startswith(prefix) and n[len(prefix) :] in names for n in plan.keep):
            log.info("shrink: the clusters name parameters under %r; stripped it to match the model", prefix)
            return plan.renamed({n: n[len(prefix) :] for n in plan.keep})
    return plan  # the missing name is reported by apply_plan


def plan_for(model: nn.Module, source: Any) -> ShrinkPlan:
    """The :class:`ShrinkPlan` of ``source`` (see :func:`read_source`), with names matched to ``model``.

    Args:
        model: The model to shrink.
        source: As for :func:`shrink`.

    Returns:
        The plan.

    Raises:
        ValueError: As for :func:`read_source` and :func:`build_plan`.
        TypeError: As for :func:`read_source`.
    """
    clusters, dropped = read_source(source)
    return align_names(build_plan(clusters, dropped), model)
