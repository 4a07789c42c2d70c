"""Issue 23 (audit A4, B2, C8): a restored pruning state is checked against its schema before any of it is applied.

A state saved mid-ramp (latent mode, ``score="activation"``: latents, statistics and a mask) is edited the ways the
audit edited checkpoints; each edit must be refused by :meth:`PruningController.start` naming the field, with the
model's weights untouched (nothing applied), and never by an ``IndexError`` deep in the masking code. The unedited
state resumes, and the pure checker (:mod:`lightning_pat.core.state_schema`) is checked on its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.core.state_schema import StateContext, StateError, check_state
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.controller import PruningController

HIDDEN = [Cluster("hidden", writers=["0.weight", "0.bias"], readers=["2.weight"])]
STEPS = 2  # the state is saved after optimizer step 2 of warmup 1 + ramp 4: mid-ramp, 3 of 8 units dropped


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def options(**kw) -> PruningOptions:
    base = {"target_sparsity": 0.5, "warmup_steps": 1, "ramp_steps": 4, "score": "activation", "mode": "latent"}
    return PruningOptions(HIDDEN, **{**base, **kw})


def train(ctl: PruningController, net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(1000 + t)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        ctl.before_batch(first_of_epoch=False)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        ctl.after_backward(opt)
        opt.step()
        ctl.after_step()


@pytest.fixture(scope="module")
def saved():
    """(weights, state) after STEPS steps."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options())
    ctl.bind(net, optimizers=[opt])
    ctl.start()
    train(ctl, net, opt, range(1, STEPS + 1))
    state = ctl.state_dict()
    assert len(state["dropped"]["hidden"]) == 3
    assert state["latents"] is not None
    assert state["activation"] is not None
    return copy.deepcopy(net.state_dict()), state


def resume(saved, edit=None, *, global_step: int = STEPS, **kw):
    weights, state = saved
    state = copy.deepcopy(state)
    if edit is not None:
        edit(state)
    net = model(7)
    net.load_state_dict(weights)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ctl = PruningController(options(**kw))
    ctl.bind(net, optimizers=[opt])
    ctl.load_state_dict(state)
    before = copy.deepcopy(net.state_dict())
    return ctl, net, opt, before, global_step


def _set(path, value):
    def edit(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value

    return edit


def _rename_member(state):
    state["clusters"][0]["members"][0]["name"] = "2.weight"


def _kept_for_dropped(state):
    kept = [u for u in range(8) if u not in state["dropped"]["hidden"]]
    state["dropped"]["hidden"] = kept[:3]


def _extra_latent(state):
    state["latents"]["tensors"]["2.bias"] = torch.zeros(3)


def _long_latent(state):
    state["latents"]["tensors"]["0.weight"] = state["latents"]["tensors"]["0.weight"].long()


def _stats_of_a_missing_module(state):
    entry = state["activation"][0]
    entry["ema"]["9"] = torch.ones(8, dtype=torch.float64)
    entry["count"]["9"] = 1


# (id, edit of the state, message regex)
EDITS = [
    ("step-negative", _set(["step"], -5), r"`step` must be in \[0, 2\], got -5"),
    ("step-huge", _set(["step"], 10**6), r"`step` must be in \[0, 2\], got 1000000"),
    ("step-float", _set(["step"], 15.5), r"`step` must be an int, got float 15.5"),
    ("step-string", _set(["step"], "15"), r"`step` must be an int, got str '15'"),
    ("step-bool", _set(["step"], True), r"`step` must be an int, got bool True"),
    ("gamma-nan", _set(["gamma"], float("nan")), r"`gamma` must be finite, got nan"),
    ("gamma-prox-above-gamma", _set(["gamma_prox"], 99.0), r"`gamma_prox` must be in \[0\.0, 0\."),
    ("dropped-none", _set(["dropped"], None), r"`dropped` must be a mapping with str keys, got NoneType None"),
    (
        "dropped-tensor",
        _set(["dropped"], torch.tensor([1, 2])),
        r"`dropped` must be a mapping with str keys, got Tensor",
    ),
    (
        "dropped-indices-tensor",
        _set(["dropped", "hidden"], torch.tensor([1, 2, 3])),
        r"`dropped\['hidden'\]` must be a list, got Tensor",
    ),
    (
        "dropped-duplicate",
        _set(["dropped", "hidden"], lambda v: [*v, v[0]]),
        r"`dropped\['hidden'\]` holds the indices",
    ),
    (
        "dropped-float",
        _set(["dropped", "hidden"], [2.5]),
        r"`dropped\['hidden'\]` must hold int unit indices, got float",
    ),
    (
        "dropped-string",
        _set(["dropped", "hidden"], ["3"]),
        r"`dropped\['hidden'\]` must hold int unit indices, got str",
    ),
    ("dropped-bool", _set(["dropped", "hidden"], [True]), r"must hold int unit indices, got bool True"),
    ("dropped-out-of-range", _set(["dropped", "hidden"], [1, 2, 999]), r"holds unit indices \[999\] outside \[0, 8\)"),
    ("dropped-unknown-cluster", _set(["dropped", "nope"], [1]), r"`dropped` names clusters \['nope'\] that this run"),
    ("dropped-every-unit", _set(["dropped", "hidden"], list(range(8))), r"drops every one of the cluster's 8 units"),
    (
        "dropped-kept-units",
        _kept_for_dropped,
        r"dropped units of cluster 'hidden' .* are not zero in the weights",
    ),
    ("fingerprint-edited", _set(["fingerprints", "hidden"], "0" * 16), r"`fingerprints\[.hidden.\]` is .0000"),
    ("member-renamed", _rename_member, r"`fingerprints\['hidden'\]` is .* but the saved definition"),
    ("factors-shape", _set(["factors", "hidden"], torch.ones(3)), r"`factors\['hidden'\]` must have shape \(8,\)"),
    ("latents-extra", _extra_latent, r"unexpected \['2.bias'\]"),
    ("latents-dtype", _long_latent, r"`latents.tensors\['0.weight'\]` must be a floating-point tensor"),
    ("latents-shape", _set(["latents", "tensors", "0.weight"], torch.zeros(3, 3)), r"has shape \(3, 3\), the param"),
    ("latents-format", _set(["latents", "format"], "pickle"), r"`latents.format` must be one of"),
    ("activation-unknown-module", _stats_of_a_missing_module, r"`activation\[0\].ema` names reader modules \['9'\]"),
    (
        "activation-nan",
        _set(["activation", 0, "ema", "2"], lambda t: torch.full_like(t, float("nan"))),
        r"`activation\[0\].ema\['2'\]` holds non-finite values",
    ),
    ("activation-not-a-list", _set(["activation"], {"ema": {}}), r"`activation` must be a list"),
    ("options-type", _set(["options", "warmup_steps"], "1"), r"`options\['warmup_steps'\]` must be an int"),
    ("shrunk-type", _set(["shrunk"], "no"), r"`shrunk` must be a bool, got str 'no'"),
    ("unknown-entry", _set(["surprise"], 1), r"`state` has unknown entries \['surprise'\]"),
]


@pytest.mark.parametrize(("edit", "match"), [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_an_edited_state_is_refused_before_anything_is_applied(saved, edit, match):
    ctl, net, _, before, global_step = resume(saved, edit)
    with pytest.raises(ValueError, match=match) as caught:
        ctl.start(global_step=global_step)
    assert not isinstance(caught.value, IndexError)
    assert "CoupledPruningCallback: the checkpoint's pruning state" in str(caught.value) or "different" in str(
        caught.value
    )
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing applied


def test_the_unedited_state_resumes(saved):
    ctl, net, opt, _, global_step = resume(saved)
    ctl.start(global_step=global_step)
    assert ctl.progress.step == STEPS
    assert ctl.dropped == saved[1]["dropped"]
    train(ctl, net, opt, range(STEPS + 1, STEPS + 4))
    assert len(ctl.dropped["hidden"]) == 4  # the ramp ends at the target


def test_a_state_from_the_future_of_this_trainer_is_refused_but_an_earlier_one_is_fine(saved):
    ctl, *_ = resume(saved, global_step=1)
    with pytest.raises(ValueError, match=r"`step` must be in \[0, 1\], got 2"):
        ctl.start(global_step=1)
    ctl, *_ = resume(saved, global_step=10)  # e.g. optimizer steps the schedule did not count (AMP skipped)
    ctl.start(global_step=10)
    assert ctl.progress.step == STEPS


# ---------------------------------------------------------------------------------------------------- the pure checker
def test_check_state_alone_rebuilds_the_clusters_and_knows_their_sizes(saved):
    _, state = saved
    clusters = check_state(state)
    assert [rc.name for rc in clusters] == ["hidden"]
    with pytest.raises(StateError, match=r"outside \[0, 8\)"):
        check_state({**state, "dropped": {"hidden": [8]}})
    # without clusters nothing tells the sizes, but the types are still checked
    bare = {"step": 1, "dropped": {"x": [3, 1]}}
    assert check_state(bare) == []
    with pytest.raises(StateError, match=r"must hold int unit indices"):
        check_state({"step": 1, "dropped": {"x": [1.0]}})


def test_a_shared_budget_may_empty_one_cluster_but_not_itself():
    def cluster(name, budget):
        member = {"name": f"{name}.weight", "role": "writer", "dim": 0, "start": 0, "stop": 2, "block": 1,
                  "shape": [2, 3], "aliases": []}  # fmt: skip
        return {"name": name, "members": [member], "num_units": 2, "target": None, "multiple_of": 1, "budget": budget}

    from lightning_pat.core.spec import ResolvedCluster

    raw = [cluster("a", "b"), cluster("c", "b")]
    prints = {c["name"]: ResolvedCluster.from_dict(c).fingerprint() for c in raw}
    state = {"step": 1, "clusters": raw, "fingerprints": prints, "options": {"target_sparsity": 0.5}}
    check_state({**state, "dropped": {"a": [0, 1], "c": []}})  # the budget ranks jointly: one cluster may go
    with pytest.raises(StateError, match=r"drops every unit of budget 'b' \(4 units\)"):
        check_state({**state, "dropped": {"a": [0, 1], "c": [0, 1]}})
    check_state({**state, "options": {"target_sparsity": 1.0}, "dropped": {"a": [0, 1], "c": [0, 1]}})  # asked for


def test_the_scorers_entries_are_checked_by_their_owners_only():
    """Core reads no statistics: it checks them only through the checks a resume passes in (tests/unit/scoring/
    test_collector.py has the scorers' own), after the core entries, with the state's name."""
    bad = {"step": 0, "dropped": {}, "layer_scores": [{"sum": {}, "count": {"l.0": float("inf")}}], "taylor": "x"}
    assert check_state(bad) == []  # a shrink does not read them
    seen = []
    check_state(bad, context=StateContext(entries={"taylor": lambda raw, what: seen.append((raw, what))}))
    assert seen == [("x", "the checkpoint's pruning state")]

    def refuse(raw, what):
        raise StateError(f"{what}: `activation` refused")

    with pytest.raises(StateError, match=r"`step` must be an int"):  # the core entries first
        check_state({**bad, "step": "1"}, context=StateContext(entries={"activation": refuse}))
    with pytest.raises(StateError, match=r"^the checkpoint's pruning state: `activation` refused$"):
        check_state(bad, context=StateContext(entries={"activation": refuse}))  # called with None: nothing saved


def test_a_state_that_is_not_a_mapping_is_refused_when_loaded():
    ctl = PruningController(options())
    with pytest.raises(ValueError, match=r"the checkpoint's pruning state must be a mapping, got list"):
        ctl.load_state_dict([1, 2])


def test_checkpoint_callbacks_that_are_not_a_mapping_are_refused():
    from lightning_pat.shrink import checkpoint_state

    with pytest.raises(ValueError, match=r"the checkpoint's 'callbacks' entry must be a mapping, got list"):
        checkpoint_state({"state_dict": {}, "callbacks": ["CoupledPruningCallback{}"]})
