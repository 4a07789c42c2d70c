"""Plan.for_size reads a size-target group once and solves what Plan.sized solves from the same options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.pruning.options import SizeTarget
from lightning_pat.pruning.plan import make_plan, named_tensors

DECLS = [
    Cluster("h1", writers=["0.weight", "0.bias"], readers=["2.weight"]),
    Cluster("h2", writers=["2.weight", "2.bias"], readers=["4.weight"]),
]


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


@pytest.mark.parametrize(
    "target",
    [SizeTarget(target_params=0.5), SizeTarget(target_params=200, target_side="above"),
     SizeTarget(target_flops=0.6, seq_len=4)],
)  # fmt: skip
def test_for_size_solves_what_sized_solves_from_the_same_options(target):
    model = chain()
    params = named_tensors(model)
    plan = make_plan(model, DECLS)
    got, size = plan.for_size(params, target, declarations=DECLS, model=model)
    flops = None if target.target_flops is None else (model, target.seq_len)
    want, reference = plan.sized(params, target.value, side=target.target_side, declarations=DECLS, flops=flops)
    assert [rc.target for rc in got.clusters] == [rc.target for rc in want.clusters]
    assert size == reference
    assert all(rc.target is not None and 0 < rc.target < 1 for rc in got.clusters)
