"""Activation statistics and activation-aware unit scores (lightning_pat.scoring.activation) against plain float64 math.

The references below are written from the formula in the module docstring with plain torch (per-channel mean of
x^2 over all leading dims, an exponential average with the first batch as its start, and
``sqrt(sum_j E[x_j^2] * ||W[:, j]||^2)`` per unit), not with the library's helpers.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, prune_clusters, resolve_clusters
from lightning_pat.pruning.plan import make_plan
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.activation import ActivationStats, calibrate

MLP = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def ref_mean_sq(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().double()
    return (x * x).reshape(-1, x.shape[-1]).mean(dim=0)


def ref_ema(xs: list[torch.Tensor], beta: float | None) -> torch.Tensor:
    ema = None
    for i, x in enumerate(xs):
        m = ref_mean_sq(x)
        if ema is None:
            ema = m
        elif beta is None:
            ema = ema * i / (i + 1) + m / (i + 1)
        else:
            ema = beta * ema + (1 - beta) * m
    return ema


def ref_scores(weight: torch.Tensor, e_sq: torch.Tensor, num_units: int, start: int = 0) -> list[float]:
    w = weight.detach().double()
    block = (w.shape[1] - start) // num_units
    out = []
    for c in range(num_units):
        total = 0.0
        for j in range(start + c * block, start + (c + 1) * block):
            total += float(e_sq[j]) * float((w[:, j] ** 2).sum())
        out.append(total**0.5)
    return out


def test_training_forwards_update_an_exponential_average_and_nothing_else_does():
    model = mlp()
    stats = ActivationStats(model, resolve_clusters(model, MLP), beta=0.9)
    stats.attach()
    xs = [torch.randn(2, 5, 6) for _ in range(3)]  # leading dims (2, 5) are averaged over
    seen = []
    mine = model[2].register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    for x in xs:
        model(x)
    model.eval()
    model(torch.randn(4, 6) * 100)  # eval forward: not a training forward
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 6) * 100)  # no grad: not a training forward either
    got = stats.averages()["2"]
    want = ref_ema(seen[:3], 0.9)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # squares summed in float32
    assert got.dtype == torch.float64
    mine.remove()
    stats.detach()
    assert not model[2]._forward_pre_hooks
    model(torch.randn(4, 6))
    assert torch.equal(stats.averages()["2"], got)  # detached: no more updates


def test_unit_scores_with_blocks_and_two_readers_match_the_formula():
    torch.manual_seed(1)
    model = nn.ModuleDict({"a": nn.Linear(12, 5), "b": nn.Linear(6, 2), "w": nn.Linear(4, 12, bias=False)})
    # units of 3 channels in "a" (block 3), of 1 channel in the slice [2:6] of "b"
    cluster = Cluster("u", writers=["w.weight"], readers=["a.weight", "b.weight[2:6]"], num_units=4)
    resolved = resolve_clusters(model, cluster)
    stats = ActivationStats(model, resolved, beta=0.5)
    xa, xb = [torch.randn(7, 12) for _ in range(2)], [torch.randn(3, 6) for _ in range(2)]
    for x in xa:
        stats.observe("a", x)
    for x in xb:
        stats.observe("b", x)
    got = stats.unit_scores(dict(model.named_parameters()))["u"]
    ea, eb = ref_ema(xa, 0.5), ref_ema(xb, 0.5)
    sa = ref_scores(model["a"].weight, ea, 4)
    sb = ref_scores(model["b"].weight, eb, 4, start=2)
    want = [(x**2 + y**2) ** 0.5 for x, y in zip(sa, sb, strict=True)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_unit_scores_keep_the_unit_indices_per_layout_but_read_the_current_weights():
    """The channel -> unit indices of a reader are computed once per layout; the scores still follow the weights
    (bitwise those of fresh statistics, which compute the indices anew, and the formula's)."""
    torch.manual_seed(2)
    model = nn.ModuleDict({"a": nn.Linear(12, 5), "b": nn.Linear(6, 2), "w": nn.Linear(4, 12, bias=False)})
    cluster = Cluster("u", writers=["w.weight"], readers=["a.weight", "b.weight[2:6]"], num_units=4)
    resolved = resolve_clusters(model, cluster)
    stats = ActivationStats(model, resolved, beta=None)
    xa, xb = torch.randn(7, 12), torch.randn(3, 6)
    stats.observe("a", xa)
    stats.observe("b", xb)
    params = dict(model.named_parameters())
    first = stats.unit_scores(params)["u"]
    with torch.no_grad():
        model["a"].weight.mul_(3.0)
        model["b"].weight[:, 3] = 0.0
    again = stats.unit_scores(params)["u"]
    fresh = ActivationStats(model, resolved, beta=None)
    fresh.load_state_dict(stats.state_dict())
    assert torch.equal(again, fresh.unit_scores(params)["u"])
    assert not torch.equal(again, first)
    sa = ref_scores(model["a"].weight, ref_mean_sq(xa), 4)
    sb = ref_scores(model["b"].weight, ref_mean_sq(xb), 4, start=2)
    want = [(x**2 + y**2) ** 0.5 for x, y in zip(sa, sb, strict=True)]
    torch.testing.assert_close(again, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)


def test_summed_statistics_over_ranks_are_averaged_by_the_ranks_that_saw_each_module():
    model = mlp()
    stats = ActivationStats(model, resolve_clusters(model, MLP))
    x0, x1 = torch.randn(4, 8), torch.randn(4, 8)
    stats.observe("2", x0)
    mine = stats.stacked()
    other = ActivationStats(model, resolve_clusters(model, MLP))
    other.observe("2", x1)
    summed = mine + other.stacked()
    want = (ref_mean_sq(x0) + ref_mean_sq(x1)) / 2
    torch.testing.assert_close(stats.averages(summed)["2"], want, rtol=1e-6, atol=0)
    empty = ActivationStats(model, resolve_clusters(model, MLP)).stacked()
    assert torch.equal(stats.averages(mine + empty)["2"], stats.averages()["2"])  # an empty rank adds nothing


def test_state_dict_round_trip_is_exact():
    model = mlp()
    stats = ActivationStats(model, resolve_clusters(model, MLP))
    for _ in range(3):
        stats.observe("2", torch.randn(5, 8))
    again = ActivationStats(model, resolve_clusters(model, MLP))
    again.load_state_dict(stats.state_dict())
    assert torch.equal(again.averages()["2"], stats.averages()["2"])
    x = torch.randn(5, 8)
    stats.observe("2", x)
    again.observe("2", x)
    assert torch.equal(again.averages()["2"], stats.averages()["2"])
    with pytest.raises(ValueError, match=r"saved activation statistics of '2' have 3 channels, the module 8"):
        again.load_state_dict({"ema": {"2": torch.zeros(3, dtype=torch.float64)}})


def test_calibrate_then_prune_clusters_drops_the_lowest_activation_scores():
    model = mlp(3)
    batches = [torch.randn(16, 6) for _ in range(3)]
    with torch.no_grad():
        hidden = [torch.relu(model[0](b)) for b in batches]
    stats = calibrate(model, MLP, batches)
    assert not model[2]._forward_pre_hooks  # calibrate leaves no hook behind
    want_scores = ref_scores(model[2].weight, ref_ema(hidden, None), 8)
    want = sorted(sorted(range(8), key=lambda c: (want_scores[c], c))[:4])
    res = prune_clusters(model, MLP, 0.5, score="activation", activations=stats)
    assert res.dropped["h"] == want
    assert torch.all(model[0].weight[want] == 0)
    assert torch.all(model[2].weight[:, want] == 0)
    # the weight score would pick other units here (the test would not tell the scores apart otherwise)
    assert prune_clusters(mlp(3), MLP, 0.5, score="rms").dropped["h"] != want
    # score="auto" (the default) with statistics is the activation score; with calibration batches too
    assert prune_clusters(mlp(3), MLP, 0.5, activations=calibrate(mlp(3), MLP, batches)).dropped["h"] == want
    assert prune_clusters(mlp(3), MLP, 0.5, calibration=batches).dropped["h"] == want


def test_prune_clusters_activation_needs_statistics_and_nothing_is_mutated():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"score='activation' and `activations` go together"):
        prune_clusters(model, MLP, 0.5, score="activation")
    stats = calibrate(model, MLP, [torch.randn(2, 6)])
    with pytest.raises(ValueError, match=r"go together.*got score='rms' and activations=ActivationStats"):
        prune_clusters(model, MLP, 0.5, score="rms", activations=stats)
    with pytest.raises(ValueError, match=r"give `calibration` .* or `activations` .*, not both"):
        prune_clusters(model, MLP, 0.5, activations=stats, calibration=[torch.randn(2, 6)])
    with pytest.raises(ValueError, match=r"`calibration` feeds the activation score, but score='l2'"):
        prune_clusters(model, MLP, 0.5, score="l2", calibration=[torch.randn(2, 6)])
    with pytest.raises(ValueError, match=r"`calibration` must be a list of batches .* got Tensor"):
        prune_clusters(model, MLP, 0.5, calibration=torch.randn(2, 6))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_default_score_without_data_is_the_weight_score_and_says_so(caplog):
    batches = [torch.randn(16, 6) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="lightning_pat.pruning.api"):
        auto = prune_clusters(mlp(3), MLP, 0.5)
    assert auto.dropped == prune_clusters(mlp(3), MLP, 0.5, score="rms").dropped
    [record] = [r for r in caplog.records if "score='auto'" in r.getMessage()]
    assert "pass `calibration=" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_pat.pruning.api"):
        prune_clusters(mlp(3), MLP, 0.5, calibration=batches)
    assert not [r for r in caplog.records if "score='auto'" in r.getMessage()]


def test_errors_name_the_cluster_the_parameter_and_the_fix():
    model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "lin": nn.Linear(4, 4), "conv": nn.Conv1d(4, 2, 1)})
    with pytest.raises(ValueError, match=r"Cluster 'w': score='activation' .* only writers \['lin.weight'\]"):
        ActivationStats(model, resolve_clusters(model, Cluster("w", writers=["lin.weight"])))
    with pytest.raises(
        ValueError, match=r"Cluster 'r': .*reader 'emb.weight' is the `weight` of Embedding 'emb'.*weight score"
    ):
        ActivationStats(model, resolve_clusters(model, Cluster("r", writers=["lin.weight"], readers=["emb.weight"])))
    stats = ActivationStats(model, resolve_clusters(model, Cluster("ok", readers=["lin.weight"])))
    with pytest.raises(ValueError, match=r"Cluster 'ok': score='activation' has no statistics for reader 'lin.weigh"):
        stats.unit_scores(dict(model.named_parameters()))
    with pytest.raises(ValueError, match=r"`beta` must be None or a number in \[0, 1\), got 1.0"):
        ActivationStats(model, [], beta=1.0)


def test_a_tied_reader_is_found_through_its_linear_alias():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # [10, 4]: the head reads the 4 channels

    model = Tied()
    resolved = resolve_clusters(model, Cluster("res", readers=["emb.weight"]))
    stats = ActivationStats(model, resolved)
    assert list(stats.modules) == ["head"]


def test_pruner_without_scores_for_activation_raises():
    model = mlp()
    plan = make_plan(model, MLP, score="activation")
    pruner = Pruner(model, plan)
    with pytest.raises(ValueError, match=r"score='activation' needs precomputed unit scores: pass `scores=`"):
        pruner.select({"h": 0.5})
    with pytest.raises(ValueError, match=r"`scores` must hold one \[C\] tensor per cluster; missing \['h'\]"):
        pruner.select({"h": 0.5}, scores={})


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_not_counted_twice(reentrant):
    """Gradient checkpointing reruns the reader's forward inside the backward: the statistics must equal a plain run."""
    from torch.utils.checkpoint import checkpoint

    xs = [torch.randn(4, 6) for _ in range(3)]
    runs = {}
    for checkpointed in (False, True):
        model = mlp()
        stats = ActivationStats(model, resolve_clusters(model, MLP), beta=0.9)
        stats.attach()
        for x in xs:
            x = x.clone().requires_grad_(True)  # the reentrant variant needs an input that requires grad
            out = checkpoint(model, x, use_reentrant=reentrant) if checkpointed else model(x)
            out.sum().backward()
        runs[checkpointed] = (stats.averages()["2"], stats.state_dict()["count"])
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=0, atol=0)
    assert runs[True][1] == runs[False][1] == {"2": 3}


def test_a_residual_cluster_is_scored_by_its_linear_readers_only():
    """A cluster read by an embedding and by Linears (the residual stream) scores by the Linears' inputs (the norm
    outputs), the embedding left out; independent float64 reference."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, dtype=torch.float64)
            self.norm = nn.LayerNorm(4, dtype=torch.float64)
            self.up = nn.Linear(4, 6, dtype=torch.float64)
            self.head = nn.Linear(4, 10, bias=False, dtype=torch.float64)

        def forward(self, tokens):
            h = self.emb(tokens)
            h = h + self.up(self.norm(h))[..., :4]
            return self.head(self.norm(h))

    model = Net()
    cluster = Cluster("resid", writers=["norm.weight", "norm.bias"], readers=["emb.weight", "up.weight", "head.weight"])
    batches = [torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    stats = calibrate(model, cluster, batches)
    assert stats.unmeasured == {"resid": ["emb.weight"]}
    got = stats.unit_scores(dict(model.named_parameters()))["resid"]
    with torch.no_grad():  # the plain mean over batches of the per-batch mean of each input channel's square
        ups, heads = [], []
        for t in batches:
            h = model.emb(t)
            x_up = model.norm(h)
            h = h + model.up(x_up)[..., :4]
            x_head = model.norm(h)
            ups.append(x_up.reshape(-1, 4).square().mean(dim=0))
            heads.append(x_head.reshape(-1, 4).square().mean(dim=0))
        e_up, e_head = sum(ups) / 2, sum(heads) / 2
        want = (e_up * model.up.weight.square().sum(dim=0) + e_head * model.head.weight.square().sum(dim=0)).sqrt()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def _spy_norms(monkeypatch: pytest.MonkeyPatch, pruner: Pruner) -> list:
    """Record the ``names`` every executor's ``unit_sq_norms`` is asked for (the weight partials it computes)."""
    calls: list = []
    for cls in {type(ex) for ex in pruner.executors}:
        original = cls.unit_sq_norms

        def spy(self, names=None, _original=original):  # noqa: ANN001, ANN202 - calls through
            calls.append(None if names is None else sorted(names))
            return _original(self, names)

        monkeypatch.setattr(cls, "unit_sq_norms", spy)
    return calls


def test_a_data_aware_selection_computes_no_weight_norms_it_does_not_read(monkeypatch):
    """The activation score ranks every width cluster, so their unit norms are not computed (half of a selection's
    cost on a real model); the group lasso and layer units' weight-score fallback still get theirs, and the units
    selected are the reference's."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    torch.manual_seed(3)
    for p in model.parameters():
        nn.init.normal_(p)
    batches = [torch.randn(16, 6) for _ in range(3)]
    with torch.no_grad():
        hidden = [torch.relu(model[0](b)) for b in batches]
    layer = Cluster("block", writers=["2.weight", "2.bias"], num_units=1, budget="layers")
    stats = calibrate(model, MLP, batches)
    pruner = Pruner(model, make_plan(model, [MLP, layer], score="activation"))
    calls = _spy_norms(monkeypatch, pruner)

    actions = pruner.select({"h": 0.5, "block": 0.0}, evidence=stats)
    assert calls == [["block"]]  # only the layer unit's norms: its "rms" fallback
    want_scores = ref_scores(model[2].weight, ref_ema(hidden, None), 8)
    assert sorted(actions["h"].dropped.tolist()) == sorted(sorted(range(8), key=lambda c: (want_scores[c], c))[:4])

    calls.clear()
    pruner.select({"h": 0.5, "block": 0.0}, evidence=stats, scores={"block": torch.ones(1)})
    assert calls == [[]]  # the layer unit ranked by its given score: no norm at all
    calls.clear()
    pruner.select({"h": 0.5, "block": 0.0}, evidence=stats, method="group_lasso", threshold=0.1)
    assert calls == [None]  # the shrinkage acts on every unit's norm
