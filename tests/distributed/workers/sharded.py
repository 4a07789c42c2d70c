"""Worker functions run on every rank by ``tests.common.dist.run_distributed`` (one spawn per mesh config).

Each suite runs many checks in one process group and returns a plain dict; the pytest side asserts on it. Checks
that compare ranks use ``all_gather_object`` here and report the outcome.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from lightning_pat.parallel.executors.sharded import ShardedExecutor
from tests.common.cases import make_module
from tests.distributed.workers import model as M
from tests.distributed.workers.recorder import Recorder

R, S0, S1 = Replicate(), Shard(0), Shard(1)

TARGETS = {"heads.0": 0.5, "heads.1": 0.34, "mlp.0": 0.5, "mlp.1": 0.3, "resid": 0.3}
SHARED = {"heads.0": 0.5, "heads.1": 0.34, "mlp.0": 0.4, "mlp.1": 0.4, "resid": 0.3}
FLOORS = {"heads.0": 0.0, "heads.1": 0.34, "mlp.0": 0.2, "mlp.1": 0.2, "resid": 0.1}
LAYOUT_VARIANTS = ("hard-rms", "hard-shared-rms-mult4", "lasso-rms")  # on every layout; all VARIANTS on the first
VARIANTS = [  # name, shared budget, resid multiple_of, score, method, targets
    ("hard-rms", False, 1, "rms", "hard", TARGETS),
    ("hard-l2", False, 1, "l2", "hard", TARGETS),
    ("hard-param_cost", False, 1, "param_cost", "hard", TARGETS),
    ("hard-shared-rms-mult4", True, 4, "rms", "hard", SHARED),
    ("hard-shared-param_cost", True, 1, "param_cost", "hard", SHARED),
    ("lasso-rms", False, 1, "rms", "group_lasso", FLOORS),
    ("lasso-shared-l2", True, 1, "l2", "group_lasso", FLOORS),
]


# ---------------------------------------------------------------------------------------------- layouts
def _uniform(p2: tuple, p1: tuple) -> dict[str, tuple]:
    return {n: (p2 if len(s) == 2 else p1) for n, s in M.SHAPES.items()}


def _tp(col: tuple, row: tuple, one: tuple) -> dict[str, tuple]:
    return {n: (col if n in M.COLWISE else row if n in M.ROWWISE else one) for n in M.SHAPES}


def _random(seed: int, ndim: int) -> dict[str, tuple]:
    rng = random.Random(seed)
    out = {}
    for n, s in M.SHAPES.items():
        choices = [R, S0, S1] if len(s) == 2 else [R, S0]
        out[n] = tuple(rng.choice(choices) for _ in range(ndim))
    return out


def layouts(kind: str, world: int) -> dict[str, dict[str, tuple]]:
    if kind == "1d":
        strided = _uniform((S0,), (S0,))
        strided["l0.k"] = (_StridedShard(0, split_factor=2),)  # non-contiguous pieces: materializing fallback
        return {
            "fsdp": _uniform((S0,), (S0,)),
            "tp": _tp((S0,), (S1,), (R,)),
            "rowsharded": _uniform((S1,), (S0,)),
            "random1": _random(1, 1),
            "random2": _random(2, 1),
            "fallback": strided,
        }
    assert kind == "2x2"
    return {
        "hsdp(S0,R)": _uniform((S0, R), (S0, R)),
        "(R,S0)": _uniform((R, S0), (R, S0)),
        "(S0,S1)": _uniform((S0, S1), (S0, R)),
        "(S0,S0)": _uniform((S0, S0), (S0, S0)),
        "fsdp+tp": _tp((_StridedShard(0, split_factor=2), S0), (S0, S1), (S0, R)),
        "replicated": _uniform((R, R), (R, R)),
        "random3": _random(3, 2),
        "random4": _random(4, 2),
    }


def expected_routes(layout: dict[str, tuple], mesh_shape: tuple[int, ...]) -> dict[str, str]:
    """Materializing exactly for clusters with a member whose piece is not contiguous (checked by brute force)."""
    bad = set()
    for name, ps in layout.items():
        if any(isinstance(p, _StridedShard) for p in ps) and _noncontiguous(name, ps, mesh_shape):
            bad.add(name)
    return {rc.name: ("materializing" if {m.name for m in rc.members} & bad else "sharded") for rc in M.ref_clusters()}


def _noncontiguous(name: str, ps: tuple, mesh_shape: tuple[int, ...]) -> bool:
    """Ask torch itself (``_StridedShard`` index computation) whether some rank's rows are not a range."""
    import itertools

    length = M.SHAPES[name][ps[0].dim]
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        idx = torch.arange(length)
        for axis, p in enumerate(ps):
            if isinstance(p, _StridedShard):
                _, offs = p.local_shard_size_and_offset(
                    idx.numel(), mesh_shape[axis], coord[axis], offset_mode=_StridedShardOffsetMode.ALL
                )
                idx = idx[torch.tensor(offs, dtype=torch.long)] if offs else idx[:0]
            elif isinstance(p, Shard):
                size, off = Shard.local_shard_size_and_offset(idx.numel(), mesh_shape[axis], coord[axis])
                idx = idx[off : off + size]
        if idx.numel() > 1 and not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel())):
            return True
    return False


# ---------------------------------------------------------------------------------------------- helpers
def make_mesh(kind: str, world: int) -> DeviceMesh:
    if kind == "1d":
        return init_device_mesh("cpu", (world,))
    if kind == "2x2":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if kind == "2x2-permuted":  # group-rank order differs from coordinate order, differently per replica group
        return DeviceMesh("cpu", torch.tensor([[2, 0], [1, 3]]))
    raise AssertionError(kind)


def build(full: dict[str, torch.Tensor], mesh: DeviceMesh, layout: dict[str, tuple]) -> nn.Module:
    sharded = {n: distribute_tensor(v.clone(), mesh, list(layout[n]), src_data_rank=None) for n, v in full.items()}
    return make_module(sharded)


def local_pieces(tensors: dict[str, DTensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per name, (this rank's local tensor, its global index box from torch's own metadata helper).

    Where torch cannot describe the piece as a box (a non-contiguous ``_StridedShard``), the box is ``None`` and the
    local tensor is replaced by the full tensor (a collective; every rank takes the same branch).
    """
    out = {}
    for n, t in tensors.items():
        mesh, ps = t.device_mesh, tuple(t.placements)
        if any(isinstance(p, _StridedShard) for p in ps) and _noncontiguous(n, ps, tuple(mesh.shape)):
            out[n] = (t.full_tensor(), None)
            continue
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, ps)
        out[n] = (t.to_local(), (shape, offset))
    return out


def _bits(values: torch.Tensor) -> list[str]:
    fmt = "<d" if values.dtype == torch.float64 else "<f"
    return [struct.pack(fmt, v).hex() for v in values.tolist()]


def _compare(tag: str, tensors: dict[str, Any], want: dict[str, torch.Tensor], exact: bool) -> list[str]:
    """Compare this rank's pieces of DTensors (or full tensors) with the matching slices of ``want``."""
    bad = []
    pieces = (
        local_pieces(tensors)
        if all(isinstance(t, DTensor) for t in tensors.values())
        else {n: (t, None) for n, t in tensors.items()}
    )
    for n, w in want.items():
        g, box = pieces[n]
        if box is not None:
            shape, offset = box
            for d, (o, size) in enumerate(zip(offset, shape, strict=True)):
                w = w.narrow(d, o, size)
        g = g.to(torch.float64)
        if exact:
            if not torch.equal(g, w):
                bad.append(f"{tag}: weights of {n} differ (max abs {float((g - w).abs().max()):.3g})")
        elif not torch.allclose(g, w, rtol=1e-11, atol=0.0) or not torch.equal(g == 0, w == 0):
            bad.append(f"{tag}: weights of {n} not close / zero pattern differs")
    return bad


# ---------------------------------------------------------------------------------------------- parity suite
def parity_suite(rank: int, world: int, kind: str) -> dict[str, Any]:
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    torch.manual_seed(0)
    mesh = make_mesh(kind, world)
    full = M.full_weights()
    failures: list[str] = []
    records: list[Any] = []
    accounting: dict[str, Any] = {}
    zeros: dict[str, Any] = {}
    thr = M.lasso_threshold(full, M.ref_clusters())
    all_layouts = layouts(kind, world)
    if kind == "2x2":
        permuted = make_mesh("2x2-permuted", world)
        extra = {
            "permuted-mesh(R,S0)": (permuted, _uniform((R, S0), (R, S0))),
            "permuted-mesh(S0,S1)": (permuted, _uniform((S0, S1), (S0, R))),
        }
    else:
        extra = {}
    cases = {n: (mesh, lay) for n, lay in all_layouts.items()} | extra
    for lname, (lmesh, layout) in cases.items():
        want_routes = expected_routes(layout, tuple(lmesh.shape))
        variants = VARIANTS if lname == next(iter(cases)) else [v for v in VARIANTS if v[0] in LAYOUT_VARIANTS]
        for vname, shared, mult, score, method, targets in variants:
            tag = f"{lname}/{vname}"
            refs = M.ref_clusters(shared_mlp=shared, resid_multiple_of=mult)
            ref = M.reference(full, refs, targets, score=score, method=method, threshold=thr)
            got: dict[str, Any] = {}
            # DTensor's own full_tensor gathers in process-group rank order, which is wrong on a mesh whose rank
            # layout is not increasing along an axis (torch 2.13): there the materializing path must be refused
            # before anything changes (checked here), and "auto" must take the sharded path (checked below).
            paths = ("auto", "materializing")
            if lname.startswith("permuted"):
                paths = ("auto",)
                failures += _materializing_refused(tag, full, lmesh, layout, shared, mult)
            for executor in paths:
                module = build(full, lmesh, layout)
                decls = M.declarations(shared_mlp=shared, resid_multiple_of=mult)
                pruner = Pruner(module, resolve_clusters(module, decls), score=score, executor=executor)
                routes = {k: v[0] for k, v in pruner.routes.items()}
                want = want_routes if executor == "auto" else dict.fromkeys(want_routes, "materializing")
                if routes != want:
                    failures.append(f"{tag}/{executor}: routes {pruner.routes} != {want}")
                q = {}
                if executor == "auto":  # the sharded Q against the reference (cheap: one gather)
                    for ex in pruner.executors:
                        q.update(ex.unit_sq_norms())
                with torch.no_grad():
                    res = pruner.step(targets, method=method, threshold=thr, count=True)
                params = dict(module.named_parameters())
                got[executor] = (res, {n: p.to_local().clone() for n, p in params.items()})
                if res.dropped != ref.dropped:
                    failures.append(f"{tag}/{executor}: dropped {res.dropped} != reference {ref.dropped}")
                failures += _compare(f"{tag}/{executor}", params, ref.weights, exact=method == "hard")
                if res.zeros != ref.zeros:
                    failures.append(f"{tag}/{executor}: zeros {res.zeros} != reference {ref.zeros}")
                if executor == "auto" and vname == "hard-rms":
                    zeros[lname] = (res.zeros, ref.zeros, [tuple(map(repr, layout[n])) for n in M.SHAPES])
                for name, q_C in q.items():
                    if not torch.allclose(q_C, torch.tensor(ref.q[name], dtype=q_C.dtype), rtol=1e-12, atol=0):
                        failures.append(f"{tag}/{executor}: Q of {name} differs from reference")
                records.append((tag, executor, res.dropped, {k: _bits(v) for k, v in q.items()}))
                if executor == "auto" and vname == "hard-rms":
                    failures += _hold_and_grads(tag, module, pruner, full, ref, refs, lmesh, layout)
            if len(paths) == 1:
                continue
            if got["auto"][0].dropped != got["materializing"][0].dropped:
                failures.append(f"{tag}: sharded and materializing dropped differ")
            for n, local in got["auto"][1].items():  # same layout: local pieces must match too
                other = got["materializing"][1][n]
                if method == "hard":
                    same = torch.equal(local, other)
                else:
                    same = torch.allclose(local, other, rtol=1e-11, atol=0)
                if not same:
                    failures.append(f"{tag}: sharded and materializing local pieces of {n} differ")
        if all(v == "sharded" for v in want_routes.values()):
            accounting[lname] = _accounting(full, lmesh, layout)
        else:
            failures += _forced_sharded_raises(lname, full, lmesh, layout)
    failures += _partial_routes(mesh)
    failures += _grad_with_other_layout(mesh)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    agree = all(g == gathered[0] for g in gathered)
    return {
        "failures": failures,
        "accounting": accounting,
        "ranks_agree": agree,
        "num_cases": len(records),
        "zeros": zeros,
        "mesh": mesh.mesh.tolist(),
    }


def _materializing_refused(tag: str, full: dict, mesh: DeviceMesh, layout: dict, shared: bool, mult: int) -> list[str]:
    """On a permuted mesh, executor='materializing' raises a ValueError naming the mesh problem; nothing changes."""
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    module = build(full, mesh, layout)
    before = {n: p.to_local().clone() for n, p in module.named_parameters()}
    decls = M.declarations(shared_mlp=shared, resid_multiple_of=mult)
    try:
        Pruner(module, resolve_clusters(module, decls), executor="materializing")
        return [f"{tag}/materializing: not refused on a permuted mesh"]
    except ValueError as err:
        bad = [] if "do not increase along every axis" in str(err) else [f"{tag}/materializing: message {err}"]
    changed = [n for n, p in module.named_parameters() if not torch.equal(p.to_local(), before[n])]
    return bad + ([f"{tag}/materializing: changed {changed}"] if changed else [])


def _hold_and_grads(
    tag: str, module: nn.Module, pruner: Any, full: dict, ref: Any, refs: list, mesh: DeviceMesh, layout: dict
) -> list[str]:
    """hold() re-zeroes restored weights, zero_grads() zeroes dropped units of gradients: no collectives."""
    bad = []
    params = dict(module.named_parameters())
    gen = torch.Generator().manual_seed(7)
    grads = {n: torch.randn(full[n].shape, generator=gen, dtype=torch.float64) for n in full}
    with torch.no_grad():
        for n, p in params.items():
            p.to_local().copy_(distribute_tensor(full[n], mesh, list(layout[n]), src_data_rank=None).to_local())
            p.grad = distribute_tensor(grads[n], mesh, list(layout[n]), src_data_rank=None)
    sharded_only = all(k == "sharded" for k, _ in pruner.routes.values())
    with Recorder() as rec:
        pruner.hold()
        pruner.zero_grads()
    if sharded_only and (rec.calls or rec.materialized or rec.comm_mode.get_total_counts()):
        bad.append(f"{tag}: hold/zero_grads communicated: {rec.summary()}")
    bad += _compare(f"{tag}/hold", params, ref.weights, exact=True)
    want_grads = {n: g.clone() for n, g in grads.items()}
    for rc in refs:
        for m in rc.members:
            for u in ref.dropped[rc.name]:
                M.unit_view(want_grads[m.name], m, rc.num_units, u).zero_()
    bad += _compare(f"{tag}/zero_grads", {n: p.grad for n, p in params.items()}, want_grads, exact=True)
    return bad


def _group_sets(mesh: DeviceMesh, axes: tuple[int, ...]) -> set[tuple[int, ...]]:
    """All process-group rank sets spanning mesh ``axes`` (computed from the mesh tensor, not the library)."""
    ranks = mesh.mesh
    other = [a for a in range(ranks.dim()) if a not in axes]
    perm = ranks.permute(*other, *axes).reshape(-1, int(torch.tensor([ranks.shape[a] for a in axes]).prod()))
    return {tuple(sorted(row.tolist())) for row in perm}


def _accounting(full: dict, mesh: DeviceMesh, layout: dict) -> dict[str, Any]:
    """Count collectives of one pruning step with and without counts; the expectation is computed here."""
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    module = build(full, mesh, layout)
    pruner = Pruner(module, resolve_clusters(module, M.declarations()), executor="sharded")
    me = dist.get_rank()
    expect_gathers: dict[tuple[int, ...], int] = {}
    for rc in M.ref_clusters():
        axes = tuple(
            sorted({a for m in rc.members for a, p in enumerate(layout[m.name]) if not isinstance(p, Replicate)})
        )
        if not axes:
            continue
        mine = next(g for g in _group_sets(mesh, axes) if me in g)
        if len(mine) > 1:
            expect_gathers[mine] = expect_gathers.get(mine, 0) + rc.num_units
    whole = tuple(sorted(mesh.mesh.flatten().tolist()))
    q_one = _q_bits(pruner)
    with torch.no_grad(), Recorder() as plain:
        pruner.step(TARGETS)
    with torch.no_grad(), Recorder() as counted:
        pruner.step(TARGETS, count=True)
    # the same step with the two-collective reduction forced for every group of more than two ranks
    module = build(full, mesh, layout)
    saved = ShardedExecutor.two_phase_min_bytes
    ShardedExecutor.two_phase_min_bytes = 0
    try:
        forced = Pruner(module, resolve_clusters(module, M.declarations()), executor="sharded")
    finally:
        ShardedExecutor.two_phase_min_bytes = saved
    q_two = _q_bits(forced)
    with torch.no_grad(), Recorder() as two_phase:
        res = forced.step(TARGETS)
    return {
        "plain": plain.summary(),
        "counted": counted.summary(),
        "two_phase": two_phase.summary(),
        "two_phase_same_bits": q_two == q_one,
        "two_phase_dropped_ok": res.dropped == M.reference(full, M.ref_clusters(), TARGETS).dropped,
        "expect_gathers": sorted(expect_gathers.items()),
        "whole_mesh": whole,
        "num_params": len(M.SHAPES),
    }


def _q_bits(pruner: Any) -> dict[str, list[str]]:
    q = {}
    for ex in pruner.executors:
        q.update(ex.unit_sq_norms())
    return {k: _bits(v) for k, v in q.items()}


def _forced_sharded_raises(lname: str, full: dict, mesh: DeviceMesh, layout: dict) -> list[str]:
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    module = build(full, mesh, layout)
    try:
        Pruner(module, resolve_clusters(module, M.declarations()), executor="sharded")
    except ValueError as err:
        msg = str(err)
        if "'heads.0'" not in msg or "l0.k" not in msg or "non-contiguous" not in msg:
            return [f"{lname}: forced sharded error does not name cluster/member/reason: {msg}"]
        return []
    return [f"{lname}: forced executor='sharded' on an ineligible cluster did not raise"]


def _partial_routes(mesh: DeviceMesh) -> list[str]:
    """A member with a Partial placement routes to materializing with a reason; forced sharded raises."""
    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.parallel.executors import route

    n = mesh.ndim
    module = nn.Module()
    module.w = nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Partial()] + [R] * (n - 1)))
    module.r = nn.Parameter(distribute_tensor(torch.ones(3, 4), mesh, [S0] + [R] * (n - 1), src_data_rank=None))
    rcs = resolve_clusters(module, Cluster("p", writers=["w"], readers=["r"]))
    params = dict(module.named_parameters())
    kind, reason = route(rcs, params)["p"]
    ok = kind == "materializing" and "Partial" in reason and "'w'" in reason
    bad = [] if ok else [f"partial route {kind}, {reason}"]
    try:
        route(rcs, params, executor="sharded")
        bad.append("forced sharded with a Partial member did not raise")
    except ValueError as err:
        if "'p'" not in str(err):
            bad.append(f"error does not name the cluster: {err}")
    return bad


def _grad_with_other_layout(mesh: DeviceMesh) -> list[str]:
    """A gradient whose placements differ from its parameter's is still masked right (through a dense copy)."""
    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    n = mesh.ndim
    gen = torch.Generator().manual_seed(11)
    w, r = torch.randn(6, 3, generator=gen), torch.randn(3, 6, generator=gen)
    module = nn.Module()
    module.w = nn.Parameter(distribute_tensor(w, mesh, [S0] + [R] * (n - 1), src_data_rank=None))
    module.r = nn.Parameter(distribute_tensor(r, mesh, [S1] + [R] * (n - 1), src_data_rank=None))
    grads = {"w": torch.randn(6, 3, generator=gen), "r": torch.randn(3, 6, generator=gen)}
    module.w.grad = distribute_tensor(grads["w"], mesh, [R] * n, src_data_rank=None)  # not the param's layout
    module.r.grad = distribute_tensor(grads["r"], mesh, [S1] + [R] * (n - 1), src_data_rank=None)
    pruner = Pruner(module, resolve_clusters(module, Cluster("g", writers=["w"], readers=["r"])), executor="sharded")
    with torch.no_grad():
        res = pruner.step({"g": 0.5})
        pruner.zero_grads()
    dropped = res.dropped["g"]
    q = (w * w).sum(dim=1) + (r * r).sum(dim=0)
    want = sorted(torch.sort(q, stable=True).indices[:3].tolist())
    grads["w"][dropped, :] = 0
    grads["r"][:, dropped] = 0
    ok = (
        dropped == want
        and torch.equal(module.w.grad.full_tensor(), grads["w"])
        and torch.equal(module.r.grad.full_tensor(), grads["r"])
    )
    return [] if ok else [f"grad with another layout: dropped {dropped} (want {want}) or grads wrong"]


# ---------------------------------------------------------------------------------------------- agreement
def _tie_module(mesh: DeviceMesh, ps2: tuple, ps1: tuple) -> tuple[nn.Module, list]:
    from lightning_pat import Cluster

    amp = torch.tensor([2.0, 1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 3.0], dtype=torch.float64)  # Q = 13 * amp^2, exact
    sign = torch.where(torch.arange(48).view(8, 6) % 3 == 0, -1.0, 1.0).to(torch.float64)
    tw = sign * amp[:, None]
    tr = sign.T * amp[None, :]
    one = 1.0 + 2.0**-23
    x = torch.tensor([1.5 * one**k for k in (2, 1, 0, 3, 1, 0, 2, 4)], dtype=torch.float32)  # 1-ulp apart
    gen = torch.Generator().manual_seed(3)
    vals = (torch.rand(16, generator=gen) * 10.0 ** torch.randint(-3, 4, (16,), generator=gen)).to(torch.float32)
    perm_r = torch.stack([vals[torch.randperm(16, generator=gen)] for _ in range(8)], dim=1)  # [16, 8]
    perm_w = torch.stack([vals[torch.randperm(16, generator=gen)] for _ in range(8)], dim=0)  # [8, 16]
    module = nn.Module()
    for name, t, ps in (
        ("tw", tw, ps2),
        ("tr", tr, ps2),
        ("tb", amp.clone(), ps1),
        ("nx", x, ps1),
        ("pr", perm_r, ps2),
        ("pw", perm_w, ps2),
    ):
        module.register_parameter(name, nn.Parameter(distribute_tensor(t, mesh, list(ps), src_data_rank=None)))
    decls = [
        Cluster("tie", writers=["tw", "tb"], readers=["tr"]),
        Cluster("ulp", writers=["nx"]),
        Cluster("perm", writers=["pw"], readers=["pr"]),
    ]
    return module, decls


def agreement_suite(rank: int, world: int, kind: str) -> dict[str, Any]:
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    meshes = {"1d": [make_mesh("1d", world)]}.get(kind) or [make_mesh("2x2", world), make_mesh("2x2-permuted", world)]
    if kind == "1d":
        combos = [((S0,), (S0,)), ((S1,), (S0,)), ((R,), (S0,))]
    else:
        combos = [((S0, R), (S0, R)), ((R, S0), (R, S0)), ((S0, S1), (R, S0)), ((S1, S0), (S0, S0))]
    mine: list[Any] = []
    for mi, mesh in enumerate(meshes):
        for ps2, ps1 in combos:
            for executor in ("auto", "materializing"):
                module, decls = _tie_module(mesh, ps2, ps1)
                if mi == 1 and executor == "materializing":  # permuted mesh: refused (see parity_suite)
                    try:
                        Pruner(module, resolve_clusters(module, decls), executor=executor)
                        mine.append((f"mesh{mi}/{ps2}/{ps1}/materializing", "not refused", {}, {}))
                    except ValueError:
                        pass
                    continue
                pruner = Pruner(module, resolve_clusters(module, decls), executor=executor)
                q = {}
                for ex in pruner.executors:
                    q.update(ex.unit_sq_norms())
                with torch.no_grad():
                    res = pruner.step({"tie": 0.5, "ulp": 0.5, "perm": 0.5})
                mine.append(
                    (
                        f"mesh{mi}/{ps2}/{ps1}/{executor}",
                        {k: v[0] for k, v in pruner.routes.items()},
                        res.dropped,
                        {k: _bits(v) for k, v in q.items()},
                    )
                )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {"records": mine, "ranks_agree": all(g == gathered[0] for g in gathered)}


# ---------------------------------------------------------------------------------------------- sub-mesh
def submesh_suite(rank: int, world: int) -> dict[str, Any]:
    """A mesh over ranks [1, 2] of 3: rank 0 issues no collectives and gets no clusters; the others prune right."""
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    mesh = DeviceMesh("cpu", [1, 2])
    full = M.full_weights()
    module = build(full, mesh, _uniform((S0,), (S0,)))
    pruner = Pruner(module, resolve_clusters(module, M.declarations()), executor="auto")
    with torch.no_grad(), Recorder() as rec:
        res = pruner.step(TARGETS, count=True)
    out: dict[str, Any] = {
        "clusters": [rc.name for rc in pruner.clusters],
        "calls": rec.summary(),
        "dropped": res.dropped,
        "zeros": res.zeros,
    }
    if rank != 0:
        ref = M.reference(full, M.ref_clusters(), TARGETS)
        out["match"] = res.dropped == ref.dropped and res.zeros == ref.zeros
    return out


def suite(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Everything for one mesh config in one spawn: parity, accounting, agreement (+ sub-mesh at world 3)."""
    out = {"parity": parity_suite(rank, world, kind), "agreement": agreement_suite(rank, world, kind)}
    if world == 3:
        out["submesh"] = submesh_suite(rank, world)
    return out
