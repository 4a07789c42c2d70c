"""Worker functions for test_trust.py (run on every rank by ``run_distributed``): layout-invariant selection on
near ties, permuted meshes, process-group re-initialisation, rank-local gradients, stateless executors.

Each check returns plain data; the pytest side asserts on it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.common.cases import make_module

R, S0, S1 = Replicate(), Shard(0), Shard(1)
NUM_PAIRS = 12
ROWS, COLS = 24, 256  # writer [2, ROWS]; reader [COLS, 2]: its column sums are partial under Shard(0)


def near_tie_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """``NUM_PAIRS`` two-unit clusters whose units differ by one float32 ulp in one reader element.

    The exact sums of squares differ by about 1e-9 relative: far below float32 accumulation error over 256 terms
    (about 1e-6), far above float64's (about 1e-15). Which unit is smaller alternates between clusters.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(NUM_PAIRS):
        w = 0.5 + 0.5 * torch.rand(ROWS, generator=gen)
        col = 0.5 + 0.5 * torch.rand(COLS, generator=gen)
        r = torch.stack([col, col.clone()], dim=1)  # [COLS, 2]
        i = int(torch.randint(0, COLS, (1,), generator=gen))
        r[i, k % 2] = torch.nextafter(r[i, k % 2], torch.tensor(2.0))  # unit k % 2 is a hair larger
        out[f"w{k}"] = torch.stack([w, w.clone()])  # [2, ROWS], identical rows
        out[f"r{k}"] = r
    return out


def near_tie_declarations() -> list:
    from lightning_pat import Cluster

    return [Cluster(f"pair{k}", writers=[f"w{k}"], readers=[f"r{k}"]) for k in range(NUM_PAIRS)]


def near_tie_reference(weights: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The exact answer: the unit that was not bumped is dropped (float64 sums of exact float32 squares)."""
    out = {}
    for k in range(NUM_PAIRS):
        q = weights[f"w{k}"].double().pow(2).sum(1) + weights[f"r{k}"].double().pow(2).sum(0)
        assert q[0] != q[1]
        out[f"pair{k}"] = [int(torch.argmin(q))]
    return out


def near_ties(rank: int, world: int) -> dict[str, Any]:
    """Dropped units per (layout, executor) on this world size; the caller compares them with the reference."""
    from lightning_pat import prune_clusters

    mesh = init_device_mesh("cpu", (world,))
    full = near_tie_weights()
    layouts = {"writer S0, reader S0": (S0, S0), "writer S1, reader S1": (S1, S1), "replicated": (R, R)}
    out = {}
    for lname, (pw, pr) in layouts.items():
        for executor in ("auto", "materializing"):
            tensors = {
                n: distribute_tensor(t.clone(), mesh, [pw if n.startswith("w") else pr], src_data_rank=None)
                for n, t in full.items()
            }
            res = prune_clusters(make_module(tensors), near_tie_declarations(), 0.5, executor=executor)
            out[f"{lname}/{executor}"] = (res.routes, res.dropped)
    return out


# ---------------------------------------------------------------------------------------------- permuted mesh
def permuted_mesh(rank: int, world: int) -> dict[str, Any]:
    """On a 2x2 mesh [[2, 0], [1, 3]]: forced materializing and an ineligible layout raise before any change;
    ``auto`` takes the sharded path and matches the reference."""
    from lightning_pat import Cluster, prune_clusters
    from lightning_pat.pruning.pruner import Pruner

    mesh = DeviceMesh("cpu", torch.tensor([[2, 0], [1, 3]]))
    gen = torch.Generator().manual_seed(5)
    w, r = torch.randn(8, 6, generator=gen), torch.randn(6, 8, generator=gen)
    decl = Cluster("h", writers=["w"], readers=["r"])

    def module(pw: tuple, pr: tuple) -> nn.Module:
        m = nn.Module()
        m.w = nn.Parameter(distribute_tensor(w.clone(), mesh, list(pw), src_data_rank=None))
        m.r = nn.Parameter(distribute_tensor(r.clone(), mesh, list(pr), src_data_rank=None))
        return m

    out: dict[str, Any] = {}
    m = module((S0, R), (R, S1))
    before = {n: p.to_local().clone() for n, p in m.named_parameters()}
    try:
        prune_clusters(m, decl, 0.5, executor="materializing")
        out["forced"] = "no error"
    except ValueError as err:
        out["forced"] = str(err)
    out["forced_unchanged"] = all(torch.equal(p.to_local(), before[n]) for n, p in m.named_parameters())
    res = prune_clusters(m, decl, 0.5)
    q = w.double().pow(2).sum(1) + r.double().pow(2).sum(0)
    out["auto"] = (res.routes, res.dropped["h"], sorted(torch.sort(q, stable=True).indices[:4].tolist()))
    from torch.distributed.tensor import Partial

    m = nn.Module()  # a Partial member: not eligible for the sharded path, and materializing would be wrong here
    m.w = nn.Parameter(
        torch.distributed.tensor.DTensor.from_local(torch.ones(8, 6), mesh, [Partial(), R], run_check=False)
    )
    m.r = nn.Parameter(distribute_tensor(r.clone(), mesh, [R, S1], src_data_rank=None))
    try:
        Pruner(m, __import__("lightning_pat").resolve_clusters(m, decl))
        out["ineligible"] = "no error"
    except ValueError as err:
        out["ineligible"] = str(err)
    return out


# ---------------------------------------------------------------------------------------------- re-init
def _mesh_step() -> tuple[dict[str, list[int]], list[str]]:
    from lightning_pat import Cluster, prune_clusters

    mesh = init_device_mesh("cpu", (2, 1, 2))  # axes (0, 1) span 2 of 4 ranks: a group made with new_group
    gen = torch.Generator().manual_seed(9)
    w, r = torch.randn(8, 6, generator=gen), torch.randn(6, 8, generator=gen)
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(w, mesh, [S0, S0, R], src_data_rank=None))
    m.r = nn.Parameter(distribute_tensor(r, mesh, [S1, S1, R], src_data_rank=None))
    res = prune_clusters(m, Cluster("h", writers=["w"], readers=["r"]), 0.5, executor="sharded")
    q = w.double().pow(2).sum(1) + r.double().pow(2).sum(0)
    return res.dropped, sorted(torch.sort(q, stable=True).indices[:4].tolist())


def reinit(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    """Prune, destroy the process group, initialise a new one, prune again on a new mesh: both right."""
    first = _mesh_step()
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "second"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    second = _mesh_step()
    return {"first": first, "second": second}


# ---------------------------------------------------------------------------------------------- rank-local grads
def _materializing_pair(world: int, *, seed: int) -> tuple[nn.Module, Any]:
    """A writer ``w`` (Shard(0)) and a reader ``r`` (Shard(1)) of one 8-unit cluster, on the materializing path."""
    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [S0], src_data_rank=None))
    m.r = nn.Parameter(distribute_tensor(torch.randn(6, 8, generator=gen), mesh, [S1], src_data_rank=None))
    return m, Pruner(m, resolve_clusters(m, Cluster("h", writers=["w"], readers=["r"])), executor="materializing")


def grads_on_some_ranks(rank: int, world: int) -> dict[str, Any]:
    """Materializing DTensor cluster whose gradient exists on rank 0 only: every rank raises the same error."""
    m, pruner = _materializing_pair(world, seed=2)
    with torch.no_grad():
        pruner.step({"h": 0.5})
    for p in m.parameters():
        p.grad = torch.ones_like(p) if rank == 0 else None
    try:
        with torch.no_grad():
            pruner.zero_grads()
        return {"error": None}
    except ValueError as err:
        return {"error": str(err)}


# ---------------------------------------------------------------------------------------------- stateless
def stale_copies(rank: int, world: int) -> dict[str, Any]:
    """select() keeps no dense copy: a later hold() zeroes the newer weights instead of writing old ones back."""
    m, pruner = _materializing_pair(world, seed=4)
    with torch.no_grad():
        dropped = pruner.step({"h": 0.5}).dropped["h"]
        pruner.select({"h": 0.5})  # scores only
        for p in m.parameters():  # an optimizer update after the selection
            p.to_local().add_(1.0)
        want_w, want_r = m.w.full_tensor().clone(), m.r.full_tensor().clone()
        want_w[dropped] = 0
        want_r[:, dropped] = 0
        pruner.hold()
    return {"ok": torch.equal(m.w.full_tensor(), want_w) and torch.equal(m.r.full_tensor(), want_r)}


# ---------------------------------------------------------------------------------------------- local checks
def local_shape_mismatch(rank: int, world: int) -> dict[str, Any]:
    """A layout check that fails on the last rank only (simulated: its computed box is wrong) must make every rank
    raise before the first gather, instead of leaving the others waiting in it."""
    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.parallel.executors import sharded
    from lightning_pat.pruning.pruner import Pruner

    mesh = init_device_mesh("cpu", (world,))
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(torch.ones(8, 6), mesh, [S0], src_data_rank=None))
    m.r = nn.Parameter(distribute_tensor(torch.ones(6, 8), mesh, [S1], src_data_rank=None))
    real = sharded.placement.local_box
    if rank == world - 1:
        sharded.placement.local_box = lambda *a, **k: tuple((o, n + 1) for o, n in real(*a, **k))
    try:
        Pruner(m, resolve_clusters(m, Cluster("h", writers=["w"], readers=["r"])), executor="sharded")
        return {"error": None}
    except ValueError as err:
        return {"error": str(err).split(" (on some rank")[0]}
    finally:
        sharded.placement.local_box = real


# ---------------------------------------------------------------------------------------------- edited states
def edited_resume(rank: int, world: int) -> dict[str, Any]:
    """Issue 23: a restored state is refused on every rank together, before anything is applied, when it fails a
    check on one rank only (a rank-local edit) or when its mask is not zero in the sharded weights (a reduction)."""
    import copy

    from lightning_pat import Cluster
    from lightning_pat.pruning.options import PruningOptions
    from lightning_pat.training.controller import PruningController

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(5)
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [S0], src_data_rank=None))
    m.r = nn.Parameter(distribute_tensor(torch.randn(6, 8, generator=gen), mesh, [S1], src_data_rank=None))
    opts = PruningOptions(
        [Cluster("h", writers=["w"], readers=["r"])], target_sparsity=0.5, warmup_steps=0, ramp_steps=2,
        mode="direct", score="rms",
    )  # fmt: skip
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ctl = PruningController(opts)
    ctl.bind(m, optimizers=[opt])
    ctl.start()
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    ctl.after_backward(opt)
    opt.step()
    ctl.after_step()
    saved = ctl.state_dict()
    ctl.release()
    kept = [u for u in range(8) if u not in saved["dropped"]["h"]]
    edits = {
        "rank-local": lambda s: s.update(step=99) if rank == world - 1 else None,
        "kept-as-dropped": lambda s: s["dropped"].update(h=kept[: len(s["dropped"]["h"])]),
        "unedited": lambda s: None,
    }
    out: dict[str, Any] = {"routes": dict(ctl.run.plan.routes) if ctl.run.plan else {}}
    before = (m.w.full_tensor().clone(), m.r.full_tensor().clone())
    for case, edit in edits.items():
        state = copy.deepcopy(saved)
        edit(state)
        again = PruningController(opts)
        again.bind(m, optimizers=[opt])
        again.load_state_dict(state)
        try:
            again.start(global_step=1)
            out[case] = None
        except ValueError as err:
            out[case] = str(err)
        again.release()
        out[f"{case}/unchanged"] = torch.equal(m.w.full_tensor(), before[0]) and torch.equal(
            m.r.full_tensor(), before[1]
        )
    return out


def suite(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"near_ties": near_ties(rank, world), "stale": stale_copies(rank, world)}
    out["edited"] = edited_resume(rank, world)
    out["shape_check"] = local_shape_mismatch(rank, world)
    out["grads"] = grads_on_some_ranks(rank, world)
    if world == 4:
        out["permuted"] = permuted_mesh(rank, world)
        out["reinit"] = reinit(rank, world, store_dir)  # last: it replaces the process group
    return out
