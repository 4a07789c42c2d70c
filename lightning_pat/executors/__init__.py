"""Executors: how unit norms are computed and selections applied, per layout; and the routing decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from lightning_pat.executors.base import Executor, UnitAction
from lightning_pat.executors.materializing import MaterializingExecutor
from lightning_pat.spec import ResolvedCluster

ExecutorKind = Literal["auto", "materializing", "sharded"]
EXECUTOR_KINDS: tuple[str, ...] = ("auto", "materializing", "sharded")


def route(
    clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor], *, executor: ExecutorKind = "auto"
) -> dict[str, tuple[str, str]]:
    """Decide, from global metadata only, which executor serves each cluster.

    Returns:
        Cluster name -> ``(kind, reason)``.

    Raises:
        ValueError: If ``executor`` is unknown, or ``"sharded"`` is forced for a cluster that is not eligible.
    """
    if executor not in EXECUTOR_KINDS:
        raise ValueError(f"`executor` must be one of {EXECUTOR_KINDS}, got {executor!r}.")
    out = {}
    for rc in clusters:
        if executor == "materializing":
            out[rc.name] = ("materializing", "forced by executor='materializing'")
        elif executor == "sharded":
            raise ValueError(
                f"Cluster {rc.name!r}: executor='sharded' is not available for this layout (plain tensors or an "
                "unsupported DTensor layout); use executor='auto' or 'materializing'."
            )
        else:
            out[rc.name] = ("materializing", "plain tensors")
    return out


def build_executors(
    clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor], routes: Mapping[str, tuple[str, str]]
) -> list[Executor]:
    """One executor per kind, each owning the clusters routed to it (in cluster order)."""
    by_kind: dict[str, list[ResolvedCluster]] = {}
    for rc in clusters:
        by_kind.setdefault(routes[rc.name][0], []).append(rc)
    executors: list[Executor] = []
    for kind, group in by_kind.items():
        if kind == "materializing":
            executors.append(MaterializingExecutor(group, params))
        else:  # pragma: no cover - guarded by route()
            raise AssertionError(kind)
    return executors


__all__ = ["EXECUTOR_KINDS", "Executor", "ExecutorKind", "MaterializingExecutor", "UnitAction", "build_executors",
           "route"]
