"""``scoring/collector.py``: every scorer owns its state entry, its checks and its rank's part of a saved list.

The three scorers are driven through the :class:`Collector` verbs only; their checks are the schema's former
messages, word for word (the state's name first, then the field), with and without a scorer to check against.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.core.spec import resolve_clusters
from lightning_pat.core.state_fields import StateError
from lightning_pat.pruning.plan import make_plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats
from lightning_pat.scoring.collector import Collector
from lightning_pat.scoring.layers import LayerStats
from lightning_pat.scoring.taylor import TaylorScores

CLUSTER = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
WHAT = "the state"


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def layer_stats() -> LayerStats:
    net = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    decl = Cluster("layer.{i}", writers=[r"re:(?P<i>[ab])\.weight"], num_units=1, budget="layers")
    return LayerStats(net, resolve_clusters(net, [decl]))


def test_each_scorer_is_a_collector_with_its_own_entry():
    net = mlp()
    pruner = Pruner(net, make_plan(net, CLUSTER))
    act, taylor = ActivationStats(net, pruner.plan.clusters), TaylorScores(pruner.executors)
    assert [type(c).key for c in (act, taylor, layer_stats())] == ["activation", "taylor", "layer_scores"]
    assert all(isinstance(c, Collector) for c in (act, taylor))
    assert act.as_evidence() is act
    assert taylor.as_evidence() is taylor
    assert layer_stats().as_evidence() is None
    assert act.per_rank
    assert not taylor.per_rank  # plain parameters: the same sums on every rank, saved once


def test_the_batch_window_counts_eval_forwards_and_keeps_only_stepped_taylor_terms():
    net = mlp().eval()
    pruner = Pruner(net, make_plan(net, CLUSTER))
    act, taylor = ActivationStats(net, pruner.plan.clusters), TaylorScores(pruner.executors)
    act.attach()
    for collector in (act, taylor):
        collector.begin_batch()
    net(torch.randn(3, 4)).sum().backward()
    taylor.observe()
    for collector in (act, taylor):
        collector.end_batch(stepped=False)  # an AMP-skipped step: its gradient term is dropped
    assert act.state_dict()["count"] == {"2": 1}
    assert not act.in_batch
    assert taylor.steps == 0
    taylor.observe()
    taylor.end_batch(stepped=True)
    assert taylor.steps == 1
    net(torch.randn(3, 4))  # eval mode, no batch open: not counted
    assert act.state_dict()["count"] == {"2": 1}
    act.detach()


def test_saved_entries_are_a_rank_list_or_this_ranks_own_and_load_back_exactly():
    net = mlp()
    stats = ActivationStats(net, resolve_clusters(net, CLUSTER))
    stats.observe("2", torch.randn(5, 8))
    local = stats.saved_entry(gather=False)
    assert isinstance(local, dict)  # this rank's own: no per-rank list faked
    assert local["count"] == {"2": 1}
    saved = stats.saved_entry()  # one process: a list of one
    assert isinstance(saved, list)
    assert len(saved) == 1
    for entry in (local, saved):
        again = ActivationStats(net, resolve_clusters(net, CLUSTER))
        again.load_saved(entry)
        assert torch.equal(again.averages()["2"], stats.averages()["2"])
    again.load_saved(None)  # nothing saved: empty
    assert again.state_dict()["count"] == {}


def test_activation_rank_entry_refuses_tensor_parallel_statistics_on_another_world_size():
    """Statistics split over input channels (a window after channel 0 exists) cannot move to another world size;
    statistics that cover every channel (DDP, FSDP2) can (each rank resumes some rank's statistics)."""
    net = mlp()
    stats = ActivationStats(net, resolve_clusters(net, CLUSTER))
    assert stats.rank_entry(None, rank=0, world=1) == {}
    assert stats.rank_entry([{"r": 0}, {"r": 1}], rank=0, world=1) == {"r": 0}
    assert stats.rank_entry([{"r": 7}], rank=1, world=2) == {"r": 7}
    ema = torch.ones(4, dtype=torch.float64)
    split = [
        {"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [0, 4]}},
        {"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [4, 4]}},
    ]
    with pytest.raises(ValueError, match=r"^score='activation': the checkpoint holds the statistics of 2 rank\(s\) "):
        stats.rank_entry(split, rank=0, world=1)
    whole = [{"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [0, 4]}} for _ in range(2)]
    assert stats.rank_entry(whole, rank=0, world=1) is whole[0]


# ---------------------------------------------------------------------------------------------------- the checks
def test_layout_checks_need_no_scorer():
    LayerStats.check_layout([{"sum": {"l.0": 0.5}, "count": {"l.0": 2.0}}], WHAT)
    LayerStats.check_layout(None, WHAT)  # nothing saved
    cases = [
        (LayerStats, [{"sum": {}, "count": {"l.0": float("inf")}}], r"`layer_scores\[0\].count\['l.0'\]` must be fin"),
        (TaylorScores, [{"steps": 1, "sums": {"x": -torch.ones(2)}}], r"`taylor\[0\].sums\['x'\]` holds negative"),
        (TaylorScores, [{"steps": -1}], r"`taylor\[0\].steps` must be >= 0, got -1"),
        (ActivationStats, {"ema": {}}, r"`activation` must be a list, got dict"),
        (ActivationStats, [{"ema": {}, "beta": 2.0}], r"`activation\[0\].beta` must be in \[0.0, 1.0\], got 2.0"),
        (ActivationStats, [{"ema": {}, "extra": 1}], r"`activation\[0\]` has unknown entries \['extra'\]"),
        (ActivationStats, [{"ema": {"2": torch.ones(2, 2)}}], r"`activation\[0\].ema\['2'\]` must be 1-D"),
        (ActivationStats, ["x"], r"`activation\[0\]` must be a mapping with str keys, got str 'x'"),
    ]  # fmt: skip
    for kind, raw, match in cases:
        with pytest.raises(StateError, match=f"^the state: {match}"):
            kind.check_layout(raw, WHAT)


def test_checks_against_the_scorer_name_what_it_does_not_hold():
    stats = layer_stats()
    stats.check_saved([{"sum": {"a": 0.5}, "count": {"b": 1.0}}], WHAT)
    with pytest.raises(StateError, match=r"`layer_scores\[0\].sum` names layers \['l.9'\] that this run"):
        stats.check_saved([{"sum": {"l.9": 0.5}, "count": {}}], WHAT)

    net = mlp()
    pruner = Pruner(net, make_plan(net, CLUSTER, score="taylor"))
    taylor = TaylorScores(pruner.executors)
    taylor.check_saved([{"steps": 1, "sums": {"h": torch.ones(8)}}], WHAT)
    TaylorScores.check_layout([{"steps": 1, "sums": {"h": torch.ones(3)}}], WHAT)  # no sizes without a scorer
    with pytest.raises(StateError, match=r"`taylor\[0\].sums\['h'\]` must have shape \(8,\), got \(3,\)"):
        taylor.check_saved([{"steps": 1, "sums": {"h": torch.ones(3)}}], WHAT)
    with pytest.raises(StateError, match=r"`taylor\[0\].sums` names clusters \['x'\]"):
        taylor.check_saved([{"steps": 1, "sums": {"x": torch.ones(8)}}], WHAT)

    act = ActivationStats(net, pruner.plan.clusters)
    act.check_saved([{"ema": {"2": torch.ones(4)}, "count": {"2": 1}, "window": {"2": [4, 4]}}], WHAT)
    with pytest.raises(StateError, match=r"`activation\[0\].ema` names reader modules \['9'\]"):
        act.check_saved([{"ema": {"9": torch.ones(8)}}], WHAT)
    with pytest.raises(StateError, match=r"`activation\[0\].ema\['2'\]` has 8 channels for a window of 8 from channel 4"
                                         r" of the module's 8 input channels"):  # fmt: skip
        act.check_saved([{"ema": {"2": torch.ones(8)}, "window": {"2": [4, 8]}}], WHAT)
