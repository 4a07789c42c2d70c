"""Issue 14, "never silently wrong": what used to succeed and give a wrong model is refused (or fixed) up front.

* a target below 1 that would drop every unit of a cluster (1-unit cluster, ``multiple_of``, MQA) is refused by
  ``prune_clusters`` before anything changes (the callback's cases are in tests/integration/test_bad_input.py);
* ``prune_clusters`` accepts preset names as the callback does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, prune_clusters
from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import resolve_clusters
from tests.common.tiny_families import llama_like

H = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def _mlp(width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------- empty clusters
@pytest.mark.parametrize(
    ("cluster", "sparsity", "match"),
    [
        (
            Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=1),
            0.01,
            r"ceil\(0.01 \* 1\) = 1",
        ),
        (Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], multiple_of=16), 0.1, r"`multiple_of=16`"),
        (
            Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], multiple_of=4),
            0.2,  # ceil(1.6) = 2 dropped, 6 kept -> rounded down to 4: fine; 0.6 -> 5 dropped, 3 kept -> 0
            None,
        ),
        (
            Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], multiple_of=4),
            0.6,
            r"ceil\(0.6 \* 8\) = 5 of its 8 unit\(s\) are dropped, and rounding the kept count to `multiple_of=4`",
        ),
        (Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], target=0.9), 0.1, r"target 0.9: ceil"),
    ],
)
def test_prune_clusters_refuses_a_target_below_1_that_empties_a_cluster(cluster, sparsity, match):
    net = _mlp()
    before = _snapshot(net)
    if match is None:
        res = prune_clusters(net, cluster, sparsity)
        assert 0 < len(res.dropped["h"]) < 8
        return
    with pytest.raises(ValueError, match=match) as err:
        prune_clusters(net, cluster, sparsity)
    assert "'h'" in str(err.value)
    assert "Nothing was pruned" in str(err.value)
    assert _unchanged(net, before)


def test_target_1_and_0_are_not_refused():
    net = _mlp()
    one = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=1)
    assert prune_clusters(net, one, 0.0).dropped["h"] == []
    assert prune_clusters(net, one, 1.0).dropped["h"] == [0]  # explicit: everything
    # a per-cluster target 0 excludes the 1-unit cluster while the others are pruned
    two = [
        Cluster("one", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=1, target=0.0),
        Cluster("out", writers=["2.weight", "2.bias"]),
    ]
    res = prune_clusters(_mlp(), two, 0.5)
    assert res.dropped["one"] == []
    assert len(res.dropped["out"]) == 2


def test_shared_budget_is_checked_on_its_total_and_each_multiple_of():
    from lightning_pat.pruning.plan import check_not_emptied

    params = dict(_mlp().named_parameters())
    a = Cluster("a", writers=["0.weight", "0.bias"], readers=["2.weight"], budget="b")
    c = Cluster("c", writers=["2.weight", "2.bias"], budget="b", multiple_of=4)  # 3 units, multiple_of 4
    check_not_emptied(resolve_clusters(params, [a]), 0.5)  # a budget of one 8-unit cluster keeps 4
    with pytest.raises(ValueError, match=r"'c' \(target 0.5: `multiple_of=4` is larger than its 3 unit"):
        check_not_emptied(resolve_clusters(params, [a, c]), 0.5)
    tiny = Cluster("t", writers=["2.weight", "2.bias"], budget="b", num_units=1)
    with pytest.raises(ValueError, match=r"budget 'b' \(target 0.5: ceil\(0.5 \* 1\) = 1 of its 1 unit"):
        check_not_emptied(resolve_clusters(params, [tiny]), 0.5)


def test_llama_preset_with_one_kv_head_is_refused_naming_every_layer():
    case = llama_like("llama", n_head=4, n_kv=1, n_layer=2)
    model = case.fresh()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"every unit of 2 cluster\(s\)") as err:
        prune_clusters(model, "llama", 0.25)
    msg = str(err.value)
    assert "ceil(0.25 * 1) = 1 of its 1 unit(s)" in msg
    assert "preset_options={'heads': False}" in msg
    assert _unchanged(model, before)
    # the MLP clusters alone prune fine
    from lightning_pat import presets

    res = prune_clusters(model, presets.resolve_preset("llama", model, heads=False), 0.25)
    assert res.dropped
    assert all(len(v) == 12 for v in res.dropped.values())


# ---------------------------------------------------------------------------------------------------- preset names
def test_prune_clusters_accepts_a_preset_name_like_the_callback():
    net = _mlp()
    ref = _mlp()
    res = prune_clusters(net, "linear_chain", 0.5)
    by_hand = prune_clusters(ref, H, 0.5)
    assert list(res.dropped.values()) == list(by_hand.dropped.values())
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values(), strict=True))
    mixed = prune_clusters(_mlp(), ["linear_chain"], 0.5)
    assert list(mixed.dropped.values()) == list(by_hand.dropped.values())
    with pytest.raises(ValueError, match=r"Unknown preset 'lama'"):
        prune_clusters(_mlp(), "lama", 0.5)


# ---------------------------------------------------------------------------------------------------- activation stats
@pytest.mark.parametrize("poison", ["nan", "overflow"], ids=["nan-batch", "1e20-batch"])
def test_a_non_finite_batch_is_skipped_counted_and_warned_not_folded_into_the_statistics(poison):
    from lightning_pat.scoring.activation import calibrate

    torch.manual_seed(0)
    good = [torch.randn(16, 4) for _ in range(3)]
    bad = torch.full((16, 4), float("nan")) if poison == "nan" else torch.full((16, 4), 1e20)
    clean = calibrate(_mlp(), H, good)
    with pytest.warns(PruningWarning, match=r"skipped non-finite input batches of reader modules \{'2': 1\}"):
        dirty = calibrate(_mlp(), H, [good[0], bad, good[1], good[2]])
    assert dirty.skipped == {"2": 1}
    params = dict(_mlp().named_parameters())
    # the statistics are exactly those of the finite batches (plain mean over the 3 good ones)
    assert torch.equal(dirty.averages()["2"], clean.averages()["2"])
    scores = dirty.unit_scores(params)["h"]
    assert bool(torch.isfinite(scores).all())
    net = _mlp()
    res = prune_clusters(net, H, 0.5, score="activation", activations=dirty)
    ref = prune_clusters(_mlp(), H, 0.5, score="activation", activations=clean)
    assert res.dropped == ref.dropped


def test_non_finite_statistics_are_named_as_statistics_not_weights():
    from lightning_pat.scoring.activation import calibrate

    stats = calibrate(_mlp(), H, [torch.randn(8, 4)])
    state = stats.state_dict()
    state["ema"]["2"][3] = float("inf")  # e.g. a checkpoint written before this fix
    stats.load_state_dict(state)
    net = _mlp()
    before = _snapshot(net)
    with pytest.raises(ValueError, match=r"Cluster 'h': the score='activation' statistics of reader '2.weight'"):
        prune_clusters(net, H, 0.5, score="activation", activations=stats)
    assert _unchanged(net, before)


# ---------------------------------------------------------------------------------------------------- shrink: BatchNorm
class _BNNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: the hidden axis runs through the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        with torch.no_grad():  # non-trivial affine parameters and running statistics
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
            for _ in range(3):
                self(torch.randn(16, 4) * 2 + 1)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_shrink_refuses_a_batchnorm_between_shrunk_layers_that_no_member_covers():
    from lightning_pat import shrink
    from lightning_pat.shrink import check_shrinkable

    net = _BNNet()
    cluster = Cluster("hidden", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"])
    res = prune_clusters(net, cluster, 0.5)
    before = _snapshot(net)
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm1d\) sits between 'fc1'.*8 output channels") as err:
        shrink(net, res)
    assert "`bn.weight`, `bn.bias`" in str(err.value)
    assert "running_mean" in str(err.value)
    assert _unchanged(net, before)
    assert net.fc1.out_features == 8
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm1d\) sits between"):  # shrink_on_freeze's check
        check_shrinkable(net, res.clusters)


def test_shrink_refuses_a_batchnorm2d_between_shrunk_convolutions_that_no_member_covers():
    from lightning_pat import shrink

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1),
    )
    cluster = Cluster("hidden", writers=["0.weight", "0.bias"], readers=["3.weight"])
    res = prune_clusters(net, cluster, 0.5)
    before = _snapshot(net)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm2d\) sits between '0'.*8 output channels"):
        shrink(net, res)
    assert _unchanged(net, before)
    assert net[0].out_channels == 8
    # declared, the same chain shrinks exactly
    net[1].eval()
    declared = Cluster("hidden", writers=["0.weight", "0.bias", "1.weight", "1.bias"], readers=["3.weight"])
    res = prune_clusters(net, declared, 0.5)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        masked = net(x)
        small = shrink(net, res)
        torch.testing.assert_close(small(x), masked, rtol=0, atol=1e-5)
    assert small[1].num_features == 4


def test_a_batchnorm_declared_in_the_cluster_is_shrunk_exactly_with_its_running_statistics():
    from lightning_pat import shrink

    net = _BNNet()
    cluster = Cluster("hidden", writers=["fc1.weight", "fc1.bias", "bn.weight", "bn.bias"], readers=["fc2.weight"])
    res = prune_clusters(net, cluster, 0.5)
    x = torch.randn(32, 4)
    with torch.no_grad():
        masked = net(x)
    kept = [i for i in range(8) if i not in res.dropped["hidden"]]
    mean, var = net.bn.running_mean[kept].clone(), net.bn.running_var[kept].clone()
    small = shrink(net, res)
    assert small.bn.num_features == 4
    assert small.fc1.out_features == 4
    assert small.fc2.in_features == 4
    assert torch.equal(small.bn.running_mean, mean)
    assert torch.equal(small.bn.running_var, var)
    with torch.no_grad():
        torch.testing.assert_close(small(x), masked, rtol=0, atol=1e-6)


def test_training_average_skips_a_non_finite_batch_and_a_module_seeing_only_those_counts_as_unseen():
    from lightning_pat.scoring.activation import ActivationStats

    net = _mlp()
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


# ---------------------------------------------------------------------------------------------------- issue 23
def test_target_layers_with_a_size_depth_cannot_reach_is_refused_with_the_largest_reachable_count():
    """Audit A7: 2 of 4 layers at full width hold 139,584 parameters; 0.9 of the model cannot be reached there."""
    from lightning_pat.demo import TinyGPT, TinyGPTConfig
    from lightning_pat.demo import preset as demo_preset

    net = TinyGPT(TinyGPTConfig(n_layer=4))
    before = _snapshot(net)
    for side in ("below", "above"):
        match = r"`target_layers=2` keeps at most 139,584 parameters .*target 236,448"
        with pytest.raises(ValueError, match=match) as e:
            prune_clusters(net, demo_preset.tiny_gpt(net, layers=True), target_params=0.9, target_layers=2,
                           target_side=side)  # fmt: skip
        assert "Ask for at most 139,584 or keep more layers" in str(e.value)
    assert _unchanged(net, before)
    reachable = prune_clusters(net, demo_preset.tiny_gpt(net, layers=True), target_params=139_584, target_layers=2)
    assert reachable.size.achieved == 139_584


def test_target_sparsity_with_a_size_target_warns_the_same_way_in_the_callback_and_prune_clusters():
    """Audit C6: one behaviour: the size target sets the widths, and an explicit target_sparsity is named as unused."""
    from lightning_pat.pruning.options import PruningOptions

    with pytest.warns(UserWarning, match=r"`target_sparsity=0.3` is unused: `target_params` sets the widths"):
        PruningOptions([H], target_sparsity=0.3, target_params=0.5)
    with pytest.warns(UserWarning, match=r"`sparsity=0.3` is unused: `target_params` sets the widths"):
        res = prune_clusters(_mlp(), H, 0.3, target_params=0.8)
    assert res.size is not None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = PruningOptions([H], target_params=0.5)  # no target_sparsity given: nothing to warn about
    assert opts.target_sparsity == 0.5  # the documented default when no size target is given
    assert PruningOptions([H]).target_sparsity == 0.5


def test_prune_clusters_auto_means_what_the_callbacks_auto_means():
    """Audit C11: "auto" detects a preset, else traces (the module's example_input_array), else points at discover."""
    from lightning_pat import discover

    net = _mlp()  # a preset fits (linear_chain): the same clusters as the preset
    assert prune_clusters(_mlp(), "auto", 0.5).dropped == prune_clusters(net, "linear_chain", 0.5).dropped

    class Branchy(nn.Module):  # no preset fits: the callback would trace it
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.out(torch.relu(self.a(x)) * torch.relu(self.b(x)))

    model = Branchy()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"clusters='auto'.*no preset fits Branchy.*discover\(model, example_input\)"):
        prune_clusters(model, "auto", 0.5)
    assert _unchanged(model, before)
    model.example_input_array = torch.randn(3, 4)  # what the callback traces
    traced = prune_clusters(model, "auto", 0.5)
    found = discover(Branchy(), torch.randn(3, 4))
    assert sorted(traced.dropped) == sorted(c.name for c in found.clusters)


def test_a_discovery_is_accepted_where_clusters_are_expected():
    """Audit: ``prune_clusters(m, discover(m, x), 0.5)`` was ``TypeError: 'Discovery' object is not iterable``."""
    from lightning_pat import CoupledPruningCallback, discover
    from lightning_pat.scoring.activation import calibrate

    x = torch.randn(3, 4)
    net, ref = _mlp(), _mlp()
    found = discover(net, x)
    res = prune_clusters(net, found, 0.5)
    assert res.dropped == prune_clusters(ref, found.clusters, 0.5).dropped
    stats = calibrate(_mlp(), found, [x])
    assert set(stats.unit_scores(dict(_mlp().named_parameters()))) == set(res.dropped)
    cb = CoupledPruningCallback(found, 0.5)
    assert [c.name for c in cb.options.clusters] == [c.name for c in found.clusters]
