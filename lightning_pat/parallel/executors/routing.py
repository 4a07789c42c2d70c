"""Routing: which executor serves each cluster, decided from global metadata only; and the executors' construction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from lightning_pat.core.choices import EXECUTOR_KINDS, ExecutorKind
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel import placement
from lightning_pat.parallel.comm import dtensor, reduce
from lightning_pat.parallel.executors.base import Executor
from lightning_pat.parallel.executors.materializing import MaterializingExecutor
from lightning_pat.parallel.executors.sharded import ShardedExecutor


def sharded_reason(cluster: ResolvedCluster, params: Mapping[str, Tensor]) -> str | None:
    """Why ``cluster`` cannot take the sharded path (global metadata only), or ``None`` if it can."""
    members = [params[m.name] for m in cluster.members]
    tensors = [t for t in members if dtensor.is_dtensor(t)]
    if len(tensors) != len(members):
        return "plain tensors (not DTensors)"
    for m in cluster.members:
        if m.dim != (1 if m.role == "reader" else 0):
            return (
                f"member {m.name!r} has its channel axis on dim {m.dim} (set with `@{m.dim}`; a {m.role}'s is dim "
                f"{1 if m.role == 'reader' else 0}), which only the materializing path serves"
            )
    mesh = tensors[0].device_mesh
    if any(t.device_mesh != mesh for t in tensors):
        return "members live on different device meshes"
    return placement.cluster_reason(cluster, [tuple(t.placements) for t in tensors], mesh_shape=tuple(mesh.shape))


def materializing_reason(cluster: ResolvedCluster, params: Mapping[str, Tensor]) -> str | None:
    """Why the materializing path would be wrong for ``cluster`` (global metadata only), or ``None`` if it is right.

    ``DTensor.full_tensor`` assembles pieces in process-group rank order, which differs from mesh-coordinate order
    on a mesh whose ranks do not increase along every axis: it would pick different units on different ranks and
    write rows back to the wrong places.
    """
    for m in cluster.members:
        tensor = params[m.name]
        if dtensor.is_dtensor(tensor) and not reduce.mesh_is_increasing(tensor.device_mesh):
            return (
                f"member {m.name!r} lives on a DeviceMesh whose ranks do not increase along every axis "
                f"({tensor.device_mesh.mesh.tolist()}), where torch's full_tensor assembles pieces in the wrong order"
            )
    return None


def route(
    clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor], *, executor: ExecutorKind = "auto"
) -> dict[str, tuple[str, str]]:
    """Decide, from global metadata only, which executor serves each cluster.

    ``"auto"`` takes the sharded path for every cluster whose members are all eligible DTensors and the
    materializing path otherwise; ``"sharded"`` and ``"materializing"`` force one path. A cluster on a mesh whose
    ranks do not increase along every axis can only take the sharded path (see :func:`materializing_reason`).

    Returns:
        Cluster name -> ``(kind, reason)``.

    Raises:
        ValueError: If ``executor`` is unknown, ``"sharded"`` is forced for a cluster that is not eligible, or a
            cluster needs the materializing path (forced, or not eligible for the sharded one) on a mesh where it
            would be wrong. Raised before anything is mutated.
    """
    if executor not in EXECUTOR_KINDS:
        raise ValueError(f"`executor` must be one of {EXECUTOR_KINDS}, got {executor!r}.")
    out = {}
    for rc in clusters:
        wrong = materializing_reason(rc, params)
        if executor == "materializing":
            if wrong is not None:
                raise ValueError(
                    f"Cluster {rc.name!r}: executor='materializing' would be wrong here: {wrong}. Use "
                    "executor='auto' or 'sharded', or build the mesh with increasing ranks (init_device_mesh)."
                )
            out[rc.name] = ("materializing", "forced by executor='materializing'")
            continue
        reason = sharded_reason(rc, params)
        if reason is not None and wrong is not None:
            raise ValueError(
                f"Cluster {rc.name!r} cannot take the sharded path ({reason}), and the materializing path would be "
                f"wrong: {wrong}. Build the mesh with increasing ranks (init_device_mesh), or lay the members out "
                "as Shard/Replicate boxes."
            )
        if reason is None:
            how = "forced by executor='sharded'" if executor == "sharded" else "eligible DTensor layout"
            out[rc.name] = ("sharded", how)
        elif executor == "sharded":
            raise ValueError(
                f"Cluster {rc.name!r}: executor='sharded' cannot serve this cluster: {reason}. Use executor='auto' "
                "(falls back to materializing for this cluster) or executor='materializing'."
            )
        else:
            out[rc.name] = ("materializing", reason)
    return out


def build_executors(
    clusters: Sequence[ResolvedCluster],
    params: Mapping[str, Tensor],
    routes: Mapping[str, tuple[str, str]],
    *,
    data_aware: bool = False,
) -> list[Executor]:
    """One executor per kind, each owning the clusters routed to it (in cluster order).

    With ``data_aware`` (``score="activation"``), the sharded executor reduces every cluster over its whole mesh, so
    that the statistics of every data-parallel rank travel in the one packed collective.

    The materializing executor comes first: it writes whole tensors back from dense copies taken when scoring, so
    it must apply before the sharded executor zeroes local pieces of a parameter the two may share.
    """
    by_kind: dict[str, list[ResolvedCluster]] = {}
    for rc in clusters:
        by_kind.setdefault(routes[rc.name][0], []).append(rc)
    out: list[Executor] = []
    for kind in sorted(by_kind, key=lambda k: k != "materializing"):
        if kind == "sharded":
            out.append(ShardedExecutor(by_kind[kind], params, data_aware=data_aware))
        else:
            out.append(MaterializingExecutor(by_kind[kind], params))
    return out
