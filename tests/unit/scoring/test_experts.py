"""REAP and router-frequency scores of whole experts, against a float64 reference written here from the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_pat as lp
from lightning_pat.scoring.experts import expert_scores

transformers = pytest.importorskip("transformers")


def tiny_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=6, num_experts_per_tok=2, vocab_size=32,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).eval()


def batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(2)]


def reference(model, layer: int, kind: str) -> torch.Tensor:
    """Per expert: mean over its routed tokens of g_e(x) * ||f_e(x)|| (reap), or the number of such tokens."""
    block = model.model.layers[layer].mlp
    seen = []
    handle = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().reshape(-1, 16)))
    with torch.no_grad():
        for batch in batches():
            model(batch)
    handle.remove()
    h = torch.cat(seen).double()
    router = block.gate.weight.detach().double()
    gate_up, down = block.experts.gate_up_proj.detach().double(), block.experts.down_proj.detach().double()
    top_v, top_i = torch.topk(torch.softmax(h @ router.T, dim=-1), 2, dim=-1)
    top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    sums, counts = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for t in range(h.shape[0]):
        for j in range(2):
            e = int(top_i[t, j])
            g, u = (gate_up[e] @ h[t]).chunk(2)
            sums[e] += top_v[t, j] * (down[e] @ (nn.functional.silu(g) * u)).norm()
            counts[e] += 1
    return counts if kind == "frequency" else sums / counts.clamp(min=1)


@pytest.mark.parametrize("kind", ["reap", "frequency"])
def test_expert_scores_match_the_reference(kind):
    model = tiny_mixtral()
    clusters = lp.resolve_clusters(model, lp.presets.resolve_preset("moe", model, mlp=False, heads=False))
    got = expert_scores(model, clusters, batches(), kind=kind)
    assert sorted(got) == ["experts.0", "experts.1"]
    for layer in range(2):
        torch.testing.assert_close(got[f"experts.{layer}"], reference(model, layer, kind), rtol=1e-5, atol=1e-6)


def test_prune_clusters_with_calibration_drops_the_lowest_reap_experts():
    model = tiny_mixtral()
    want = [sorted(torch.argsort(reference(model, layer, "reap"), stable=True)[:3].tolist()) for layer in range(2)]
    clusters = lp.presets.resolve_preset("moe", model, mlp=False, heads=False)
    res = lp.prune_clusters(model, clusters, 0.5, calibration=batches())
    assert [res.dropped["experts.0"], res.dropped["experts.1"]] == want


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"`kind` must be 'reap' or 'frequency', got 'norm'"):
        expert_scores(nn.Linear(2, 2), [], [], kind="norm")
