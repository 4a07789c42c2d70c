"""``target_allocation`` of a training run: the size solved at the first selection from the run's own statistics.

References: the one-shot :func:`~lightning_pat.size_clusters` on the same weights and the same activation statistics
(its costs come from ``ActivationStats.unit_scores``, not from the selection's reduction), the solver called directly
with those costs, the shrunk model's ``numel``, and an uninterrupted run for the resume.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import CoupledPruningCallback, shrink, size_clusters
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from lightning_pat.presets import resolve_preset
from lightning_pat.pruning.api import plan_importance
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.plan import make_plan
from lightning_pat.sizing.targets import declaration_labels
from lightning_pat.training import per_step
from lightning_pat.training.controller import PruningController
from lightning_pat.training.errors import ConfigurationError

CFG = TinyGPTConfig(vocab_size=32, d_model=16, d_ff=32, n_head=4, n_kv_head=2, n_layer=2, max_seq_len=8)
TARGET = 0.75
WARMUP = 2  # the first selection, where the size is solved by importance, is step 3


def model() -> TinyGPT:
    """A TinyGPT whose MLPs add little to the residual stream: their channels are the cheap units to remove."""
    torch.manual_seed(0)
    net = TinyGPT(CFG).double()
    with torch.no_grad():
        for block in net.layers:
            block.mlp.down_proj.weight.mul_(0.02)
    return net


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len), generator=torch.Generator().manual_seed(step))


def options(**kw) -> PruningOptions:
    kw = {"clusters": "tiny_gpt", "target_params": TARGET, "warmup_steps": WARMUP, "ramp_steps": 3, **kw}
    return PruningOptions(**kw)


def bound(
    opts: PruningOptions, net: TinyGPT | None = None, **kw
) -> tuple[PruningController, TinyGPT, torch.optim.Optimizer]:
    net = model() if net is None else net
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ctl = PruningController(opts, **kw)
    ctl.bind(net, optimizers=[opt])
    return ctl, net, opt


def step(ctl: PruningController, net: TinyGPT, opt: torch.optim.Optimizer, t: int, before=None) -> None:
    """One real optimizer step of a plain loop; ``before(net)`` runs after the update, before the controller acts."""
    x = ids(t)
    opt.zero_grad()
    logits = net(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), x[:, 1:].reshape(-1)).backward()
    ctl.after_backward(opt)
    opt.step()
    if before is not None:
        before(net)
    ctl.after_step()


def test_importance_is_solved_at_the_first_selection_from_the_runs_statistics():
    """The widths equal size_clusters' on the same weights and statistics, differ from the fractions, and shrink
    to the reported count."""
    ctl, net, opt = bound(options(score="activation", target_allocation="importance"))
    ctl.start()
    at_bind = ctl.run.size
    assert at_bind is not None
    assert at_bind.rule == "fractions"  # the fit-start check of the size; not what the ramp goes towards
    seen = {}

    def reference(net: TinyGPT) -> None:  # the dense weights and the statistics the first selection sees
        if ctl.progress.step + 1 == WARMUP + 1:
            seen["sized"] = size_clusters(
                net,
                "tiny_gpt",
                target_params=TARGET,
                target_allocation="importance",
                activations=ctl.run.collectors.act,
            )
            plan = make_plan(net, resolve_preset("tiny_gpt", net), score="activation")
            seen["costs"] = plan_importance(
                net, plan, resolve_preset("tiny_gpt", net), activations=ctl.run.collectors.act
            )
            seen["plan"] = plan

    for t in range(1, WARMUP + 1):
        step(ctl, net, opt, t, before=reference)
        assert ctl.run.solved_at is None
        assert ctl.run.size == at_bind
    step(ctl, net, opt, WARMUP + 1, before=reference)
    size = ctl.run.size
    assert ctl.run.solved_at == WARMUP + 1
    assert size.rule == "importance"
    want = seen["sized"]
    assert size == want.size
    assert {c.name: c.target for c in want.clusters} == {
        "mlp.{layer}": ctl.resolved[0].target, "heads.{layer}": ctl.resolved[-1].target
    }  # fmt: skip
    # the solver called directly with the one-shot costs gives the same solution
    decls = resolve_preset("tiny_gpt", net)
    _, direct = seen["plan"].sized(
        dict(net.named_parameters(remove_duplicate=False)), TARGET, declarations=decls, importance=seen["costs"]
    )
    assert direct == size
    assert set(declaration_labels(dict(net.named_parameters()), decls).values()) == {"mlp", "heads"}
    # importance spends the size on the cheap MLP channels and keeps every head; fractions take a KV group
    assert (size.kept["heads"], at_bind.kept["heads"]) == (2, 1)
    assert size.kept["mlp"] < at_bind.kept["mlp"]
    for t in range(WARMUP + 2, 8):
        step(ctl, net, opt, t)
    assert ctl.frozen
    assert ctl.run.size == size
    dropped = ctl.dropped
    assert {n: len(v) for n, v in dropped.items()} == {
        rc.name: rc.num_units - size.cluster_kept[rc.name] for rc in ctl.resolved
    }  # fmt: skip
    small = shrink(copy.deepcopy(net), ctl.state_dict())
    assert sum(p.numel() for p in small.parameters()) == size.achieved


@pytest.mark.parametrize("score", ["taylor", "rms"])
def test_other_scores_solve_by_importance_from_their_own_scores(score):
    """The Taylor sums (or, with ``target_allocation="importance"``, a weight score) give the costs at the first
    selection; the shrunk model has the solution's count."""
    ctl, net, opt = bound(options(score=score, target_allocation="importance"))
    ctl.start()
    for t in range(1, 8):
        step(ctl, net, opt, t)
    size = ctl.run.size
    assert (size.rule, ctl.run.solved_at) == ("importance", WARMUP + 1)
    small = shrink(copy.deepcopy(net), ctl.state_dict())
    assert sum(p.numel() for p in small.parameters()) == size.achieved


def test_fractions_and_weight_scores_keep_the_fit_start_solution():
    """``"fractions"`` (and ``"auto"`` with a weight score) solve once, at fit start: no solve at the selection."""
    for opts in (options(target_allocation="fractions"), options(score="rms")):
        ctl, net, opt = bound(opts)
        ctl.start()
        at_bind = ctl.run.size
        for t in range(1, 7):
            step(ctl, net, opt, t)
        assert ctl.run.size == at_bind
        assert ctl.run.size.rule == "fractions"
        assert ctl.run.solved_at is None


def test_auto_allocates_by_importance_with_a_data_aware_score():
    assert options().sizing.allocation("activation") == "importance"
    assert options().sizing.allocation("taylor") == "importance"
    assert options().sizing.allocation("rms") == "fractions"
    assert options(target_allocation="importance").sizing.allocation("rms") == "importance"
    assert options(target_allocation="fractions").sizing.allocation("activation") == "fractions"


def test_the_log_names_the_rule_and_the_step_it_was_solved_at():
    lines: list[str] = []
    ctl, net, opt = bound(options(), info=lines.append)
    ctl.start()
    first = [line for line in lines if line.startswith("CoupledPruningCallback target_params: ")]
    assert len(first) == 1  # at fit start, and it says that it is not the allocation that counts
    assert "provisional (by fractions, only to check that the size is reachable" in first[0]
    assert "allocated by importance at the first selection, step 3," in first[0]
    for t in range(1, WARMUP + 2):
        step(ctl, net, opt, t)
    solved = [line for line in lines if "solved at step 3" in line]
    assert len(solved) == 1
    assert solved[0].startswith("CoupledPruningCallback target_params: ")
    assert "allocated by importance" in solved[0]


@pytest.mark.parametrize("stop", [WARMUP, WARMUP + 2], ids=["before-the-solve", "after-the-solve"])
def test_resume_keeps_the_solved_widths_or_solves_at_its_first_selection(stop, monkeypatch):
    """A resume after the solve keeps its widths and never solves again; one before it solves at its first selection;
    both end with the mask and weights of an uninterrupted run."""
    ref, ref_net, ref_opt = bound(options())
    ref.start()
    for t in range(1, 9):
        step(ref, ref_net, ref_opt, t)
    first, net, opt = bound(options())
    first.start()
    for t in range(1, stop + 1):
        step(first, net, opt, t)
    saved = first.state_dict()
    assert (saved["allocation"] is None) == (stop <= WARMUP)
    weights, opt_state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())

    solves = []
    original = per_step.allocate
    monkeypatch.setattr(per_step, "allocate", lambda *a, **kw: solves.append(kw["step"]) or original(*a, **kw))
    net2 = model()
    net2.load_state_dict(weights)
    lines: list[str] = []
    ctl, net2, opt2 = bound(options(), net=net2, info=lines.append)
    opt2.load_state_dict(opt_state)
    ctl.load_state_dict(saved)
    ctl.start(global_step=stop)
    if stop > WARMUP:
        assert ctl.run.size == first.run.size
        assert ctl.run.solved_at == WARMUP + 1
        assert any("solved at step 3 (the first selection), kept on resume" in line for line in lines)
    for t in range(stop + 1, 9):
        step(ctl, net2, opt2, t)
    assert solves == ([] if stop > WARMUP else [WARMUP + 1])
    assert ctl.run.size == ref.run.size
    assert ctl.dropped == ref.dropped
    assert [rc.target for rc in ctl.resolved] == [rc.target for rc in ref.resolved]
    for (name, a), b in zip(net2.state_dict().items(), ref_net.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"target_params": 0.7}, "target_params: 0.75 -> 0.7"),
        ({"target_allocation": "fractions"}, "'auto' -> 'fractions'"),
    ],
    ids=["target", "allocation"],
)
def test_a_resume_after_the_solve_refuses_another_size(edit, named):
    first, net, opt = bound(options())
    first.start()
    for t in range(1, WARMUP + 2):
        step(first, net, opt, t)
    saved = first.state_dict()
    ctl, _, _ = bound(options(**edit), net=copy.deepcopy(net))
    ctl.load_state_dict(saved)
    with pytest.raises(ConfigurationError, match=rf"solved by importance at step 3 .*{named}.*Resume with the saved"):
        ctl.start(global_step=WARMUP + 1)


def test_the_saved_allocation_is_checked():
    first, net, opt = bound(options())
    first.start()
    for t in range(1, WARMUP + 2):
        step(first, net, opt, t)
    saved = first.state_dict()
    ctl, _, _ = bound(options(), net=copy.deepcopy(net))
    ctl.load_state_dict({**saved, "allocation": {**saved["allocation"], "step": 9}})
    with pytest.raises(ValueError, match=r"`allocation.step` must be in \[1, 3\], got 9"):
        ctl.start(global_step=WARMUP + 1)


def test_a_bad_target_allocation_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"`target_allocation` must be one of \('auto', 'importance', 'fractions'\)"):
        PruningOptions(clusters="tiny_gpt", target_params=0.5, target_allocation="greedy")
    with pytest.raises(MisconfigurationException, match=r"`target_allocation` .* got 'by_size'"):
        CoupledPruningCallback("tiny_gpt", target_params=0.5, target_allocation="by_size")


def test_an_unreachable_size_is_refused_at_fit_start_with_importance(caplog):
    net = model()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match=r"target_params"):
        bound(options(target_params=10, target_allocation="importance"), net=net)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert not any("solved at step" in r.message for r in caplog.records if r.levelno >= logging.INFO)
