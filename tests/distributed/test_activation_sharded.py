"""``score="activation"`` on sharded parameters (FSDP2, tensor parallel, both): the acceptance test of issue 16.

Two data-parallel ranks, each given half of every batch, must end with the statistics and the selected units of
one process that saw the whole batches (statistics within float64 rounding; the model is float64, so the squares
are summed in float64). Tensor-parallel peers see the same rows but only their shard of a row-parallel reader's
input channels. The selection is one packed collective over the whole mesh (the statistics and the readers'
column partials travel with the weight partials), recorded by the collective recorder, and nothing is gathered.
An independent float64 computation (plain torch, no library code) checks the statistics and scores themselves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.common.dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

BETA = 0.5
STEPS = 3
ROWS = 8
TARGETS = {"mlp.0": 0.5, "mlp.1": 0.5}


class _Block(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, f, dtype=torch.float64)
        self.down = nn.Linear(f, d, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference
        self.blocks = nn.ModuleList([_Block(d, f) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _clusters() -> list:
    from lightning_pat import Cluster

    return [
        Cluster(
            "mlp.{layer}",
            writers=[r"re:blocks\.(?P<layer>\d+)\.up\.(weight|bias)"],
            readers=[r"re:blocks\.(?P<layer>\d+)\.down\.weight"],
        )
    ]


def _batches(d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(ROWS, d, generator=g, dtype=torch.float64) * (1 + i) for i in range(STEPS)]


def _train_forwards(model: nn.Module, batches: list[torch.Tensor]) -> None:
    for x in batches:
        model.zero_grad()
        model(x).square().sum().backward()  # a full training step's forward/backward (no update: weights stay put)


def _single(d: int, f: int) -> dict:
    """One process, the whole batches: the library's plain-tensor path."""
    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.activation import ActivationStats

    model = _Net(d, f)
    stats = ActivationStats(model, resolve_clusters(model, _clusters()), beta=BETA)
    stats.attach()
    _train_forwards(model, _batches(d))
    stats.detach()
    pruner = Pruner(model, make_plan(model, _clusters(), score="activation"))
    with torch.no_grad():
        result = pruner.step(TARGETS, evidence=stats)
    averages = stats.averages()
    from lightning_pat import prune_clusters
    from lightning_pat.scoring.activation import calibrate

    fresh = _Net(d, f)
    one_shot = prune_clusters(
        fresh, _clusters(), 0.5, score="activation", activations=calibrate(fresh, _clusters(), _batches(d))
    )
    return {
        "one_shot": one_shot.dropped,
        "averages": {k: v.tolist() for k, v in averages.items()},
        "scores": {k: v.tolist() for k, v in stats.unit_scores(dict(model.named_parameters())).items()},
        "dropped": result.dropped,
    }


def _reference(d: int, f: int) -> dict:
    """Independent float64: per-batch mean of each reader input channel's square, its EMA, and the unit scores."""
    model = _Net(d, f)
    batches = _batches(d)
    out: dict = {"averages": {}, "scores": {}}
    with torch.no_grad():
        inputs = list(batches)
        for i, block in enumerate(model.blocks):
            ema = None
            nxt = []
            for x in inputs:
                h = torch.relu(x @ block.up.weight.T + block.up.bias)
                m = (h * h).mean(dim=0)
                ema = m if ema is None else BETA * ema + (1 - BETA) * m
                nxt.append(x + h @ block.down.weight.T)
            inputs = nxt
            out["averages"][f"blocks.{i}.down"] = ema
            out["scores"][f"mlp.{i}"] = (ema * (block.down.weight**2).sum(dim=0)).sqrt()
    return out


def _shard(model: _Net, kind: str, mesh) -> None:  # noqa: ANN001
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if kind in ("tp", "2d"):
        tp = mesh["tp"] if kind == "2d" else mesh
        for block in model.blocks:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if kind in ("fsdp2", "2d"):
        dp = mesh["dp"] if kind == "2d" else mesh
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)


def sharded(model: _Net, kind: str, rank: int, world: int) -> tuple[int, int]:
    """Shard ``model`` for ``kind`` on a fresh mesh; return this rank's data-parallel index and the dp size."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = (mesh.get_coordinate()[0], 2)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp" if kind == "fsdp2" else "tp",))
        dp = (rank, world) if kind == "fsdp2" else (0, 1)
    _shard(model, kind, mesh)
    return dp


def _worker(rank: int, world: int, kind: str, d: int, f: int) -> dict:
    from lightning_pat import resolve_clusters
    from lightning_pat.parallel.comm import dtensor
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.activation import ActivationStats
    from tests.distributed.workers.recorder import Recorder

    model = _Net(d, f)
    dp_rank, dp_size = sharded(model, kind, rank, world)
    assert all(dtensor.is_dtensor(p) for p in model.parameters())
    stats = ActivationStats(model, resolve_clusters(model, _clusters()), beta=BETA)
    stats.attach()
    half = ROWS // dp_size
    _train_forwards(model, [x[dp_rank * half : (dp_rank + 1) * half] for x in _batches(d)])
    stats.detach()
    pruner = Pruner(model, make_plan(model, _clusters(), score="activation", executor="sharded"))
    # the statistics and scores as every rank holds them after the one reduction (before the weights are pruned)
    reduced = pruner.executors[0].reduce(data_riders=stats.data_riders(), columns=True)
    scores = stats.finish(reduced)
    with torch.no_grad(), Recorder() as rec:
        result = pruner.step(TARGETS, evidence=stats)
    averages = {}
    for rc in stats.clusters:
        ((_, name),) = stats.readers[rc.name]
        width = stats.modules[name].in_features
        summed = reduced.data[rc.name]
        averages[name] = (summed[:width] / summed[width:]).tolist()
    # one-shot: calibrate() and prune_clusters() on the sharded model (the statistics ride in the same gather)
    from lightning_pat import prune_clusters
    from lightning_pat.scoring.activation import calibrate

    fresh = _Net(d, f)
    sharded(fresh, kind, rank, world)
    calibrated = calibrate(fresh, _clusters(), [x[dp_rank * half : (dp_rank + 1) * half] for x in _batches(d)])
    with Recorder() as one_shot_rec:
        one_shot = prune_clusters(fresh, _clusters(), 0.5, score="activation", activations=calibrated)
    return {
        "one_shot": one_shot.dropped,
        "one_shot_materialized": one_shot_rec.summary()["materialized"],
        "summary": rec.summary(),
        "averages": averages,
        "scores": {k: v.tolist() for k, v in scores.items()},
        "dropped": result.dropped,
        "windows": stats.state_dict()["window"],  # which input channels this rank saw: [first, channels]
        "routes": {k: v[0] for k, v in pruner.routes.items()},
    }


@pytest.mark.parametrize(
    ("kind", "world", "d", "f"),
    [("fsdp2", 2, 7, 9), ("tp", 2, 6, 8), ("2d", 4, 6, 8)],  # fsdp2: uneven shards (9 = 5 + 4, 7 = 4 + 3)
)
def test_half_batches_on_data_parallel_ranks_equal_one_process_on_the_whole_batch(kind, world, d, f):
    single = _single(d, f)
    ref = _reference(d, f)
    for name, want in ref["averages"].items():  # the single-process run itself is right
        torch.testing.assert_close(torch.tensor(single["averages"][name], dtype=torch.float64), want)
    ranks = run_distributed(_worker, world, kind, d, f, timeout=200)
    whole = tuple(range(world))
    for rank, got in enumerate(ranks):
        where = (kind, rank)
        assert set(got["routes"].values()) == {"sharded"}, where
        assert got["dropped"] == single["dropped"], where  # the same units as one process on the whole batch
        assert got["dropped"] == ranks[0]["dropped"], where
        assert got["one_shot"] == single["one_shot"], where  # calibrate + prune_clusters on the sharded model
        assert got["one_shot_materialized"] == [], where
        assert got["scores"] == ranks[0]["scores"], where  # bitwise identical on every rank
        for name, want in ref["averages"].items():
            got_avg = torch.tensor(got["averages"][name], dtype=torch.float64)
            torch.testing.assert_close(got_avg, want, rtol=1e-13, atol=0)
            torch.testing.assert_close(
                got_avg, torch.tensor(single["averages"][name], dtype=torch.float64), rtol=1e-13, atol=0
            )
        for name, want in ref["scores"].items():
            torch.testing.assert_close(torch.tensor(got["scores"][name], dtype=torch.float64), want, rtol=1e-13, atol=0)
        calls = got["summary"]["calls"]
        assert len(calls) == 1, (where, calls)  # ONE collective for the whole selection: stats ride with Q
        name, group, dtype, _ = calls[0]
        assert name in ("all_gather_single", "all_gather_into_tensor"), where
        assert tuple(group) == whole, where
        assert dtype == "torch.float64", where
        assert got["summary"]["materialized"] == [], where  # no weight gathered
        assert sum(got["summary"]["comm_counts"].values()) == 1, where  # and nothing DTensor-internal
    if kind in ("tp", "2d"):  # a row-parallel reader's rank sees only its shard of the input channels
        assert {tuple(w) for r in ranks for w in r["windows"].values()} == {(0, f // 2), (f // 2, f // 2)}
    else:
        assert {tuple(w) for r in ranks for w in r["windows"].values()} == {(0, f)}
