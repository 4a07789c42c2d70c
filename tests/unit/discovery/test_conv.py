"""Grouped and transposed convolutions: discovery against hand-written declarations, and exact shrinks (masked vs
shrunk, eval mode, fp32, rel < 1e-5) of what it found; refusals of cuts a grouped convolution cannot take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, discover, prune_clusters, resolve_clusters, shrink
from tests.common.cnn_models import INPUTS, GroupedNet, ResNeXtNet, UpNet, exact_shrink, randomize_norms


def test_resnext_block_groups_are_whole_units():
    """The grouped conv's groups couple its input (c1's rows, b1) and its output (g's rows, bg, c3's columns)."""
    torch.manual_seed(0)
    model = randomize_norms(ResNeXtNet())
    found = discover(model, torch.zeros(INPUTS[ResNeXtNet]))
    assert found.clusters == [
        Cluster(
            "stem",
            writers=["stem.weight", "bs.weight", "bs.bias", "c3.weight", "b3.weight", "b3.bias"],
            readers=["c1.weight", "head.weight"],
            num_units=16,
        ),
        Cluster(
            "c1",
            writers=["c1.weight", "b1.weight", "b1.bias", "g.weight", "bg.weight", "bg.bias"],
            readers=["c3.weight"],
            num_units=4,  # one unit per group
        ),
    ]
    [c1] = [rc for rc in resolve_clusters(model, found.clusters) if rc.name == "c1"]
    blocks = {(m.name, m.dim): m.block for m in c1.members}
    assert (blocks[("c1.weight", 0)], blocks[("b1.weight", 0)]) == (2, 2)  # a group reads 8 / 4 channels
    assert (blocks[("g.weight", 0)], blocks[("bg.weight", 0)]) == (3, 3)  # and writes 12 / 4
    assert blocks[("c3.weight", 1)] == 3
    small = exact_shrink(model, found.clusters, torch.randn(3, 3, 8, 8))
    assert (small.g.groups, small.g.in_channels, small.g.out_channels) == (2, 4, 6)
    assert tuple(small.g.weight.shape[:2]) == (6, 2)  # each group still reads 2 channels
    assert (small.c1.out_channels, small.bg.num_features, small.c3.in_channels) == (4, 6, 6)
    assert small.stem.out_channels == 8


def test_grouped_net_is_found_and_shrinks_exactly():
    torch.manual_seed(1)
    model = GroupedNet()
    found = discover(model, torch.zeros(1, 3, 4, 4))
    assert found.clusters == [
        Cluster("c1", writers=["c1.weight", "c1.bias", "g.weight", "g.bias"], readers=["c2.weight"], num_units=2)
    ]
    small = exact_shrink(model, found.clusters, torch.randn(2, 3, 6, 6))
    assert (small.g.groups, small.g.in_channels, small.g.out_channels, small.c2.in_channels) == (1, 4, 4, 4)


def test_grouped_conv_on_the_model_input_is_left_out():
    net = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.ReLU(), nn.Conv2d(8, 2, 1))
    found = discover(net, torch.zeros(1, 4, 6, 6))
    assert found.clusters == []
    reasons = {r for lo in found.left_out for r in lo.reasons}
    assert any("grouped convolution (2 groups) reads channels that are not traced" in r for r in reasons)


def test_grouped_conv_over_concatenated_parts_straddling_groups_is_left_out():
    class Straddle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 6, 1), nn.Conv2d(3, 6, 1)
            self.g, self.out = nn.Conv2d(12, 8, 3, groups=4), nn.Conv2d(8, 2, 1)  # groups of 3: two in a, two in b

        def forward(self, x):
            return self.out(self.g(torch.cat([self.a(x), self.b(x)], 1)))

    found = discover(Straddle(), torch.zeros(1, 3, 6, 6))
    assert found.clusters == [  # g's groups 0-1 read a, groups 2-3 read b: each part's units are its groups
        Cluster("a", ["a.weight", "a.bias", "g.weight[0:4]", "g.bias[0:4]"], ["out.weight[0:4]"], num_units=2),
        Cluster("b", ["b.weight", "b.bias", "g.weight[4:8]", "g.bias[4:8]"], ["out.weight[4:8]"], num_units=2),
    ]
    torch.manual_seed(3)
    small = exact_shrink(Straddle(), found.clusters, torch.randn(2, 3, 6, 6))
    assert (small.g.groups, small.g.in_channels, small.g.out_channels) == (2, 6, 4)

    class Straddle2(Straddle):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 2, 1), nn.Conv2d(3, 4, 1)
            self.g = nn.Conv2d(6, 8, 3, groups=2)  # groups of 3 over parts of 2 and 4 channels

    found = discover(Straddle2(), torch.zeros(1, 3, 6, 6))
    assert found.clusters == []
    assert any("does not hold whole groups of 3" in r for lo in found.left_out for r in lo.reasons)


def test_transposed_convs_dense_and_grouped_are_found_and_shrink_exactly():
    """A transposed conv's weight is [in, out / groups, *k]: its input channels are dim 0 (listed under writers, the
    spec's dim-0 role), its output channels dim 1 (readers) with the bias; grouped, whole groups are the units."""
    torch.manual_seed(2)
    model = randomize_norms(UpNet())
    found = discover(model, torch.zeros(INPUTS[UpNet]))
    assert found.clusters == [
        Cluster("c1", writers=["c1.weight", "c1.bias", "b1.weight", "b1.bias", "t1.weight"], num_units=8),
        Cluster("t1", writers=["t1.bias", "t2.weight", "t2.bias"], readers=["t1.weight", "out.weight"], num_units=2),
    ]
    [t1] = [rc for rc in resolve_clusters(model, found.clusters) if rc.name == "t1"]
    blocks = {(m.name, m.dim): m.block for m in t1.members}
    assert blocks == {
        ("t1.bias", 0): 3,
        ("t1.weight", 1): 3,
        ("t2.weight", 0): 3,  # a group of t2 reads 6 / 2 channels
        ("t2.bias", 0): 4,  # and writes 8 / 2
        ("out.weight", 1): 4,
    }
    small = exact_shrink(model, found.clusters, torch.randn(2, 3, 8, 8))
    assert (small.t1.in_channels, small.t1.out_channels) == (4, 3)
    assert (small.t2.groups, small.t2.in_channels, small.t2.out_channels) == (1, 3, 4)
    assert tuple(small.t2.weight.shape[:2]) == (3, 4)
    assert small.out.in_channels == 4


def test_grouped_conv_cut_inside_a_group_is_refused_before_any_change():
    model = GroupedNet()
    cluster = Cluster("g", writers=["g.weight", "g.bias"], readers=["c2.weight"])  # one unit per channel
    result = prune_clusters(model, [cluster], 0.25)
    with pytest.raises(ValueError, match=r"'g' \(Conv2d\): a grouped convolution \(groups=2\) must lose whole groups"):
        shrink(model, result)
    assert (model.g.weight.shape[0], model.g.groups) == (8, 2)


def test_grouped_conv_weight_dim1_cut_is_refused():
    model = GroupedNet()
    cluster = Cluster("in", writers=["c1.weight", "c1.bias"], readers=["g.weight"], num_units=4)
    result = prune_clusters(model, [cluster], 0.5)
    with pytest.raises(ValueError, match=r"keeps its weight's dim 1"):
        shrink(model, result)
    assert model.c1.out_channels == 8


def test_grouped_transposed_conv_rows_and_bias_must_drop_the_same_groups():
    model = UpNet()
    clusters = [
        Cluster("rows", writers=["t1.bias", "t2.weight"], readers=["t1.weight"], num_units=2),
        Cluster("bias", writers=["t2.bias"], readers=["out.weight"], num_units=2),
    ]
    with torch.no_grad():  # make the two clusters drop different groups
        model.t2.weight[:3].mul_(100)
        model.t2.bias[4:].mul_(100)
        model.out.weight[:, 4:].mul_(100)
    result = prune_clusters(model, clusters, 0.5)
    assert result.dropped == {"rows": [1], "bias": [0]}
    with pytest.raises(ValueError, match=r"grouped transposed convolution loses whole groups"):
        shrink(model, result)
    assert model.t2.groups == 2
