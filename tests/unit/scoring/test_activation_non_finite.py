"""Non-finite input batches never reach the activation statistics: skipped, counted, warned, and named as statistics."""

from __future__ import annotations

import pytest
import torch

from lightning_pat import prune_clusters
from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import resolve_clusters
from tests.common.tiny_mlp import H, snapshot, tiny_mlp, unchanged


@pytest.mark.parametrize("poison", ["nan", "overflow"], ids=["nan-batch", "1e20-batch"])
def test_a_non_finite_batch_is_skipped_counted_and_warned_not_folded_into_the_statistics(poison):
    from lightning_pat.scoring.activation import calibrate

    torch.manual_seed(0)
    good = [torch.randn(16, 4) for _ in range(3)]
    bad = torch.full((16, 4), float("nan")) if poison == "nan" else torch.full((16, 4), 1e20)
    clean = calibrate(tiny_mlp(), H, good)
    with pytest.warns(PruningWarning, match=r"skipped non-finite input batches of reader modules \{'2': 1\}"):
        dirty = calibrate(tiny_mlp(), H, [good[0], bad, good[1], good[2]])
    assert dirty.skipped == {"2": 1}
    params = dict(tiny_mlp().named_parameters())
    # the statistics are exactly those of the finite batches (plain mean over the 3 good ones)
    assert torch.equal(dirty.averages()["2"], clean.averages()["2"])
    scores = dirty.unit_scores(params)["h"]
    assert bool(torch.isfinite(scores).all())
    net = tiny_mlp()
    res = prune_clusters(net, H, 0.5, score="activation", activations=dirty)
    ref = prune_clusters(tiny_mlp(), H, 0.5, score="activation", activations=clean)
    assert res.dropped == ref.dropped


def test_non_finite_statistics_are_named_as_statistics_not_weights():
    from lightning_pat.scoring.activation import calibrate

    stats = calibrate(tiny_mlp(), H, [torch.randn(8, 4)])
    state = stats.state_dict()
    state["ema"]["2"][3] = float("inf")  # e.g. a checkpoint written before this fix
    stats.load_state_dict(state)
    net = tiny_mlp()
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"Cluster 'h': the score='activation' statistics of reader '2.weight'"):
        prune_clusters(net, H, 0.5, score="activation", activations=stats)
    assert unchanged(net, before)


def test_training_average_skips_a_non_finite_batch_and_a_module_seeing_only_those_counts_as_unseen():
    from lightning_pat.scoring.activation import ActivationStats

    net = tiny_mlp()
    resolved = resolve_clusters(net, [H])
    a, b = torch.randn(16, 8), torch.randn(16, 8)
    clean, dirty, only_bad = (ActivationStats(net, resolved, beta=0.9) for _ in range(3))
    for x in (a, b):
        clean.observe("2", x)
    for x in (a, torch.full((16, 8), float("nan")), b):
        dirty.observe("2", x)
    assert torch.equal(dirty.stacked(), clean.stacked())  # the EMA of a and b, "seen"
    only_bad.observe("2", torch.full((16, 8), 1e20))
    assert only_bad.skipped == {"2": 1}
    assert not bool(only_bad.stacked().any())  # no average and not seen: summed over ranks, the others decide
    with (
        pytest.warns(PruningWarning, match=r"skipped non-finite input batches of reader modules \{'2': 1\}"),
        pytest.raises(ValueError, match=r"with finite inputs has reached it yet \(1 non-finite batch\(es\) skipped"),
    ):  # warned where the scores are read, then refused: no finite batch reached the module
        only_bad.unit_scores(dict(net.named_parameters()))
    state = dirty.state_dict()
    assert state["count"] == {"2": 2}
    again = ActivationStats(net, resolved, beta=0.9)
    again.load_state_dict(state)
    assert torch.equal(again.stacked(), clean.stacked())
