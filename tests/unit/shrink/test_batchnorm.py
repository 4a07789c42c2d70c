"""A BatchNorm on a shrunk axis: refused unless declared in the cluster, then shrunk exactly with its statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, prune_clusters
from tests.common.tiny_mlp import snapshot, unchanged


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
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"module 'bn' \(BatchNorm1d\) sits between 'fc1'.*8 output channels") as err:
        shrink(net, res)
    assert "`bn.weight`, `bn.bias`" in str(err.value)
    assert "running_mean" in str(err.value)
    assert unchanged(net, before)
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
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm2d\) sits between '0'.*8 output channels"):
        shrink(net, res)
    assert unchanged(net, before)
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
