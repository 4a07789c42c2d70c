"""The routing hook: a router row that is exactly zero is an expert routed around (softmax and top-k without it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat.core.routing import is_router, route_around_dropped
from lightning_pat.core.spec import Cluster, resolve_clusters

transformers = pytest.importorskip("transformers")


class Block(nn.Module):
    def __init__(self, norm_topk_prob: bool | None) -> None:
        super().__init__()
        if norm_topk_prob is None:
            from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router

            config = transformers.MixtralConfig(hidden_size=8, num_local_experts=5, num_experts_per_tok=2)
        else:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router

            config = transformers.Qwen3MoeConfig(
                hidden_size=8, num_experts=5, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob
            )
        self.gate = Router(config)
        nn.init.normal_(self.gate.weight, generator=torch.Generator().manual_seed(0))


def reference(weight: torch.Tensor, h: torch.Tensor, kept: list[int], k: int, renorm: bool):
    """Softmax and top-k over the kept rows only (float64), as global expert indices."""
    probs = torch.softmax(h.double() @ weight.double()[kept].T, dim=-1)
    top_v, top_i = torch.topk(probs, min(k, len(kept)), dim=-1)
    if renorm:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    return top_v, torch.tensor(kept)[top_i]


@pytest.mark.parametrize("norm_topk_prob", [None, True, False])
@pytest.mark.parametrize("drop", [[], [0], [1, 3], [0, 2, 4], [0, 1, 2, 3]])
def test_zero_rows_are_routed_around_like_removed_rows(norm_topk_prob, drop):
    block = Block(norm_topk_prob)
    [rc] = resolve_clusters(block, Cluster("experts", ["gate.weight"]))
    assert is_router(block.gate)
    assert route_around_dropped(block, [rc]) == 1
    assert route_around_dropped(block, [rc]) == 0  # idempotent
    h = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        block.gate.weight[drop] = 0.0
    _, scores, index = block.gate(h)
    kept = [e for e in range(5) if e not in drop]
    want_v, want_i = reference(block.gate.weight, h, kept, 2, norm_topk_prob is not False)
    k = want_i.shape[1]
    assert torch.equal(index[:, :k], want_i)
    torch.testing.assert_close(scores[:, :k].double(), want_v, rtol=1e-6, atol=1e-7)
    assert bool((scores[:, k:] == 0).all())  # top_k above the experts kept: the rest weigh exactly 0


def test_only_routers_whose_rows_are_cluster_units_are_hooked():
    block = Block(None)
    [rc] = resolve_clusters(block, Cluster("hidden", readers=["gate.weight"]))  # columns: no expert units
    assert route_around_dropped(block, [rc]) == 0
    assert not is_router(nn.Linear(4, 4))
