"""What ``prune_clusters`` refuses up front and what it accepts as the callback does (issues 14 and 23).

* a target below 1 that would drop every unit of a cluster (1-unit cluster, ``multiple_of``, a shared budget) is
  refused before anything changes (the one-KV-head (MQA) case of every family is in tests/unit/presets/test_presets.py;
  the callback's cases in tests/integration/test_bad_input.py);
* preset names, ``"auto"`` and a ``Discovery`` are accepted where clusters are expected, meaning what the callback
  means; a size target the depth cannot reach is refused with the largest reachable count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, prune_clusters
from lightning_pat.core.spec import resolve_clusters
from tests.common.tiny_mlp import H, snapshot, tiny_mlp, unchanged


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
    net = tiny_mlp()
    before = snapshot(net)
    if match is None:
        res = prune_clusters(net, cluster, sparsity)
        assert 0 < len(res.dropped["h"]) < 8
        return
    with pytest.raises(ValueError, match=match) as err:
        prune_clusters(net, cluster, sparsity)
    assert "'h'" in str(err.value)
    assert "Nothing was pruned" in str(err.value)
    assert unchanged(net, before)


def test_target_1_and_0_are_not_refused():
    net = tiny_mlp()
    one = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=1)
    assert prune_clusters(net, one, 0.0).dropped["h"] == []
    assert prune_clusters(net, one, 1.0).dropped["h"] == [0]  # explicit: everything
    # a per-cluster target 0 excludes the 1-unit cluster while the others are pruned
    two = [
        Cluster("one", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=1, target=0.0),
        Cluster("out", writers=["2.weight", "2.bias"]),
    ]
    res = prune_clusters(tiny_mlp(), two, 0.5)
    assert res.dropped["one"] == []
    assert len(res.dropped["out"]) == 2


def test_shared_budget_is_checked_on_its_total_and_each_multiple_of():
    from lightning_pat.pruning.plan import check_not_emptied

    params = dict(tiny_mlp().named_parameters())
    a = Cluster("a", writers=["0.weight", "0.bias"], readers=["2.weight"], budget="b")
    c = Cluster("c", writers=["2.weight", "2.bias"], budget="b", multiple_of=4)  # 3 units, multiple_of 4
    check_not_emptied(resolve_clusters(params, [a]), 0.5)  # a budget of one 8-unit cluster keeps 4
    with pytest.raises(ValueError, match=r"'c' \(target 0.5: `multiple_of=4` is larger than its 3 unit"):
        check_not_emptied(resolve_clusters(params, [a, c]), 0.5)
    tiny = Cluster("t", writers=["2.weight", "2.bias"], budget="b", num_units=1)
    with pytest.raises(ValueError, match=r"budget 'b' \(target 0.5: ceil\(0.5 \* 1\) = 1 of its 1 unit"):
        check_not_emptied(resolve_clusters(params, [tiny]), 0.5)


# ---------------------------------------------------------------------------------------------------- preset names
def test_prune_clusters_accepts_a_preset_name_like_the_callback():
    net = tiny_mlp()
    ref = tiny_mlp()
    res = prune_clusters(net, "linear_chain", 0.5)
    by_hand = prune_clusters(ref, H, 0.5)
    assert list(res.dropped.values()) == list(by_hand.dropped.values())
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values(), strict=True))
    mixed = prune_clusters(tiny_mlp(), ["linear_chain"], 0.5)
    assert list(mixed.dropped.values()) == list(by_hand.dropped.values())
    with pytest.raises(ValueError, match=r"Unknown preset 'lama'"):
        prune_clusters(tiny_mlp(), "lama", 0.5)


# ---------------------------------------------------------------------------------------------------- issue 23
def test_target_layers_with_a_size_depth_cannot_reach_is_refused_with_the_largest_reachable_count():
    """Audit A7: 2 of 4 layers at full width hold 139,584 parameters; 0.9 of the model cannot be reached there."""
    from lightning_pat.demo import TinyGPT, TinyGPTConfig
    from lightning_pat.demo import preset as demo_preset

    net = TinyGPT(TinyGPTConfig(n_layer=4))
    before = snapshot(net)
    for side in ("below", "above"):
        match = r"`target_layers=2` keeps at most 139,584 parameters .*target 236,448"
        with pytest.raises(ValueError, match=match) as e:
            prune_clusters(net, demo_preset.tiny_gpt(net, layers=True), target_params=0.9, target_layers=2,
                           target_side=side)  # fmt: skip
        assert "Ask for at most 139,584 or keep more layers" in str(e.value)
    assert unchanged(net, before)
    reachable = prune_clusters(net, demo_preset.tiny_gpt(net, layers=True), target_params=139_584, target_layers=2)
    assert reachable.size.achieved == 139_584


def test_target_sparsity_with_a_size_target_warns_the_same_way_in_the_callback_and_prune_clusters():
    """Audit C6: one behaviour: the size target sets the widths, and an explicit target_sparsity is named as unused."""
    from lightning_pat.pruning.options import PruningOptions

    with pytest.warns(UserWarning, match=r"`target_sparsity=0.3` is unused: `target_params` sets the widths"):
        PruningOptions([H], target_sparsity=0.3, target_params=0.5)
    with pytest.warns(UserWarning, match=r"`sparsity=0.3` is unused: `target_params` sets the widths"):
        res = prune_clusters(tiny_mlp(), H, 0.3, target_params=0.8)
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

    net = tiny_mlp()  # a preset fits (linear_chain): the same clusters as the preset
    assert prune_clusters(tiny_mlp(), "auto", 0.5).dropped == prune_clusters(net, "linear_chain", 0.5).dropped

    class Branchy(nn.Module):  # no preset fits: the callback would trace it
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.out(torch.relu(self.a(x)) * torch.relu(self.b(x)))

    model = Branchy()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"clusters='auto'.*no preset fits Branchy.*discover\(model, example_input\)"):
        prune_clusters(model, "auto", 0.5)
    assert unchanged(model, before)
    model.example_input_array = torch.randn(3, 4)  # what the callback traces
    traced = prune_clusters(model, "auto", 0.5)
    found = discover(Branchy(), torch.randn(3, 4))
    assert sorted(traced.dropped) == sorted(c.name for c in found.clusters)


def test_a_discovery_is_accepted_where_clusters_are_expected():
    """Audit: ``prune_clusters(m, discover(m, x), 0.5)`` was ``TypeError: 'Discovery' object is not iterable``."""
    from lightning_pat import CoupledPruningCallback, discover
    from lightning_pat.scoring.activation import calibrate

    x = torch.randn(3, 4)
    net, ref = tiny_mlp(), tiny_mlp()
    found = discover(net, x)
    res = prune_clusters(net, found, 0.5)
    assert res.dropped == prune_clusters(ref, found.clusters, 0.5).dropped
    stats = calibrate(tiny_mlp(), found, [x])
    assert set(stats.unit_scores(dict(tiny_mlp().named_parameters()))) == set(res.dropped)
    cb = CoupledPruningCallback(found, 0.5)
    assert [c.name for c in cb.options.clusters] == [c.name for c in found.clusters]
