"""``score="taylor"`` on every strategy: DDP (plain replicas), FSDP2, tensor parallel and both on gloo ranks.

Data-parallel ranks each train on half of every batch (a mean loss, so the strategy's gradient average equals the
whole batch's gradient); the per-unit sums of ``|w * g|`` over the steps, and the units selected from them, must
equal one process training on the whole batches (within float64 rounding; the same units). The per-step work
reads the local pieces of weights and gradients without any collective; the selection is still one packed
collective per shard group (the sums ride with the weight partials) and nothing is gathered; with plain DDP
replicas, whose gradients are already identical, the selection needs no collective at all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.common.dist import run_distributed
from tests.distributed.test_activation_sharded import ROWS, _batches, _clusters, _Net, sharded

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

TARGETS = {"mlp.0": 0.5, "mlp.1": 0.5}


def _steps(model: nn.Module, opt: torch.optim.Optimizer, taylor, batches: list[torch.Tensor], recorder=None):  # noqa: ANN001, ANN201
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        if recorder is not None:
            with recorder:
                taylor.observe()
        else:
            taylor.observe()
        taylor.commit()
        opt.step()


def _single(d: int, f: int) -> dict:
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.taylor import TaylorScores

    model = _Net(d, f)
    pruner = Pruner(model, make_plan(model, _clusters(), score="taylor"))
    taylor = TaylorScores(pruner.executors)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = {name: torch.zeros(f, dtype=torch.float64) for name in TARGETS}
    for x in _batches(d):  # the independent reference, from the gradients the optimizer applies
        opt.zero_grad()
        model(x).square().mean().backward()
        taylor.observe()
        taylor.commit()
        for i, block in enumerate(model.blocks):
            up_w, up_b, down = block.up.weight, block.up.bias, block.down.weight
            ref[f"mlp.{i}"] += (
                (up_w.detach() * up_w.grad).abs().sum(dim=1)
                + (up_b.detach() * up_b.grad).abs()
                + (down.detach() * down.grad).abs().sum(dim=0)
            )
        opt.step()
    sums = {k: v.clone() for k, v in taylor.sums.items()}
    with torch.no_grad():
        result = pruner.step(TARGETS, evidence=taylor)
    for name in TARGETS:
        torch.testing.assert_close(sums[name], ref[name], rtol=1e-13, atol=0)
    return {"sums": {k: v.tolist() for k, v in sums.items()}, "dropped": result.dropped}


def _worker(rank: int, world: int, kind: str, d: int, f: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.taylor import TaylorScores
    from tests.distributed.workers.recorder import Recorder

    model = _Net(d, f)
    if kind == "ddp":
        dp_rank, dp_size = rank, world
        wrapped = DistributedDataParallel(model)
    else:
        dp_rank, dp_size = sharded(model, kind, rank, world)
        wrapped = model
    pruner = Pruner(model, make_plan(model, _clusters(), score="taylor"))
    taylor = TaylorScores(pruner.executors)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = ROWS // dp_size
    per_step = Recorder()
    _steps(wrapped, opt, taylor, [x[dp_rank * half : (dp_rank + 1) * half] for x in _batches(d)], recorder=per_step)
    reduced = pruner.executors[0].reduce(shard_riders=taylor.shard_riders())
    with torch.no_grad(), Recorder() as rec:
        result = pruner.step(TARGETS, evidence=taylor)
    return {
        "per_step": per_step.summary(),
        "summary": rec.summary(),
        "sums": {k: v.tolist() for k, v in taylor.finish(reduced).items()},
        "dropped": result.dropped,
        "routes": {k: v[0] for k, v in pruner.routes.items()},
        "state": taylor.state_dict()["steps"],
    }


@pytest.mark.parametrize(
    ("kind", "world", "d", "f"), [("ddp", 2, 6, 8), ("fsdp2", 2, 7, 9), ("tp", 2, 6, 8), ("2d", 4, 6, 8)]
)
def test_half_batches_give_the_sums_and_units_of_one_process(kind, world, d, f):
    single = _single(d, f)
    ranks = run_distributed(_worker, world, kind, d, f, timeout=200)
    for rank, got in enumerate(ranks):
        where = (kind, rank)
        assert set(got["routes"].values()) == {"materializing" if kind == "ddp" else "sharded"}, where
        assert got["dropped"] == single["dropped"], where
        assert got["sums"] == ranks[0]["sums"], where  # bitwise identical on every rank
        for name, want in single["sums"].items():
            torch.testing.assert_close(torch.tensor(got["sums"][name]), torch.tensor(want), rtol=1e-12, atol=0)
        assert got["per_step"]["calls"] == [], where  # the per-step work communicates nothing
        assert sum(got["per_step"]["comm_counts"].values()) == 0, where
        calls = got["summary"]["calls"]
        if kind == "ddp":
            assert calls == [], where  # identical gradients on every replica: nothing to sum
        else:
            assert len(calls) == 1, (where, calls)  # the selection's one packed gather, the sums riding along
            assert calls[0][0] in ("all_gather_single", "all_gather_into_tensor"), where
        assert got["summary"]["materialized"] == [], where
