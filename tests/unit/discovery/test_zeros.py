"""Per-channel scale vectors and sums over zeroed channels in the discovery walk (``discovery/zeros.py``, issue 37).

nGPT-style blocks (Dory) multiply their activations by learned vectors outside any Linear and project onto the unit
sphere with an L2 norm over the MLP width. The scale joins its channels' cluster and is cut with them; the L2 sum
over the width is exact because a dropped channel is zero there. The reference is independent of the library's
masking: the dropped units zeroed by hand in a copy, against the shrunk model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_pat import discover, shrink


class _Sphere(nn.Module):
    """A gated MLP with per-channel scales and a sub-norm over its width: ``norm`` is "l2", "rms" or "shifted"."""

    def __init__(self, norm: str = "l2") -> None:
        super().__init__()
        self.norm = norm
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.s_gate = nn.Parameter(1 + 0.3 * torch.randn(16))
        self.s_up = nn.Parameter(1 + 0.3 * torch.randn(16))

    def forward(self, x):
        h = nn.functional.silu(self.gate(x) * (self.s_gate * 2.0)) * (self.up(x) * self.s_up)
        if self.norm == "shifted":  # not zero where a channel is dropped: the sum sees the shift
            h = h + 1.0
        if self.norm == "rms":  # a mean divides by the width: never exact
            return self.down(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return self.down(h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + 1e-6))


def test_scale_vectors_join_the_cluster_and_an_l2_sub_norm_stays_exact():
    from lightning_pat import prune_clusters

    torch.manual_seed(0)
    model = _Sphere().eval()
    x = torch.randn(2, 5, 8)
    [cluster] = discover(model, x).clusters
    assert set(cluster.writers) == {"gate.weight", "gate.bias", "up.weight", "up.bias", "s_gate", "s_up"}
    assert cluster.readers == ["down.weight"]
    ref = copy.deepcopy(model)
    result = prune_clusters(model, [cluster], 0.5)
    drop = result.dropped[cluster.name]
    assert len(drop) == 8
    with torch.no_grad():  # the reference: the dropped channels zeroed by hand in every member of a copy
        for name in ("gate.weight", "gate.bias", "up.weight", "up.bias", "s_gate", "s_up"):
            ref.get_parameter(name)[drop] = 0
        ref.down.weight[:, drop] = 0
        expected = ref(x)
    small = shrink(model, result, example_input=x)
    assert (small.gate.out_features, small.down.in_features) == (8, 8)
    assert small.s_gate.shape == small.s_up.shape == (8,)
    with torch.no_grad():
        got = small(x)
    assert float(expected.norm()) > 1e-3
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def test_a_mean_or_a_sum_of_values_not_zero_in_dropped_channels_leaves_the_width_out():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    for norm, op in (("rms", "`mean`"), ("shifted", "`sum`")):
        found = discover(_Sphere(norm).eval(), x)
        assert found.clusters == [], norm
        [width] = [lo for lo in found.left_out if lo.name == "gate"]
        assert any(r.startswith(f"{op} reduces over a channel axis") for r in width.reasons), (norm, width.reasons)
        assert "s_gate" in width.members  # the scale is a member of the width, left out with it
