"""``training/collectors.py``: the run's scorers as one set; each verb reaches exactly the scorers it concerns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.pruning.plan import make_plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.taylor import TaylorScores
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.errors import ConfigurationError, prefixed

CLUSTER = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def _scorers(mlp: nn.Module, pruner: Pruner) -> Collectors:
    scorers = Collectors()
    scorers.act = ActivationStats(mlp, pruner.plan.clusters)
    scorers.taylor = TaylorScores(pruner.executors)
    return scorers


def test_the_verbs_reach_the_hooked_scorers_and_the_state_round_trips():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pruner = Pruner(mlp, make_plan(mlp, CLUSTER))
    scorers = _scorers(mlp, pruner)
    assert scorers.evidence is scorers.act
    scorers.attach()
    assert scorers.act.attached  # the Taylor sums have no hooks
    mlp.eval()
    scorers.batch_open(True)  # an open batch counts an eval-mode training forward
    mlp(torch.randn(3, 4)).sum().backward()
    scorers.batch_open(False)
    assert not scorers.act.in_batch
    scorers.taylor.observe()
    scorers.taylor.commit()
    states = scorers.state_dicts(gather=False)  # one process: world 1
    assert states["activation"][0]["count"] == {"2": 1}
    assert states["taylor"][0]["steps"] == 1
    assert states["layer_scores"] is None
    assert scorers.state_dicts()["taylor"][0]["steps"] == 1  # plain parameters: the sums once

    fresh = _scorers(mlp, pruner)
    fresh.load(states, errors=prefixed)
    assert fresh.act.state_dict()["count"] == {"2": 1}
    torch.testing.assert_close(fresh.taylor.sums["h"], scorers.taylor.sums["h"])
    assert fresh.saved_shapes() == {"readers": {"2": 8}, "layers": None}

    scorers.detach()
    assert not scorers.act.attached
    scorers.reset()
    assert scorers.act.state_dict()["count"] == {}
    assert scorers.taylor.steps == 0


def test_load_prefixes_the_taylor_errors_with_the_callers_wrapper():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pruner = Pruner(mlp, make_plan(mlp, CLUSTER))
    scorers = Collectors()
    scorers.taylor = TaylorScores(pruner.executors)
    bad = {"taylor": [{"steps": 1, "sums": {"h": torch.zeros(3, dtype=torch.float64)}}]}
    with pytest.raises(ConfigurationError, match=r"^CoupledPruningCallback: The saved score='taylor' sums of cluster"):
        scorers.load(bad, errors=prefixed)
