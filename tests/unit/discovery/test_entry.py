"""discover(): clusters found by tracing, checked against hand-written expectations, and the masked-vs-shrunk
exactness of every discovered cluster set (fp32, eval, rel < 1e-5); what is left out, and why."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import Cluster, discover, prune_clusters, resolve_clusters, shrink
from lightning_pat.discovery import prefers_discovery
from tests.common.cnn_models import (
    INPUTS,
    MLP,
    ConcatNet,
    ConvChain,
    DataDependent,
    DepthwiseNet,
    ResBlockNet,
    randomize_norms,
)


def _by_name(found) -> dict[str, Cluster]:
    return {c.name: c for c in found.clusters}


def test_conv_chain_clusters_match_the_hand_written_declaration():
    model = ConvChain()
    found = discover(model, torch.zeros(INPUTS[ConvChain]))
    assert found.clusters == [
        Cluster("c1", writers=["c1.weight", "c1.bias", "b1.weight", "b1.bias"], readers=["c2.weight"], num_units=8),
        Cluster("c2", writers=["c2.weight", "c2.bias", "b2.weight", "b2.bias"], readers=["fc.weight"], num_units=12),
    ]
    [c2] = [rc for rc in resolve_clusters(model, found.clusters) if rc.name == "c2"]
    assert {m.name: m.block for m in c2.members}["fc.weight"] == 4  # flatten: 2*2 columns per channel
    # the outputs are never pruned, the inputs never: the logits' rows and the first conv's columns are in no cluster
    assert [lo.name for lo in found.left_out] == ["fc"]
    assert "reaches the model's output" in found.left_out[0].reasons


def test_residual_additions_couple_both_sides_into_one_cluster():
    found = _by_name(discover(ResBlockNet(), torch.zeros(INPUTS[ResBlockNet])))
    stem = found["stem"]
    assert set(stem.writers) == {"stem.weight", "bs.weight", "bs.bias", "a2.weight", "ab2.weight", "ab2.bias"}
    assert set(stem.readers) == {"a1.weight", "proj.weight", "p1.weight"}
    proj = found["proj"]  # the projection shortcut and the branch it is added to
    assert set(proj.writers) == {"proj.weight", "projb.weight", "projb.bias", "p2.weight", "pb2.weight", "pb2.bias"}
    assert proj.readers == ["head.weight"]
    assert set(found) == {"stem", "a1", "proj", "p1"}


def test_depthwise_and_squeeze_excite_share_the_expanded_channels():
    found = _by_name(discover(DepthwiseNet(), torch.zeros(INPUTS[DepthwiseNet])))
    exp = found["exp"]
    assert exp.num_units == 12
    assert {"dw.weight", "dw.bias", "bd.weight", "bd.bias", "se2.weight", "se2.bias"} <= set(exp.writers)
    assert set(exp.readers) == {"se1.weight", "proj.weight"}
    [rc] = list(resolve_clusters(DepthwiseNet(), [exp]))
    blocks = {m.name: m.block for m in rc.members}
    assert blocks["dw.weight"] == 2
    assert blocks["exp.weight"] == 1
    assert blocks["se2.weight"] == 2


def test_concatenation_offsets_the_reader_columns():
    found = _by_name(discover(ConcatNet(), torch.zeros(INPUTS[ConcatNet])))
    assert found["left"].readers == ["mix.weight[0:4]"]
    assert found["right"].readers == ["mix.weight[4:10]"]
    assert found["mix"].readers == ["fc.weight"]
    assert found["mix"].num_units == 5


@pytest.mark.parametrize("cls", list(INPUTS), ids=lambda c: c.__name__)
def test_discovered_clusters_shrink_exactly(cls):
    torch.manual_seed(0)
    model = randomize_norms(cls())
    x = torch.randn(INPUTS[cls])
    found = discover(model, x)
    result = prune_clusters(model, found.clusters, 0.5)
    model.eval()
    with torch.no_grad():
        masked = model(x)
        small = shrink(model, result, inplace=False).eval()
        out = small(x)
    assert float((out - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())


def test_discover_does_not_touch_the_model():
    model = ConvChain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    discover(model, torch.zeros(INPUTS[ConvChain]))
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)


class _ScaledByParameter(nn.Module):
    """A parameter used directly in forward on a channel axis (2-D: a 1-D layer-scale would be a per-channel scale
    vector, cut with the channels it multiplies; see test_zeros.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 6), nn.Linear(6, 2)
        self.gamma = nn.Parameter(torch.ones(1, 6))

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x))) * self.gamma))


def test_parameter_used_directly_is_left_out_with_its_name():
    found = discover(_ScaledByParameter(), torch.zeros(2, 4))
    assert [c.name for c in found.clusters] == ["a"]
    [b] = [lo for lo in found.left_out if lo.name == "b"]
    assert any("parameter gamma is used directly in forward" in r for r in b.reasons)
    assert "gamma" in found.table() or "b.weight" in found.table()


class _Picked(nn.Module):
    """``index_select`` of positions (dim 1: the channels of ``a`` stay a cluster) or of channels (left out)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim, self.a, self.b = dim, nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("index", torch.tensor([2, 0, 1, 3, 5, 4, 7, 6]))

    def forward(self, x):  # [B, T=8, 4]
        return self.b(torch.relu(self.a(x)).index_select(self.dim, self.index))


def test_index_select_carries_the_other_axes_and_picking_channels_leaves_them_out():
    found = discover(_Picked(1), torch.zeros(2, 8, 4))
    assert [(c.name, c.num_units) for c in found.clusters] == [("a", 8)]
    found = discover(_Picked(2), torch.zeros(2, 8, 4))
    assert found.clusters == []
    [a] = [lo for lo in found.left_out if lo.name == "a"]
    assert any("`index_select` picks channels" in r for r in a.reasons)


class _LayerNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def test_layernorm_over_the_channels_is_left_out():
    found = discover(_LayerNormed(), torch.zeros(2, 4))
    assert found.clusters == []
    [a] = [lo for lo in found.left_out if lo.name == "a"]
    assert any("LayerNorm normalises over this channel axis" in r for r in a.reasons)


def test_data_dependent_control_flow_is_a_clear_error():
    with pytest.raises(ValueError, match=r"discover: torch.export could not trace DataDependent"):
        discover(DataDependent(), torch.zeros(2, 4))


class _Kwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x, *, scale: float = 1.0):
        return self.b(F.relu(self.a(x))) * scale


def test_example_input_as_tuple_or_dict():
    for example in ((torch.zeros(2, 4),), {"x": torch.zeros(2, 4)}):
        assert [c.name for c in discover(_Kwargs(), example).clusters] == ["a"]


def test_shared_module_applied_twice_is_one_cluster():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.mid, self.b = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.b(F.relu(self.mid(F.relu(self.mid(F.relu(self.a(x)))))))

    torch.manual_seed(0)
    model = Twice()
    found = discover(model, torch.zeros(2, 4))
    # a's output and mid's output feed mid's columns: one space; mid's rows feed mid's columns too
    assert [c.name for c in found.clusters] == ["a"]
    assert set(found.clusters[0].writers) == {"a.weight", "a.bias", "mid.weight", "mid.bias"}
    assert set(found.clusters[0].readers) == {"mid.weight", "b.weight"}
    x = torch.randn(3, 4)
    result = prune_clusters(model, found.clusters, 0.5)
    small = shrink(model, result, inplace=False)
    assert torch.allclose(small(x), model(x), rtol=1e-5, atol=1e-6)


def test_prefers_discovery_only_where_no_preset_fits():
    assert prefers_discovery(ConvChain())
    assert prefers_discovery(MLP())  # a custom module: no nn.Sequential chain
    assert not prefers_discovery(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert prefers_discovery(nn.Sequential(nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(4, 8), nn.Linear(8, 2)))


def test_table_lists_clusters_and_left_out_channels():
    text = discover(ConvChain(), torch.zeros(INPUTS[ConvChain])).table()
    assert "| c1 | 8 |" in text
    assert "| fc | 5 |" in text
    assert "left out: reaches the model's output" in text


class _SpatialGate(nn.Module):
    """A one-channel gate broadcast over the channels, and a norm over the channel axis."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 1, 1), nn.Conv2d(8, 4, 1)
        self.c, self.d = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        y = self.a(x)
        y = y * torch.sigmoid(self.gate(y))  # (B, 1, H, W) broadcast over 8 channels
        h = self.c(self.b(y).mean(dim=(2, 3)))
        return self.d(h / torch.linalg.vector_norm(h, 2, dim=-1, keepdim=True))


def test_broadcast_one_channel_gate_and_channel_norm_are_handled():
    torch.manual_seed(0)
    model = _SpatialGate()
    x = torch.randn(2, 3, 4, 4)
    found = discover(model, x)
    by_name = _by_name(found)
    # the gate's single channel is left out; h's L2 norm sums channels that are zero where dropped (c's rows and
    # bias), so h is a cluster too
    assert set(by_name) == {"a", "b", "c"}
    assert set(by_name["a"].readers) == {"gate.weight", "b.weight"}
    assert by_name["c"].readers == ["d.weight"]
    result = prune_clusters(model, found.clusters, 0.5)
    with torch.no_grad():
        masked = model(x)
        out = shrink(model, result, inplace=False)(x)
    assert float((out - masked).norm() / masked.norm()) < 1e-5


def test_a_cluster_that_does_not_resolve_is_left_out_not_returned():
    from lightning_pat.discovery.entry import Discovery, _validated

    model = _Kwargs()
    good = Cluster("a", writers=["a.weight", "a.bias"], readers=["b.weight"], num_units=8)
    odd = Cluster("x", writers=["b.bias"], readers=["a.weight"], num_units=2)  # odd but valid: it resolves
    bad_overlap = Cluster("y", writers=["a.weight"], num_units=8)  # a.weight rows already in "a"
    checked = _validated(model, Discovery(clusters=[good, odd, bad_overlap], left_out=[]))
    assert [c.name for c in checked.clusters] == ["a", "x"]
    [left] = checked.left_out
    assert left.name == "y"
    assert "does not resolve" in left.reasons[0]
    assert "already belongs to cluster 'a'" in left.reasons[0]


class _GroupNormed(nn.Module):
    """U-Net style: conv -> GroupNorm(4 groups of 4) -> SiLU -> conv, with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gn1, self.c1 = (
            nn.Conv2d(3, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.Conv2d(16, 8, 3, padding=1),
        )
        self.gn2, self.c2 = nn.GroupNorm(2, 8), nn.Conv2d(8, 16, 3, padding=1)
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.c2(F.silu(self.gn2(self.c1(F.silu(self.gn1(h))))))
        return self.out(h)


def test_groupnorm_units_are_whole_groups_and_shrink_exactly():
    torch.manual_seed(0)
    model = randomize_norms(_GroupNormed())
    x = torch.randn(2, 3, 6, 6)
    found = _by_name(discover(model, x))
    assert found["inp"].num_units == 4  # the residual stream: GroupNorm(4, 16) makes a unit 4 channels
    assert found["c1"].num_units == 2  # GroupNorm(2, 8)
    result = prune_clusters(model, list(found.values()), 0.5)
    with torch.no_grad():
        masked = model(x)
        small = shrink(model, result, inplace=False)
        out = small(x)
    assert float((out - masked).norm() / masked.norm()) < 1e-5
    assert (small.gn1.num_groups, small.gn1.num_channels, small.gn2.num_groups, small.gn2.num_channels) == (2, 8, 1, 4)
