"""Heads behind a packed QKV (timm's and torchvision Swin's layout: ``reshape(B, N, 3, heads, head_dim)``, ``permute``,
``unbind`` or ``select``), the shrink's update of ``self.num_heads``, and what discovery leaves out because the
shrunk model could not run or would differ (a head count or width from the input, a literal head count); a reader
of untraced channels at another call site (audit A1) and members the shrink cannot rewrite (A2). Every returned
cluster is shrunk exactly (masked vs shrunk, eval, fp32, rel < 1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pat import discover, prune_clusters, shrink
from tests.common.cnn_models import exact_shrink


class _TimmAttention(nn.Module):
    """timm-style: one ``qkv`` Linear, ``reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)``.

    ``back``: how the heads are merged again: ``"-1"`` (runs shrunk once ``num_heads`` is updated), ``"C"`` (the input
    width: a shrunk model cannot run), ``"literal"`` (``num_heads`` replaced by the literal 4 in the reshape).
    """

    def __init__(self, *, back: str = "-1", unbind: bool = True, sdpa: bool = True, dim: int = 16) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.back, self.unbind, self.sdpa = 4, dim // 4, back, unbind, sdpa
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        heads = 4 if self.back == "literal" else self.num_heads
        qkv = self.qkv(x).reshape(b, n, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0) if self.unbind else (qkv[0], qkv[1], qkv[2])
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, n, c if self.back == "C" else -1)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(h)))


@pytest.mark.parametrize(("unbind", "sdpa"), [(True, True), (False, False)])
def test_heads_behind_a_packed_qkv_are_found_and_num_heads_follows_the_shrink(unbind, sdpa):
    torch.manual_seed(0)
    model = _TimmAttention(unbind=unbind, sdpa=sdpa).eval()
    found = discover(model, torch.zeros(2, 5, 16))
    by_name = {c.name: c for c in found.clusters}
    assert set(by_name) == {"qkv", "fc1"}
    assert by_name["qkv"].num_units == 4  # heads: q, k and v rows of one head are one unit
    assert by_name["qkv"].writers == [f"qkv.{p}[{i}:{i + 16}]" for p in ("weight", "bias") for i in (0, 16, 32)]
    assert by_name["qkv"].readers == ["proj.weight"]
    small = exact_shrink(model, found.clusters, torch.randn(2, 7, 16))
    assert (small.num_heads, small.qkv.out_features, small.proj.in_features) == (2, 24, 8)


@pytest.mark.parametrize(("back", "expected"), [("C", "does not run"), ("literal", "does not run")])
def test_heads_whose_count_or_width_is_held_elsewhere_are_left_out(back, expected):
    found = discover(_TimmAttention(back=back), torch.zeros(2, 5, 16))
    assert [c.name for c in found.clusters] == ["fc1"]
    [heads] = [lo for lo in found.left_out if lo.name == "qkv"]
    assert heads.units == 4
    assert "a trial shrink (one unit dropped) fails" in heads.reasons[0]
    assert expected in heads.reasons[0]


class _TwoCallSites(nn.Module):
    """Audit A1: ``fc1`` reads the model's input and ``fc0``'s output; ``fc0``'s channels cannot be cut in fc1."""

    def __init__(self, *, tied: bool = False) -> None:
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 4)
        self.tied = tied
        if tied:
            self.fc3 = nn.Linear(8, 16)
            self.fc3.weight = self.fc1.weight

    def forward(self, x):
        other = self.fc3 if self.tied else self.fc1
        return self.fc2(F.relu(self.fc1(x))) + self.fc2(F.relu(other(F.relu(self.fc0(x)))))


@pytest.mark.parametrize("tied", [False, True])
def test_a_reader_of_the_input_at_another_call_site_poisons_the_cluster(tied):
    torch.manual_seed(0)
    model = _TwoCallSites(tied=tied).eval()
    found = discover(model, torch.zeros(3, 8))
    assert "fc0" not in {c.name for c in found.clusters}
    [fc0] = [lo for lo in found.left_out if lo.name == "fc0"]
    assert any("also reads channels that are not traced" in r for r in fc0.reasons)
    exact_shrink(model, found.clusters, torch.randn(3, 8))


class _Unrewritable(nn.Module):
    """Audit A2: ``F.linear`` with bare parameters, an ``nn.MultiheadAttention``, an embedding tied to a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 8) / 3), nn.Parameter(torch.zeros(16))
        self.fc2 = nn.Linear(16, 8)
        self.inp, self.mha = nn.Linear(8, 16), nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc2(F.relu(F.linear(x, self.w1, self.b1)))
        a = self.inp(h)
        return self.out(self.mha(a, a, a, need_weights=False)[0])


def test_members_the_shrink_cannot_rewrite_are_left_out_with_the_shrinks_reason():
    torch.manual_seed(0)
    model = _Unrewritable().eval()
    x = torch.randn(2, 5, 8)
    found = discover(model, x)
    names = {c.name for c in found.clusters}
    assert not names & {"w1", "inp"}
    reasons = {lo.name: " ".join(lo.reasons) for lo in found.left_out}
    assert "which the shrink cannot rewrite" in reasons["w1"] or "used directly" in reasons["w1"]
    assert "MultiheadAttention" in reasons["inp"]
    exact_shrink(model, found.clusters, x)


class _TiedInnerEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(20, 8), nn.Linear(8, 20)
        self.proj.weight = self.emb.weight
        self.fc, self.out = nn.Linear(20, 12), nn.Linear(12, 3)

    def forward(self, ids):
        return self.out(F.relu(self.fc(self.proj(self.emb(ids)))))


def test_an_embedding_tied_to_an_inner_projection_keeps_its_vocabulary():
    found = discover(_TiedInnerEmbedding(), torch.zeros(2, 4, dtype=torch.long))
    for c in found.clusters:
        assert not any(m.startswith("emb.weight") or m.startswith("proj.weight") for m in c.writers), c
    assert "fc" in {c.name for c in found.clusters}


def test_shrink_checks_the_shrunk_model_and_names_the_module():
    torch.manual_seed(0)
    model = _TwoCallSites().eval()
    x = torch.randn(3, 8)
    found = discover(model, x, check="none")  # the trial off: the walk alone is fooled by nothing here
    assert "fc0" not in {c.name for c in found.clusters}
    from lightning_pat import Cluster

    bad = Cluster("fc0", writers=["fc0.weight", "fc0.bias"], readers=["fc1.weight"])
    result = prune_clusters(model, [bad], 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"meta copy of the shrunk model does not run .* module 'fc1'"):
        shrink(model, result, example_input=x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any change


def test_shrink_with_a_discovery_checks_on_its_example_input():
    torch.manual_seed(0)
    model = _TimmAttention(back="-1").eval()
    x = torch.randn(2, 5, 16)
    found = discover(model, x)
    assert found.example_input is x
    result = prune_clusters(model, found.clusters, 0.5)
    with torch.no_grad():
        masked = model(x)
    small = shrink(model, result, example_input=found)
    with torch.no_grad():
        assert float((small(x) - masked).norm() / masked.norm()) < 1e-5


def test_shrink_that_runs_but_differs_is_refused_naming_the_first_module():
    class StaleHeads(_TimmAttention):  # reads its head count from an attribute the shrink does not know
        def __init__(self) -> None:
            super().__init__()
            self.h = self.num_heads
            del self.num_heads

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
            return self.fc2(F.gelu(self.fc1(x + self.proj(y))))

    torch.manual_seed(0)
    model = StaleHeads().eval()
    x = torch.randn(2, 5, 16)
    found = discover(model, x)
    assert "qkv" not in {c.name for c in found.clusters}  # the trial shrink saw the difference
    [heads] = [lo for lo in found.left_out if lo.name == "qkv"]
    assert "differ from the masked model's" in heads.reasons[0]
    from lightning_pat import Cluster

    declared = Cluster(
        "qkv",
        writers=[f"qkv.{p}[{i}:{i + 16}]" for p in ("weight", "bias") for i in (0, 16, 32)],
        readers=["proj.weight"],
        num_units=4,
    )
    result = prune_clusters(model, [declared], 0.5)
    with pytest.raises(ValueError, match=r"differ from the masked model.s .* first module whose output differs"):
        shrink(model, result, example_input=x)
