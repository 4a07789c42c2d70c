"""Heads behind the ops of Hugging Face causal LMs that discovery did not read (issue 37, cause 3), on hand-built
attention modules: ``stack`` (GPT-J's rotary), Bloom's ``(heads, 3, head_dim)`` layout picked by ``select`` with the
heads merged into the batch axis for ``bmm`` (and ``baddbmm``'s ALiBi bias), Phi-3's fused ``qkv_proj`` cut by slices
(GQA), Falcon's multi-query ``split`` of the head axis and its grouped (new decoder architecture) layout. The expected
members are written out by hand from each module's layout; every cluster found is shrunk exactly (rel < 1e-5)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import Cluster, discover, resolve_clusters
from tests.common.cnn_models import exact_shrink

C, H, D = 16, 4, 4  # hidden, heads, head_dim


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary helper: pairs of channels of a head rotated, through ``stack`` and ``flatten``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class _GPTJ(nn.Module):
    """Separate q/k/v, heads, rotary with ``stack`` on q and k, causal attention, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = H, D
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(C, C, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(C, C, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        angle = torch.arange(t, dtype=x.dtype, device=x.device)[:, None, None] * 0.3
        q = q * angle.cos() + _rotate_every_two(q) * angle.sin()
        k = k * angle.cos() + _rotate_every_two(k) * angle.sin()
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


def test_stack_of_a_head_axis_keeps_the_heads():
    torch.manual_seed(0)
    model = _GPTJ().eval()
    found = discover(model, torch.zeros(2, 5, C))
    assert found.clusters == [
        Cluster("q_proj", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], ["out_proj.weight"], num_units=H)
    ]
    small = exact_shrink(model, found.clusters, torch.randn(2, 6, C))
    assert (small.q_proj.out_features, small.out_proj.in_features, small.num_heads) == (8, 8, 2)


class _StackUntraced(nn.Module):
    """A head axis stacked with a tensor whose channels are not traced (a constant): the heads are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(C, C), nn.Linear(2 * C, C)
        self.register_buffer("table", torch.randn(C))

    def forward(self, x):
        both = torch.stack((self.q(x), self.table.expand(*x.shape[:-1], C)), dim=-1)
        return self.o(both.flatten(-2))


def test_stack_with_untraced_channels_poisons_them():
    found = discover(_StackUntraced(), torch.zeros(2, 3, C))
    assert not any(c.name == "q" for c in found.clusters)
    [q] = [lo for lo in found.left_out if lo.name == "q"]
    assert any("stack" in r or "buffer table" in r for r in q.reasons)


class _Bloom(nn.Module):
    """Bloom's layout: ``query_key_value`` viewed as ``(B, T, heads, 3, head_dim)``, q/k/v picked by ``select``, the
    heads merged into the batch axis for ``bmm`` (``baddbmm`` with a bias when ``alibi``)."""

    def __init__(self, *, alibi: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.alibi = H, D, alibi
        self.query_key_value, self.dense = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        b, t, _ = x.shape
        fused = self.query_key_value(x).view(b, t, self.num_heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * self.num_heads, t, self.head_dim) for i in range(3))
        if self.alibi:  # one slope per head, computed from the head count (as Bloom's build_alibi_tensor)
            slopes = 2.0 ** -torch.arange(1, self.num_heads + 1, dtype=x.dtype, device=x.device)
            bias = (slopes[:, None] * torch.arange(t, dtype=x.dtype, device=x.device)).repeat(b, 1)[:, None, :]
            scores = bias.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=self.head_dim**-0.5)
        else:
            scores = torch.bmm(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        y = torch.bmm(torch.softmax(scores, dim=-1), v).view(b, self.num_heads, t, self.head_dim)
        return self.dense(y.permute(0, 2, 1, 3).reshape(b, t, -1))


def test_heads_then_parts_picked_by_select_are_whole_heads():
    torch.manual_seed(1)
    model = _Bloom().eval()
    found = discover(model, torch.zeros(2, 5, C))
    # head h: rows [12h, 12h + 12) of query_key_value (its q, k and v side by side) and columns [4h, 4h + 4) of dense
    assert found.clusters == [
        Cluster("query_key_value", ["query_key_value.weight", "query_key_value.bias"], ["dense.weight"], num_units=H)
    ]
    [rc] = resolve_clusters(model, found.clusters)
    assert {m.name: m.block for m in rc.members} == {
        "query_key_value.weight": 3 * D, "query_key_value.bias": 3 * D, "dense.weight": D,
    }  # fmt: skip
    small = exact_shrink(model, found.clusters, torch.randn(2, 6, C))
    assert (small.query_key_value.out_features, small.dense.in_features, small.num_heads) == (24, 8, 2)


def test_a_per_head_bias_added_by_baddbmm_leaves_the_heads_out():
    found = discover(_Bloom(alibi=True), torch.zeros(2, 5, C))
    assert [c.name for c in found.clusters] == []
    [heads] = [lo for lo in found.left_out if lo.name == "query_key_value"]
    assert heads.units == H
    assert any("`baddbmm` adds a tensor computed apart from these channels" in r for r in heads.reasons)


class _Phi3(nn.Module):
    """Phi-3's layout: one ``qkv_proj`` (H query heads, then KV keys, then KV values) sliced apart, GQA."""

    def __init__(self, kv: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = H, kv, D
        self.num_key_value_groups = H // kv
        self.qkv_proj = nn.Linear(C, (H + 2 * kv) * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        q_end = self.num_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        q, k, v = (part.view(b, t, -1, self.head_dim).transpose(1, 2) for part in (qkv[..., :q_end],
                   qkv[..., q_end:k_end], qkv[..., k_end:]))  # fmt: skip
        n_rep = self.num_key_value_groups
        k, v = (s[:, :, None].expand(b, s.shape[1], n_rep, t, self.head_dim).reshape(b, -1, t, self.head_dim)
                for s in (k, v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def test_slices_of_a_fused_qkv_are_cut_into_query_groups():
    torch.manual_seed(2)
    model = _Phi3().eval()
    found = discover(model, torch.zeros(2, 5, C))
    # KV head g: query rows [8g, 8g + 8) (2 heads), key rows 16 + [4g, 4g + 4), value rows 24 + [4g, 4g + 4)
    assert found.clusters == [
        Cluster(
            "qkv_proj",
            ["qkv_proj.weight[0:16]", "qkv_proj.weight[16:24]", "qkv_proj.weight[24:32]"],
            ["o_proj.weight"],
            num_units=2,
        )
    ]
    [rc] = resolve_clusters(model, found.clusters)
    assert sorted(m.block for m in rc.members) == [4, 4, 8, 8]
    small = exact_shrink(model, found.clusters, torch.randn(2, 6, C))
    assert (small.qkv_proj.out_features, small.o_proj.in_features) == (16, 8)
    assert (small.num_heads, small.num_key_value_heads, small.num_key_value_groups) == (2, 1, 2)


class _FalconMQA(nn.Module):
    """Falcon's multi-query layout: ``view(B, T, H + 2, D)`` then ``split([H, 1, 1])`` of the head axis."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = H, D
        self.query_key_value = nn.Linear(C, (H + 2) * D, bias=False)
        self.dense = nn.Linear(C, C, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        fused = self.query_key_value(x).view(b, t, -1, self.head_dim)
        q, k, v = fused.split([self.num_heads, 1, 1], dim=-2)
        q, k, v = (s.transpose(1, 2) for s in (q, k, v))
        k, v = (
            s[:, :, None].expand(b, 1, self.num_heads, t, self.head_dim).reshape(b, -1, t, self.head_dim)
            for s in (k, v)
        )  # fmt: skip  (transformers' repeat_kv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, -1))


def test_split_of_a_head_axis_gives_the_query_heads_of_multi_query_attention():
    torch.manual_seed(3)
    model = _FalconMQA().eval()
    found = discover(model, torch.zeros(2, 5, C))
    # the query heads (rows [0, 16)); the one key and the one value (rows [16, 20), [20, 24)) are shared by all
    assert found.clusters == [
        Cluster("query_key_value", ["query_key_value.weight[0:16]"], ["dense.weight"], num_units=H)
    ]
    left = {lo.members: lo.reasons for lo in found.left_out}
    assert ("query_key_value.weight[16:20]",) in left
    assert ("query_key_value.weight[20:24]",) in left
    small = exact_shrink(model, found.clusters, torch.randn(2, 6, C))
    assert (small.query_key_value.out_features, small.dense.in_features, small.num_heads) == (16, 8, 2)


class _FalconGrouped(nn.Module):
    """Falcon's new decoder architecture: ``(B, T, KV, H/KV + 2, D)``, each group's queries then its key and value."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = H, 2, D
        self.query_key_value = nn.Linear(C, (H + 4) * D, bias=False)
        self.dense = nn.Linear(C, C, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        grouped = self.query_key_value(x).view(b, t, self.num_kv_heads, -1, self.head_dim)
        q = grouped[..., :-2, :].flatten(-3, -2).transpose(1, 2)
        k, v = (grouped[..., i, :].transpose(1, 2) for i in (-2, -1))
        n_rep = self.num_heads // self.num_kv_heads
        k, v = (s[:, :, None].expand(b, self.num_kv_heads, n_rep, t, self.head_dim).reshape(b, -1, t, self.head_dim)
                for s in (k, v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, -1))


def test_grouped_fused_qkv_is_cut_into_whole_groups():
    torch.manual_seed(4)
    model = _FalconGrouped().eval()
    found = discover(model, torch.zeros(2, 5, C))
    # group g: rows [16g, 16g + 16) (2 queries, a key and a value) and columns [8g, 8g + 8) of dense
    assert found.clusters == [Cluster("query_key_value", ["query_key_value.weight"], ["dense.weight"], num_units=2)]
    [rc] = resolve_clusters(model, found.clusters)
    assert {m.name: m.block for m in rc.members} == {"query_key_value.weight": 16, "dense.weight": 8}
    small = exact_shrink(model, found.clusters, torch.randn(2, 6, C))
    assert (small.query_key_value.out_features, small.num_heads, small.num_kv_heads) == (16, 2, 1)
