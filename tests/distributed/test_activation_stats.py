"""``score="activation"`` under DDP-style plain parameters on 2 gloo ranks: every rank sees other batches, the
statistics are summed over ranks by one collective (``reduce.sum_over_ranks``), and every rank then holds the
same averaged statistics and selects the same units. The averages are checked against an independent float64
computation from every rank's inputs, the collectives are counted by the recorder.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.common.dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank (DDP)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 6, generator=g) * (1 + 3 * rank) for _ in range(3)]


def _worker(rank: int, world_size: int) -> dict:
    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.parallel.comm import reduce
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.activation import ActivationStats
    from tests.distributed.workers.recorder import Recorder

    model = _model()
    cluster = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
    stats = ActivationStats(model, resolve_clusters(model, cluster), beta=0.5)
    stats.attach()
    for x in _inputs(rank):
        model(x)
    stats.detach()
    params = dict(model.named_parameters())
    local = stats.unit_scores(params)["h"]
    with Recorder() as rec:
        summed = reduce.sum_over_ranks(stats.stacked(), group=dist.group.WORLD)
    scores = stats.unit_scores(params, summed=summed)
    pruner = Pruner(model, make_plan(model, cluster, score="activation"))
    with torch.no_grad():
        result = pruner.step({"h": 0.5}, scores=scores)
    return {
        "calls": [(c.name, c.dtype) for c in rec.calls],
        "average": stats.averages(summed)["2"].tolist(),  # plain floats: exact for float64, and picklable
        "scores": scores["h"].tolist(),
        "local": local.tolist(),
        "dropped": result.dropped["h"],
    }


def _reference() -> torch.Tensor:
    """Mean over ranks of each rank's exponential average (0.5) of the per-channel mean of x^2 (float64)."""
    model = _model()
    per_rank = []
    for rank in range(2):
        ema = None
        for x in _inputs(rank):
            with torch.no_grad():
                h = torch.relu(model[0](x)).double()
            m = (h * h).mean(dim=0)
            ema = m if ema is None else 0.5 * ema + 0.5 * m
        per_rank.append(ema)
    return (per_rank[0] + per_rank[1]) / 2


def test_two_ranks_average_their_statistics_and_select_identically():
    r0, r1 = run_distributed(_worker, 2, timeout=100)
    assert r0["local"] != r1["local"]  # the ranks' own statistics differ (other batches)
    assert r0["average"] == r1["average"]  # bitwise the same after the sum over ranks
    assert r0["scores"] == r1["scores"]
    assert r0["dropped"] == r1["dropped"]
    assert len(r0["dropped"]) == 8
    average = torch.tensor(r0["average"], dtype=torch.float64)
    torch.testing.assert_close(average, _reference(), rtol=1e-6, atol=0)  # squares summed in float32
    w = _model()[2].weight.detach().double()
    want = (_reference() * (w * w).sum(dim=0)).sqrt()
    torch.testing.assert_close(torch.tensor(r0["scores"], dtype=torch.float64), want, rtol=1e-6, atol=0)
    assert len(r0["calls"]) == 1  # one collective per selection
    assert r0["calls"][0][1] == "torch.float64"
