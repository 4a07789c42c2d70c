"""Shrink of convolutional models with hand-declared clusters: Conv (dense, depthwise), BatchNorm, GroupNorm,
flatten -> Linear (grouped and transposed convolutions: tests/unit/discovery/test_conv.py). The reference is the masked
full-size model (eval mode, fp32): the shrunk model must compute the same outputs (rel < 1e-5) with fewer
parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import Cluster, prune_clusters, shrink
from tests.common.cnn_models import ConvChain, DepthwiseNet, masked_vs_shrunk, randomize_norms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_conv_bn_chain_and_flatten_linear_are_exact():
    torch.manual_seed(0)
    model = randomize_norms(ConvChain())
    clusters = [
        Cluster("c1", writers=["c1.weight", "c1.bias", "b1.weight", "b1.bias"], readers=["c2.weight"]),
        # the Linear after the flatten reads 2*2 consecutive columns per channel: 12 units of block 4
        Cluster("c2", writers=["c2.weight", "c2.bias", "b2.weight", "b2.bias"], readers=["fc.weight"], num_units=12),
    ]
    x = torch.randn(4, 3, 8, 8)
    before = _numel(model)
    result, small, masked, shrunk = masked_vs_shrunk(model, clusters, x)
    assert _rel(shrunk, masked) < 1e-5
    assert (small.c1.out_channels, small.c2.in_channels, small.c2.out_channels) == (4, 4, 6)
    assert small.b2.num_features == 6
    assert small.fc.in_features == 24
    assert _numel(small) < before
    # the running statistics keep exactly the kept channels
    kept = [c for c in range(12) if c not in set(result.dropped["c2"])]
    assert torch.equal(small.b2.running_mean, model.b2.running_mean[kept])
    assert torch.equal(small.b2.running_var, model.b2.running_var[kept])


def test_depthwise_with_multiplier_loses_whole_groups():
    torch.manual_seed(1)
    model = randomize_norms(DepthwiseNet())
    exp = Cluster(
        "exp",
        writers=["exp.weight", "exp.bias", "be.weight", "be.bias", "dw.weight", "dw.bias", "bd.weight", "bd.bias"]
        + ["se2.weight", "se2.bias"],
        readers=["se1.weight", "proj.weight"],
        num_units=12,
    )
    x = torch.randn(3, 3, 8, 8)
    _, small, masked, shrunk = masked_vs_shrunk(model, [exp], x)
    assert _rel(shrunk, masked) < 1e-5
    assert (small.dw.in_channels, small.dw.out_channels, small.dw.groups) == (6, 12, 6)
    assert small.bd.num_features == 12
    assert small.proj.in_channels == 12


class _GN(nn.Module):
    def __init__(self, groups: int = 4) -> None:
        super().__init__()
        self.c1, self.gn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(groups, 8), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.c2(F.silu(self.gn(self.c1(x))))


def test_groupnorm_drops_whole_groups_exactly():
    torch.manual_seed(2)
    model = randomize_norms(_GN())
    cluster = Cluster("g", writers=["c1.weight", "c1.bias", "gn.weight", "gn.bias"], readers=["c2.weight"], num_units=4)
    _, small, masked, shrunk = masked_vs_shrunk(model, [cluster], torch.randn(2, 3, 6, 6))
    assert _rel(shrunk, masked) < 1e-5
    assert (small.gn.num_groups, small.gn.num_channels, small.c2.in_channels) == (2, 4, 4)


def test_groupnorm_partial_group_is_refused_before_any_change():
    torch.manual_seed(2)
    model = _GN()
    cluster = Cluster("g", writers=["c1.weight", "c1.bias", "gn.weight", "gn.bias"], readers=["c2.weight"])
    result = prune_clusters(model, [cluster], 0.125)  # one channel: never a whole group
    with pytest.raises(ValueError, match=r"GroupNorm normalises groups of 2 channels.*num_units=4"):
        shrink(model, result)
    assert model.c1.out_channels == 8
    assert model.c1.weight.shape[0] == 8


def test_batchnorm_output_of_a_dropped_channel_is_zero_in_training_mode():
    """Zero BN weight and bias: the channel's output is zero whatever the batch or running statistics."""
    torch.manual_seed(3)
    model = randomize_norms(ConvChain()).train()
    cluster = Cluster("c1", writers=["c1.weight", "c1.bias", "b1.weight", "b1.bias"], readers=["c2.weight"])
    result = prune_clusters(model, [cluster], 0.5)
    seen = {}
    model.b1.register_forward_hook(lambda m, i, o: seen.setdefault("out", o.detach()))
    model(torch.randn(4, 3, 8, 8) * 5 + 3)
    dropped = list(result.dropped["c1"])
    assert len(dropped) == 4
    assert torch.count_nonzero(seen["out"][:, dropped]) == 0
    kept = [c for c in range(8) if c not in dropped]
    assert torch.count_nonzero(seen["out"][:, kept]) > 0


def test_conv3d_and_conv1d_members_are_scored_over_all_trailing_dims():
    """A conv weight's unit score is the norm over (in, *kernel): the same as the flattened 2-D view's row norm."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv3d(2, 6, 3), nn.ReLU(), nn.Conv3d(6, 2, 1))
    cluster = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
    result = prune_clusters(net, [cluster], 0.5)
    w0, b0, w2 = net[0].weight.detach(), net[0].bias.detach(), net[2].weight.detach()
    # independent reference, from the unpruned values: recompute on a fresh copy with the same seed
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Conv3d(2, 6, 3), nn.ReLU(), nn.Conv3d(6, 2, 1))
    q = (
        ref[0].weight.detach().double().flatten(1).square().sum(1)
        + ref[0].bias.detach().double().square()
        + ref[2].weight.detach().double().transpose(0, 1).flatten(1).square().sum(1)
    )
    expected = sorted(torch.argsort(q, stable=True)[:3].tolist())
    assert sorted(result.dropped["h"]) == expected
    assert w0[expected].abs().sum() == 0
    assert b0[expected].abs().sum() == 0
    assert w2[:, expected].abs().sum() == 0
    x = torch.randn(2, 2, 5, 5, 5)
    masked = net(x)
    small = shrink(net, result, inplace=False)
    assert _rel(small(x), masked) < 1e-5
    assert small[0].out_channels == 3
