"""``training/collectors.py``: the run's scorers as one list; each verb reaches every scorer through its protocol."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.core.state_fields import FieldChecker, StateError
from lightning_pat.pruning.plan import make_plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.collector import Collector
from lightning_pat.scoring.taylor import TaylorScores
from lightning_pat.training import collectors
from lightning_pat.training.collectors import Collectors
from lightning_pat.training.errors import ConfigurationError, prefixed

CLUSTER = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def _scorers(mlp: nn.Module, pruner: Pruner) -> Collectors:
    return Collectors(TaylorScores(pruner.executors), None, ActivationStats(mlp, pruner.plan.clusters))


def test_the_verbs_reach_the_hooked_scorers_and_the_state_round_trips():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pruner = Pruner(mlp, make_plan(mlp, CLUSTER))
    scorers = _scorers(mlp, pruner)
    assert [type(c) for c in scorers] == [ActivationStats, TaylorScores]  # the registered order, not the given one
    assert scorers.evidence is scorers.act
    scorers.attach()
    assert scorers.act.attached  # the Taylor sums have no hooks
    mlp.eval()
    scorers.batch_open(True)  # an open batch counts an eval-mode training forward
    mlp(torch.randn(3, 4)).sum().backward()
    scorers.taylor.observe()
    scorers.end_batch(stepped=True)  # a real step: the Taylor term is kept
    assert not scorers.act.in_batch
    local = scorers.state_dicts(gather=False)  # this rank's own: a mapping per scorer, no per-rank list
    assert local["activation"]["count"] == {"2": 1}
    assert local["taylor"]["steps"] == 1
    assert local["layer_scores"] is None
    saved = scorers.state_dicts()  # one process: the ranks' list has one entry
    assert saved["activation"][0]["count"] == {"2": 1}
    assert saved["taylor"][0]["steps"] == 1  # plain parameters: the sums once

    for states in (local, saved):
        fresh = _scorers(mlp, pruner)
        fresh.load(states, errors=prefixed)
        assert fresh.act.state_dict()["count"] == {"2": 1}
        torch.testing.assert_close(fresh.taylor.sums["h"], scorers.taylor.sums["h"])

    scorers.detach()
    assert not scorers.act.attached
    scorers.reset()
    assert scorers.act.state_dict()["count"] == {}
    assert scorers.taylor.steps == 0


def test_checks_hold_every_registered_entry_against_the_scorers_in_use():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pruner = Pruner(mlp, make_plan(mlp, CLUSTER))
    scorers = Collectors(ActivationStats(mlp, pruner.plan.clusters))
    checks = scorers.checks()
    assert list(checks) == ["activation", "taylor", "layer_scores", "expert_scores"]
    with pytest.raises(StateError, match=r"^s: `activation\[0\].ema` names reader modules \['9'\]"):
        checks["activation"]([{"ema": {"9": torch.ones(8, dtype=torch.float64)}}], "s")
    checks["taylor"]([{"steps": 1, "sums": {"x": torch.ones(3)}}], "s")  # not in use: only its layout
    with pytest.raises(StateError, match=r"^s: `taylor\[0\].sums\['x'\]` holds negative values"):
        checks["taylor"]([{"steps": 1, "sums": {"x": -torch.ones(3)}}], "s")


def test_load_prefixes_the_scorers_errors_with_the_callers_wrapper():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pruner = Pruner(mlp, make_plan(mlp, CLUSTER))
    scorers = Collectors(TaylorScores(pruner.executors))
    bad = {"taylor": [{"steps": 1, "sums": {"h": torch.zeros(3, dtype=torch.float64)}}]}
    with pytest.raises(ConfigurationError, match=r"^CoupledPruningCallback: The saved score='taylor' sums of cluster"):
        scorers.load(bad, errors=prefixed)
    scorers = Collectors(ActivationStats(mlp, pruner.plan.clusters))
    bad = {"activation": [{"ema": {"2": torch.zeros(3, dtype=torch.float64)}}]}
    with pytest.raises(ConfigurationError, match=r"^CoupledPruningCallback: The saved activation statistics of '2'"):
        scorers.load(bad, errors=prefixed)


class _Norms(Collector):
    """A fourth scorer for the test: it only counts batches."""

    key: ClassVar[str] = "norms"

    def __init__(self) -> None:
        self.batches = 0

    def reset(self) -> None:
        self.batches = 0

    def end_batch(self, *, stepped: bool) -> None:
        self.batches += stepped

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: Any) -> None:
        self.batches = int(state.get("batches", 0))

    @classmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: _Norms | None) -> None:
        for r, item in enumerate(check.sequence(raw, cls.key)):
            check.integer(check.mapping(item, f"norms[{r}]").get("batches"), f"norms[{r}].batches")


def test_a_fourth_scorer_needs_only_its_registration(monkeypatch):
    with pytest.raises(TypeError, match=r"_Norms is not a registered collector kind"):
        Collectors(_Norms())
    monkeypatch.setattr(collectors, "KINDS", (*collectors.KINDS, _Norms))
    scorers = Collectors(_Norms())
    scorers.batch_open(True)
    scorers.end_batch(stepped=True)
    saved = scorers.state_dicts()
    assert saved == {"activation": None, "taylor": None, "layer_scores": None, "norms": [{"batches": 1}]}
    with pytest.raises(StateError, match=r"`norms\[0\].batches` must be an int"):
        scorers.checks()["norms"]([{"batches": "1"}], "s")
    fresh = Collectors(_Norms())
    fresh.load(saved, errors=prefixed)
    assert fresh.get(_Norms).batches == 1
