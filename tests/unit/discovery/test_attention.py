"""Attention heads found by tracing: hand-written expectations on small custom attention modules (MHA, GQA via
``repeat_interleave`` and via ``enable_gqa``, a packed QKV projection cut by ``split``, a fused GLU gate/up cut by
``chunk``), exact shrinks of what was
found (masked vs shrunk, eval mode, fp32, rel < 1e-5), and what mixes heads or reads a packed projection whole is
left out with the reason."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import Cluster, discover, prune_clusters, resolve_clusters
from tests.common.cnn_models import exact_shrink


class _MHA(nn.Module):
    """Hand-written attention: the head count is never hard-coded (``-1``), so a shrunk copy runs."""

    def __init__(self, d: int = 8, hd: int = 2) -> None:
        super().__init__()
        self.hd = hd
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 16), nn.Linear(16, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5, dim=-1) @ v
        h = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        return h + self.down(F.gelu(self.up(h)))


def test_mha_heads_are_one_cluster_of_whole_heads():
    torch.manual_seed(0)
    model = _MHA()
    found = discover(model, torch.zeros(2, 3, 8))
    assert found.clusters == [
        Cluster("q", ["q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias"], ["o.weight"], num_units=4),
        Cluster("up", ["up.weight", "up.bias"], ["down.weight"], num_units=16),
    ]
    [heads, _] = resolve_clusters(model, found.clusters)
    assert {m.block for m in heads.members} == {2}  # a unit is a head: head_dim channels of every member
    small = exact_shrink(model, found.clusters, torch.randn(2, 5, 8))
    assert (small.q.out_features, small.k.out_features, small.v.out_features, small.o.in_features) == (4, 4, 4, 4)


class _GQA(nn.Module):
    """4 query heads, 2 KV heads of width 3; KV heads repeated with ``repeat_interleave`` or read by SDPA's
    ``enable_gqa``."""

    def __init__(self, *, sdpa_gqa: bool) -> None:
        super().__init__()
        self.sdpa_gqa = sdpa_gqa
        self.q, self.k, self.v, self.o = nn.Linear(8, 12), nn.Linear(8, 6), nn.Linear(8, 6), nn.Linear(12, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, 3).transpose(1, 2) for p in (self.q, self.k, self.v))
        if not self.sdpa_gqa:
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.sdpa_gqa)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_gqa_units_are_whole_query_groups():
    for sdpa_gqa in (False, True):
        torch.manual_seed(1)
        model = _GQA(sdpa_gqa=sdpa_gqa)
        found = discover(model, torch.zeros(2, 3, 8))
        assert found.clusters == [
            Cluster("q", ["q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias"], ["o.weight"], num_units=2)
        ]
        [rc] = resolve_clusters(model, found.clusters)
        # a unit is one KV head (3 rows of k and v) and its 2 query heads (6 rows of q, 6 columns of o)
        assert {m.name: m.block for m in rc.members} == {n: 3 if n[0] in "kv" else 6 for n in rc.param_names}
        small = exact_shrink(model, found.clusters, torch.randn(2, 5, 8))
        assert (small.q.out_features, small.k.out_features, small.o.in_features) == (6, 3, 6)


class _Packed(nn.Module):
    """One Linear writes q, k and v side by side; ``split`` cuts them apart (GPT-2's ``c_attn`` layout)."""

    def __init__(self, *, also_read_whole: bool = False, literal_split: bool = False) -> None:
        super().__init__()
        self.also_read_whole, self.literal_split = also_read_whole, literal_split
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)
        self.side = nn.Linear(24, 8)

    def forward(self, x):
        b, t, _ = x.shape
        packed = self.qkv(x)
        parts = packed.split(8, dim=-1) if self.literal_split else packed.chunk(3, dim=-1)
        q, k, v = (p.view(b, t, -1, 4).transpose(1, 2) for p in parts)
        y = self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))
        return y + self.side(packed) if self.also_read_whole else y


def test_packed_qkv_is_cut_into_its_parts():
    torch.manual_seed(2)
    model = _Packed()
    found = discover(model, torch.zeros(2, 3, 8))
    assert found.clusters == [
        Cluster(
            "qkv",
            ["qkv.weight[0:8]", "qkv.weight[8:16]", "qkv.weight[16:24]", "qkv.bias[0:8]", "qkv.bias[8:16]"]
            + ["qkv.bias[16:24]"],
            ["o.weight"],
            num_units=2,
        )
    ]
    [rc] = resolve_clusters(model, found.clusters)
    assert {m.block for m in rc.members} == {4}
    result = prune_clusters(model, found.clusters, 0.5)
    kept = [h for h in range(2) if h not in result.dropped["qkv"]]
    rows = torch.cat([torch.arange(p * 8 + h * 4, p * 8 + h * 4 + 4) for p in range(3) for h in kept])
    assert torch.count_nonzero(model.qkv.weight.detach()[rows]) == rows.numel() * 8
    assert int(torch.count_nonzero(model.qkv.weight.detach())) == 12 * 8  # the dropped head's rows in q, k and v


def test_packed_qkv_split_by_a_literal_size_is_left_out_by_the_trial_shrink():
    found = discover(_Packed(literal_split=True), torch.zeros(2, 3, 8))
    assert found.clusters == []
    [qkv] = [lo for lo in found.left_out if lo.name == "qkv"]
    assert qkv.reasons[0].startswith("a trial shrink (one unit dropped) fails: the shrunk model does not run")


def test_packed_output_read_whole_elsewhere_is_read_part_by_part():
    # `side` reads all 24 packed channels: after the cut its columns are read as q, k and v, each head's 4 channels
    # of each part dropped with the head (a dropped head's packed channels are zero, so its columns read zeros)
    torch.manual_seed(3)
    model = _Packed(also_read_whole=True)
    found = discover(model, torch.zeros(2, 3, 8))
    [qkv] = found.clusters
    assert (qkv.name, qkv.num_units) == ("qkv", 2)
    assert qkv.readers == ["o.weight", "side.weight[0:8]", "side.weight[8:16]", "side.weight[16:24]"]
    small = exact_shrink(model, found.clusters, torch.randn(2, 5, 8))
    assert (small.qkv.out_features, small.side.in_features, small.o.in_features) == (12, 12, 4)


class _MixHeads(nn.Module):
    """Heads reduced together (a mean over the head axis), so no head can be dropped on its own.

    (A sum over heads whose dropped heads are zero would be exact: see ``discovery/zeros.py``.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(2, 8)

    def forward(self, x):
        b, t, _ = x.shape
        return self.o(self.q(x).view(b, t, 4, 2).mean(dim=2))


def test_an_op_that_mixes_heads_leaves_them_out():
    found = discover(_MixHeads(), torch.zeros(2, 3, 8))
    assert found.clusters == []
    [q] = [lo for lo in found.left_out if lo.name == "q"]
    assert any("`mean` reduces over a channel axis" in r for r in q.reasons)


class _HeadsBehindTime(nn.Module):
    """After the split, the head axis is flattened behind the within-head axis (channels d*H + h): a head is no longer
    a block of consecutive channels of ``o``'s input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        return self.o(self.q(x).view(b, t, 4, 2).transpose(2, 3).reshape(b, t, 8))


def test_heads_merged_behind_another_axis_are_left_out():
    found = discover(_HeadsBehindTime(), torch.zeros(2, 3, 8))
    assert found.clusters == []
    [q] = [lo for lo in found.left_out if lo.name == "q"]
    assert any("merges a channel axis behind another axis" in r for r in q.reasons)


class _FusedGLU(nn.Module):
    """One Linear writes a GLU's gate and up halves side by side; ``chunk`` cuts them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 32), nn.Linear(16, 8)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def test_fused_gate_up_halves_share_one_unit_per_hidden_channel():
    torch.manual_seed(3)
    model = _FusedGLU()
    found = discover(model, torch.zeros(2, 3, 8))
    assert found.clusters == [
        Cluster(
            "gate_up",
            ["gate_up.weight[0:16]", "gate_up.weight[16:32]", "gate_up.bias[0:16]", "gate_up.bias[16:32]"],
            ["down.weight"],
            num_units=16,
        )
    ]
    small = exact_shrink(model, found.clusters, torch.randn(2, 5, 8))
    assert (small.gate_up.out_features, small.down.in_features) == (16, 8)
