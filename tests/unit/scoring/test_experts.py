"""REAP and router-frequency scores of whole experts, against a float64 reference written here from the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_pat as lp
from lightning_pat.core.state_fields import StateError
from lightning_pat.scoring.experts import ExpertStats, expert_scores

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
    return {"frequency": counts, "reap_sum": sums}.get(kind, sums / counts.clamp(min=1))


@pytest.mark.parametrize("kind", ["reap", "reap_sum", "frequency"])
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
    res = lp.prune_clusters(model, clusters, 0.5, calibration=batches(), expert_score="reap")
    assert [res.dropped["experts.0"], res.dropped["experts.1"]] == want


@pytest.mark.parametrize("kind", ["reap_sum", "frequency"])
def test_prune_clusters_ranks_experts_by_expert_score(kind):
    model = tiny_mixtral()
    want = [sorted(torch.argsort(reference(model, layer, kind), stable=True)[:3].tolist()) for layer in range(2)]
    clusters = lp.presets.resolve_preset("moe", model, mlp=False, heads=False)
    if kind == "reap_sum":  # the default
        res = lp.prune_clusters(model, clusters, 0.5, calibration=batches())
    else:
        res = lp.prune_clusters(model, clusters, 0.5, calibration=batches(), expert_score=kind)
    assert [res.dropped["experts.0"], res.dropped["experts.1"]] == want


def test_prune_clusters_refuses_an_unknown_expert_score():
    choices = r"\('reap_sum', 'reap', 'frequency', 'weight'\)"
    with pytest.raises(ValueError, match=rf"`expert_score` must be one of {choices}, got 'mean'"):
        lp.prune_clusters(nn.Linear(2, 2), lp.Cluster("c", writers=["weight"]), 0.5, expert_score="mean")


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"`kind` must be one of \('reap', 'reap_sum', 'frequency'\), got 'norm'"):
        expert_scores(nn.Linear(2, 2), [], [], kind="norm")


def _stats(kind: str = "reap_sum"):
    model = tiny_mixtral()
    clusters = lp.resolve_clusters(model, lp.presets.resolve_preset("moe", model, mlp=False, heads=False))
    stats = ExpertStats(model, clusters, kind=kind)
    stats.attach()
    return model, stats


def _train_forward(model, batch) -> None:
    with torch.enable_grad():
        model(batch)


@pytest.mark.parametrize("kind", ["reap", "reap_sum", "frequency"])
def test_training_forwards_of_real_steps_give_the_calibration_scores(kind):
    model, stats = _stats(kind)
    first, second = batches()
    stats.begin_batch()
    _train_forward(model, first)
    stats.end_batch(stepped=False)  # accumulation: kept for the step that applies it
    assert stats.seen() == {}
    stats.begin_batch()
    _train_forward(model, second)
    stats.end_batch(stepped=True)
    _train_forward(model, first)  # eval mode outside a batch window: not a training forward
    with torch.no_grad():
        stats.begin_batch()
        model(first)  # no grad: not a training forward
        stats.end_batch(stepped=True)
    assert stats.seen() == {"experts.0": 2 * 2 * 9 * 2, "experts.1": 2 * 2 * 9 * 2}  # tokens x top-2
    got = stats.summed_scores()
    for layer in range(2):
        torch.testing.assert_close(got[f"experts.{layer}"], reference(model, layer, kind), rtol=1e-5, atol=1e-6)
    assert stats.summed_scores() is None  # the sums start again after a selection


def test_state_round_trips_exactly_and_is_checked():
    model, stats = _stats()
    stats.begin_batch()
    _train_forward(model, batches()[0])
    stats.end_batch(stepped=True)
    saved = stats.state_dict()
    _, fresh = _stats()
    fresh.load_saved([saved])
    assert fresh.state_dict() == saved
    assert torch.equal(fresh.stacked(), stats.stacked())
    fresh.check_saved([saved], "s")
    with pytest.raises(StateError, match=r"^s: `expert_scores\[0\].sum\['experts.0'\]` must hold 6 numbers"):
        fresh.check_saved([{"sum": {"experts.0": [1.0]}, "count": {}}], "s")
    with pytest.raises(StateError, match=r"^s: `expert_scores\[0\].count\['experts.0'\]` must be >= 0"):
        ExpertStats.check_layout([{"sum": {}, "count": {"experts.0": [-1.0]}}], "s")
    with pytest.raises(StateError, match=r"experts.9"):
        fresh.check_saved([{"sum": {"experts.9": [0.0] * 6}, "count": {}}], "s")


def test_an_unknown_kind_is_refused_by_the_collector():
    with pytest.raises(ValueError, match=r"`expert_score` must be one of \('reap', 'reap_sum', 'frequency'\)"):
        ExpertStats(nn.Linear(2, 2), [], kind="weight")  # type: ignore[arg-type]
