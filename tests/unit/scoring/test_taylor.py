"""``score="taylor"``: per-unit sums of ``|w * g|`` over the real steps between selections, checked against an
independent float64 computation from the weights and gradients the optimizer really saw (captured at the
optimizer's step: the latent in latent mode, the live weight in direct mode; the accumulated gradient), with
gradient accumulation, a step the scaler skips, and resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.core.selection import num_to_drop
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.controller import PruningController

CLUSTER = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _unit_terms(model: nn.Sequential) -> torch.Tensor:
    """Independent float64: per hidden unit c, |W0[c,:] G0[c,:]| + |b0[c] gb0[c]| + |W2[:,c] G2[:,c]| (summed)."""
    w0, b0, w2 = model[0].weight, model[0].bias, model[2].weight
    return (
        (w0.detach() * w0.grad).abs().sum(dim=1)
        + (b0.detach() * b0.grad).abs()
        + (w2.detach() * w2.grad).abs().sum(dim=0)
    )


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)


def _run(
    mode: str,
    *,
    steps: int,
    accumulate: int = 1,
    skip: set[int] = frozenset(),
    ctl=None,
    model=None,
    opt=None,
    start: int = 0,
):  # noqa: ANN001, ANN202
    """A manual training loop around the controller; returns (ctl, model, opt, per-selection (captured, reference))."""
    if ctl is None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ctl = PruningController(PruningOptions(
            [CLUSTER], target_sparsity=0.5, warmup_steps=2, ramp_steps=3, every_n_steps=1, mode=mode, score="taylor",
        ))  # fmt: skip
        ctl.bind(model, optimizers=[opt])
        ctl.start()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ref = torch.zeros(12, dtype=torch.float64)
    original = ctl.run.pruner.step

    def spy(*args, evidence=None, **kwargs):  # noqa: ANN002, ANN003, ANN202 - calls through
        seen.append((evidence.shard_riders()["h"].clone(), ref.clone()))
        return original(*args, evidence=evidence, **kwargs)

    ctl.run.pruner.step = spy
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accumulate):  # gradient accumulation: the optimizer sees the sum of the micro-batches
            x, y = _batch(step, micro)
            (nn.functional.mse_loss(model(x), y) / accumulate).backward()
        ctl.after_backward(opt)
        if step in skip:  # the AMP scaler skipped this step: no optimizer step, nothing counts
            ctl.after_step()
            continue
        if not ctl.frozen:
            ref += _unit_terms(model)  # what the optimizer is about to apply, to the weights it applies it to
        opt.step()
        selects = ctl.schedule.action(ctl.progress.step + 1, heal=True) == "select"
        ctl.after_step()
        if selects:
            ref = torch.zeros(12, dtype=torch.float64)
    del ctl.run.pruner.step
    return ctl, model, opt, seen


@pytest.mark.parametrize("mode", ["direct", "latent"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_scores_are_the_sums_of_w_times_g_over_real_steps(mode, accumulate):
    ctl, model, _, seen = _run(mode, steps=7, accumulate=accumulate, skip={1, 3})
    assert len(seen) == 3  # the three ramp selections (steps 3, 4, 5 of the schedule)
    for got, want in seen:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # the selection is the lowest scores (ties by index) at the final step's target
    last = seen[-1][1]
    drop = num_to_drop(0.5, 12)
    assert ctl.dropped["h"] == sorted(torch.argsort(last, stable=True)[:drop].tolist())
    assert ctl.frozen
    if mode == "direct":  # a dropped unit's weights are zero: it scores 0 at the next selection
        first_dropped = set(ctl.run.pruner.result().dropped["h"])
        assert all(seen[-1][0][c] == 0 for c in first_dropped & set(ctl.dropped["h"]))


def test_resume_continues_the_sums_bitwise():
    full_ctl, full_model, _, full_seen = _run("latent", steps=7)
    ctl, model, opt, seen_a = _run("latent", steps=3)  # stops after the first selection
    saved = ctl.state_dict()
    assert saved["taylor"] is not None
    assert saved["taylor"][0]["steps"] == 0  # just reset by the selection at step 3
    ctl2, model2, opt2, _ = _run("latent", steps=2)  # a state mid-way between selections
    state_mid = ctl2.state_dict()
    assert state_mid["taylor"][0]["steps"] == 2
    # continue from the mid state in a fresh controller: the same scores as the uninterrupted run
    fresh = _model()
    fresh.load_state_dict(model2.state_dict())
    opt3 = torch.optim.SGD(fresh.parameters(), lr=0.05)
    opt3.load_state_dict(opt2.state_dict())
    ctl3 = PruningController(ctl2.options)
    ctl3.bind(fresh, optimizers=[opt3])
    ctl3.load_state_dict(state_mid)
    ctl3.start()
    _, model3, _, seen3 = _run("latent", steps=5, ctl=ctl3, model=fresh, opt=opt3, start=2)
    for (got, _), (want, _) in zip(seen3, full_seen, strict=True):
        assert torch.equal(got, want)
    assert ctl3.dropped == full_ctl.dropped
    for a, b in zip(model3.parameters(), full_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_selection_without_any_real_step_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = PruningController(
        PruningOptions([CLUSTER], target_sparsity=0.5, warmup_steps=0, ramp_steps=2, score="taylor", mode="direct")
    )
    ctl.bind(model, optimizers=[opt])
    ctl.start()
    ctl.run.collectors.taylor.reset()
    with pytest.raises(ValueError, match=r"score='taylor' has no gradient sums yet"):
        ctl.run.pruner.step({"h": 0.5}, evidence=ctl.run.collectors.taylor)


def test_prune_clusters_refuses_taylor():
    from lightning_pat import prune_clusters

    with pytest.raises(ValueError, match=r"score='taylor' sums \|w \* g\| over training steps"):
        prune_clusters(_model(), CLUSTER, 0.5, score="taylor")


def test_plain_sums_resume_on_another_world_size():
    """Plain parameters: every rank's sums are the same, so a checkpoint of 2 ranks resumes on 1 (entry 0)."""
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.taylor import TaylorScores

    model = _model()
    taylor = TaylorScores(Pruner(model, make_plan(model, CLUSTER, score="taylor")).executors)
    assert not taylor.sharded
    saved = [{"steps": 3, "sums": {"h": torch.arange(12, dtype=torch.float64)}}, {"steps": 3, "sums": {}}]
    taylor.load_state_dict(taylor.rank_entry(saved, rank=0, world=1))
    assert taylor.steps == 3
    assert torch.equal(taylor.sums["h"], torch.arange(12, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sums of cluster 'h' have shape \(3,\), the cluster 12 units"):
        taylor.load_state_dict({"steps": 1, "sums": {"h": torch.zeros(3)}})


def test_a_cluster_whose_members_have_no_gradient_is_refused_at_bind():
    """Frozen clustered weights (LoRA-style): |w * g| would stay 0 and the selection would drop units by index."""
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.pruning.pruner import Pruner
    from lightning_pat.scoring.taylor import TaylorScores

    model = _model()
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    before = [p.clone() for p in model.parameters()]
    ctl = PruningController(PruningOptions([CLUSTER], target_sparsity=0.5, warmup_steps=1, score="taylor"))
    match = r"cluster 'h' has no member with a gradient.*'0.weight', '0.bias', '2.weight'.*score='activation'"
    with pytest.raises(ValueError, match=match):
        ctl.bind(model, optimizers=[opt])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(ValueError, match=r"cluster 'h' has no member with a gradient"):
        TaylorScores(Pruner(model, make_plan(model, CLUSTER, score="taylor")).executors)
    model[2].weight.requires_grad_(True)  # one member with a gradient: its |w * g| scores the units
    TaylorScores(Pruner(model, make_plan(model, CLUSTER, score="taylor")).executors)
