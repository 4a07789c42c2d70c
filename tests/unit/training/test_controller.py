"""PruningController without a Trainer: a plain torch loop drives it, checked against a hand-written reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, PruningWarning
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.controller import PruningController
from lightning_pat.training.errors import ConfigurationError

HIDDEN = [Cluster("hidden", writers=["0.weight", "0.bias"], readers=["2.weight"])]


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 3, generator=g, dtype=torch.float64)


def reference_drop(net: nn.Sequential, k: int) -> list[int]:
    """The k units with the lowest rms over (row of fc1.weight, fc1.bias entry, column of fc2.weight); ties by index."""
    sq = net[0].weight.detach().pow(2).sum(1) + net[0].bias.detach().pow(2) + net[2].weight.detach().pow(2).sum(0)
    rms = (sq / (6 + 1 + 3)).sqrt().tolist()
    return sorted(sorted(range(8), key=lambda u: (rms[u], u))[:k])


def run(ctl: PruningController, net: nn.Module, opt: torch.optim.Optimizer, steps: range, seen: list | None = None):
    """The loop a trainer runs: ``optimizer.step(closure)`` with the backward and the controller inside the closure."""
    results = {}
    for t in steps:
        x, y = batch(t)

        def closure(x=x, y=y) -> torch.Tensor:
            opt.zero_grad()
            if seen is not None:
                seen.append(net[0].weight.detach().clone())  # what the forward trains on
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            ctl.after_backward(opt)
            return loss

        opt.step(closure)
        results[ctl.progress.step] = ctl.after_step(count=True)
    return results


def options(**kw) -> PruningOptions:
    return PruningOptions(HIDDEN, **{"target_sparsity": 0.5, "warmup_steps": 1, "ramp_steps": 3, **kw})


def test_direct_mode_selects_the_reference_units_and_keeps_them_zero_while_healing():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    ctl = PruningController(options(mode="direct"))
    ctl.bind(net, optimizers=[opt])
    ctl.start()
    results = run(ctl, net, opt, range(1, 5))
    assert results[1] is None  # warmup: nothing happens, nothing is counted
    cubic = [round(8 * 0.5 * (1 - (1 - tau) ** 3)) for tau in (1 / 3, 2 / 3)]  # the ramp's targets after steps 2, 3
    assert [len(results[t].dropped["hidden"]) for t in (2, 3)] == cubic
    assert ctl.frozen
    assert results[4] is not None
    dropped = results[4].dropped["hidden"]
    assert len(dropped) == 4
    assert torch.count_nonzero(net[0].weight[dropped]) == 0
    assert torch.count_nonzero(net[2].weight[:, dropped]) == 0
    assert results[4].zeros["0.weight"] == 4 * 6
    healed = run(ctl, net, opt, range(5, 9))  # momentum and weight decay cannot revive the dropped units
    assert all(r.dropped == {"hidden": dropped} for r in healed.values())
    assert torch.count_nonzero(net[0].weight[dropped]) == 0
    assert torch.count_nonzero(net[0].bias[dropped]) == 0


def test_a_fresh_selection_equals_the_hand_computed_bottom_k():
    net = model(3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options(mode="direct", warmup_steps=0, ramp_steps=1, score="rms"))  # the reference
    ctl.bind(net, optimizers=[opt])
    ctl.start()
    x, y = batch(0)
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    ctl.after_backward(opt)
    opt.step()
    after_update = copy.deepcopy(net)  # the weights the selection scores (the projection happens after the step)
    result = ctl.after_step(count=False)
    assert result.dropped["hidden"] == reference_drop(after_update, 4)
    assert result.zeros == {}  # not counted


def test_latent_mode_never_shows_dense_weights_to_the_forward():
    """The closure rule: after the first selection, every forward inside optimizer.step(closure) sees the mask."""
    net = model(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ctl = PruningController(options(mode="latent", ramp_steps=4))
    ctl.bind(net, optimizers=[opt])
    ctl.start()
    seen: list[torch.Tensor] = []
    results = run(ctl, net, opt, range(1, 8), seen)
    for step in range(2, 7):  # the forward of step t+1 runs on the projection chosen after step t
        dropped = results[step].dropped["hidden"]
        assert dropped, step
        assert torch.count_nonzero(seen[step][dropped]) == 0, step
    assert ctl.run.latents is not None
    assert not ctl.run.latents.active


def test_micro_batches_without_an_optimizer_step_do_not_count():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options())
    ctl.bind(net, optimizers=[opt])
    ctl.start()
    x, y = batch(0)
    nn.functional.mse_loss(net(x), y).backward()
    ctl.after_backward(opt)
    assert ctl.after_step(count=True) is None
    assert ctl.progress.step == 0


@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_state_dict_round_trip_continues_exactly(mode):
    """Stop after step 3 (inside the ramp), restore into a fresh model and controller: equal to never stopping."""
    opts = options(mode=mode, ramp_steps=4)
    net, ref = model(), model()
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (net, ref))
    ctl, ref_ctl = PruningController(opts), PruningController(opts)
    for c, m, o in ((ctl, net, opt), (ref_ctl, ref, ref_opt)):
        c.bind(m, optimizers=[o])
        c.start()
    want = run(ref_ctl, ref, ref_opt, range(1, 9))
    got = run(ctl, net, opt, range(1, 4))
    saved = ctl.state_dict()
    assert set(saved) == {
        "step", "gamma", "gamma_prox", "dropped", "factors", "fingerprints", "clusters", "options", "latents",
        "shrunk", "activation", "taylor", "layer_scores", "allocation",
    }  # fmt: skip
    assert (saved["latents"] is not None) == (mode == "latent")
    weights, opt_state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    net2 = model(5)
    net2.load_state_dict(weights)
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.05)
    opt2.load_state_dict(opt_state)
    ctl2 = PruningController(opts)
    ctl2.bind(net2, optimizers=[opt2])
    ctl2.load_state_dict(saved)
    ctl2.start()
    got.update(run(ctl2, net2, opt2, range(4, 9)))
    assert {s: r.dropped for s, r in got.items() if r} == {s: r.dropped for s, r in want.items() if r}
    for a, b in zip(net2.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_state_of_other_clusters_is_refused():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options())
    ctl.bind(net, optimizers=[opt])
    saved = ctl.state_dict()
    other = PruningController(PruningOptions([Cluster("hidden", writers=["0.weight"], readers=["2.weight"])]))
    net2 = model()
    other.bind(net2, optimizers=[torch.optim.SGD(net2.parameters(), lr=0.1)])
    other.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"written for different clusters \(\['hidden'\] differ\)"):
        other.start()


class _Trainer:
    """A stand-in owner of fits (the controller keeps only a weak reference to it)."""


def test_begin_fit_continues_the_same_owner_and_refuses_a_resume_without_state():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options(mode="direct", ramp_steps=4))
    first, other = _Trainer(), _Trainer()
    ctl.bind(net, optimizers=[opt])
    with pytest.warns(PruningWarning, match=r"this fit ends after optimizer step 3, before the final ramp step 5"):
        ctl.begin_fit(owner=first, global_step=0, steps_left=3, ckpt_path=None, key="k")
    run(ctl, net, opt, range(1, 4))
    dropped = ctl.dropped
    ctl.end_fit(owner=first, global_step=3)
    ctl.bind(net, optimizers=[opt])  # the same trainer's next fit continues at step 3 with the same mask
    ctl.begin_fit(owner=first, global_step=3, steps_left=8, ckpt_path=None, key="k")
    assert (ctl.progress.step, ctl.dropped) == (3, dropped)
    ctl.end_fit(owner=first, global_step=3)
    ctl.bind(net, optimizers=[opt])
    with pytest.raises(ConfigurationError, match=r"resumes at global step 3 from 'x.ckpt', which holds no state under"):
        ctl.begin_fit(owner=other, global_step=3, steps_left=8, ckpt_path="x.ckpt", key="k")
    ctl.begin_fit(owner=other, global_step=0, steps_left=8, ckpt_path=None, key="k")  # a fresh trainer: step 0
    assert ctl.progress.step == 0


def test_counts_at_follows_the_logging_cadence_and_the_final_step():
    ctl = PruningController(options(warmup_steps=1, ramp_steps=3))  # final ramp step: 4
    assert [s for s in range(1, 9) if ctl.counts_at(s, every=3)] == [3, 4, 6]
    quiet = PruningController(options(log_metrics=False))
    assert not any(quiet.counts_at(s, every=1) for s in range(1, 9))


def test_the_routes_are_one_line_when_every_cluster_takes_the_same_path():
    """One device: every cluster materializes on plain tensors, said once (SmolLM2 printed 60 such lines)."""
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    clusters = [
        Cluster("a", writers=["0.weight", "0.bias"], readers=["2.weight"]),
        Cluster("b", writers=["2.weight", "2.bias"], readers=["4.weight"]),
    ]
    lines: list[str] = []
    ctl = PruningController(PruningOptions(clusters, target_sparsity=0.5, warmup_steps=1), info=lines.append)
    ctl.bind(net, optimizers=[torch.optim.SGD(net.parameters(), lr=0.1)])
    routes = [line for line in lines if "routes" in line]
    assert routes == ["CoupledPruningCallback routes 2 cluster(s): all materializing (plain tensors (not DTensors))"]
