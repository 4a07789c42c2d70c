"""Layer scores with DTensor hidden states on 2 gloo ranks (lightning_pat.scoring.layers).

A layer whose input and output are DTensors placed ``Shard(1)`` (sequence parallel: every token's hidden vector is
whole on one rank) is read through the local shards; the sums of both ranks give the score of the full tensors,
computed here by hand in float64. ``Replicate`` counts every token on both ranks, in the sum and the count alike, so
the mean is the same. A hidden dim that is sharded (``Shard(2)``) is refused at the selection with the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.common.dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x) * 3.0  # elementwise: keeps any placement


def _full() -> torch.Tensor:
    return torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))


def reference() -> float:
    x = _full().double().reshape(-1, 4)
    y = (_full() + torch.tanh(_full()) * 3.0).double().reshape(-1, 4)
    cos = (x * y).sum(dim=1) / (x.norm(dim=1) * y.norm(dim=1))
    return 1.0 - float(cos.mean())


def _worker(rank: int, world_size: int, placement: str) -> object:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.scoring.layers import LayerStats

    mesh = init_device_mesh("cpu", (world_size,))
    net = nn.ModuleDict({"blk": Block()})
    rcs = resolve_clusters(net, Cluster("layer.blk", writers=["blk.attn.weight", "blk.mlp.weight"], num_units=1,
                                        budget="layers"))  # fmt: skip
    stats = LayerStats(net, rcs)
    stats.attach()
    place = {"shard_tokens": Shard(1), "replicate": Replicate(), "shard_hidden": Shard(2)}[placement]
    x = distribute_tensor(_full(), mesh, [place])
    net.train()
    with torch.enable_grad():
        net["blk"](x)
    local_tokens = stats.seen().get("layer.blk", 0)
    try:
        scores = stats.summed_scores()
    except ValueError as err:
        return str(err)
    return local_tokens, float(scores["layer.blk"])


@pytest.mark.parametrize(("placement", "tokens"), [("shard_tokens", 6), ("replicate", 12)])
def test_token_sharded_and_replicated_hidden_states_give_the_full_score(placement, tokens):
    results = run_distributed(_worker, 2, placement)
    assert [r[0] for r in results] == [tokens, tokens]  # per rank: its 6 of 12 tokens, or all 12
    assert results[0][1] == results[1][1]  # bitwise the same on both ranks
    assert results[0][1] == pytest.approx(reference(), abs=1e-6)  # float32 dot products: ~1e-7 in cos


def test_a_sharded_hidden_dim_is_refused_with_the_fix():
    for message in run_distributed(_worker, 2, "shard_hidden"):
        assert "Cluster 'layer.blk'" in message
        assert "Shard(dim=2)" in message
        assert "layer_score='weight'" in message
