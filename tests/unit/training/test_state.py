"""The state schema (lightning_pat.training.state): latent formats, progress, one spelling of every key."""

from __future__ import annotations

import pytest
import torch

from lightning_pat.training import state
from lightning_pat.training.controller import StepTracker
from lightning_pat.training.latent import LatentStore


def test_latent_format_by_layout():
    plain = [torch.zeros(2)]
    assert state.latent_format(plain, fsdp1=False, sharded_ckpt=False) == "tensors"
    assert state.latent_format(plain, fsdp1=True, sharded_ckpt=False) == "per_rank"


@pytest.mark.parametrize("fmt", ["local", "tensors", "per_rank"])
def test_latent_entry_round_trip(fmt):
    params = {"a": torch.nn.Parameter(torch.arange(6.0).view(2, 3)), "b": torch.nn.Parameter(torch.ones(3))}
    store = LatentStore(params, ["a", "b"])
    store.commit()  # creates the latents from the weights
    entry = state.latent_entry(store.state_dict(), params, fmt=fmt)
    with torch.no_grad():
        params["a"].add_(1.0)
        store.commit()  # puts the latent back: the weights hold the saved values again
    assert torch.equal(params["a"], torch.arange(6.0).view(2, 3))
    restored = LatentStore(params, ["a", "b"])
    restored.load_state_dict(state.read_latents(entry, params, ckpt_path=None))
    for name, latent in restored.state_dict().items():
        assert torch.equal(latent, store.state_dict()[name])
        assert latent.data_ptr() != store.state_dict()[name].data_ptr()  # loading copies


def test_latent_store_rejects_other_shapes():
    params = {"a": torch.nn.Parameter(torch.zeros(2, 3))}
    with pytest.raises(ValueError, match=r"latent of 'a' has shape \(3, 2\).*same parallel layout"):
        LatentStore(params, ["a"]).load_state_dict({"a": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"lack parameters \['a'\]"):
        LatentStore(params, ["a"]).load_state_dict({})


def test_step_tracker_counts_only_real_steps():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.25)
    tracker = StepTracker()
    tracker.attach([opt])
    assert not tracker.consume()
    p.grad = torch.ones(1)
    opt.step()
    assert tracker.consume()
    assert tracker.last_lr == 0.25
    assert not tracker.consume()
    tracker.detach()
    opt.step()
    assert not tracker.consume()


def test_progress_prox_step_per_mode_and_round_trip():
    """Latent mode steps by the lr sum since warmup; direct mode by the lrs since the last selection."""
    p = state.Progress()
    for lr in (0.5, 0.25):
        p.tick()
        p.add_lr(lr)
    assert (p.step, p.gamma) == (2, 0.75)
    assert p.prox_step(latent=True) == 0.75
    assert p.prox_step(latent=False) == 0.75
    p.mark_selection()
    p.tick()
    p.add_lr(0.125)
    p.add_lr(None)  # an unknown lr adds nothing
    assert p.prox_step(latent=True) == 0.875
    assert p.prox_step(latent=False) == 0.125
    assert state.Progress.from_state(p.state_dict()) == p
    assert state.Progress.from_state({}) == state.Progress()


def test_resumed_options_refuse_what_cannot_take_effect():
    saved = {"warmup_steps": 2, "ramp_steps": 6, "target_sparsity": 0.5, "heal": True}
    with pytest.raises(ValueError, match=r"step 5 inside the ramp.*final ramp step at 4, already past"):
        state.check_resumed_options(saved, {**saved, "ramp_steps": 2}, step=5, final=False)
    with pytest.raises(ValueError, match=r"after the final ramp step, so its mask is frozen.*target_sparsity"):
        state.check_resumed_options(saved, {**saved, "target_sparsity": 0.7}, step=9, final=True)
    with pytest.warns(UserWarning, match=r"resuming at step 3 with changed options \(target_sparsity: 0.5 -> 0.7\)"):
        state.check_resumed_options(saved, {**saved, "target_sparsity": 0.7}, step=3, final=False)


def _adam_run(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return net, torch.optim.Adam(net.parameters(), lr=0.1)


def test_optimizer_state_cannot_carry_latents_through_lightnings_sharded_load(tmp_path):
    """Why sharded latents travel as model-state entries (see state.py), not as ``optimizer.state[p]`` extra keys.

    Lightning's sharded load (``lightning.fabric.strategies.model_parallel._load_checkpoint``) reads each optimizer
    through a template from the live optimizer (``get_optimizer_state_dict``), built before any callback could add
    to it: a saved extra key is dropped without an error. Adding the key to the fresh optimizer first (the callback's
    ``on_fit_start`` runs before that load) makes torch skip its own state initialization, so the template loses
    Adam's moments and the load fails. If either changes in torch or Lightning, this test says so.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    net, opt = _adam_run()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.state[net[0].weight]["pat_latent"] = torch.full_like(net[0].weight, 7.0)
    saved = {"optimizer_0": get_optimizer_state_dict(net, opt)}
    assert "pat_latent" in saved["optimizer_0"]["state"]["0.weight"]  # written, sharded like the moments
    dcp.save(saved, checkpoint_id=tmp_path)

    fresh, fresh_opt = _adam_run()  # Lightning's load: the template comes from the live, fresh optimizer
    template = {"optimizer_0": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(template, checkpoint_id=tmp_path)
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=template["optimizer_0"])
    assert "pat_latent" not in fresh_opt.state[fresh[0].weight]  # silently dropped
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], opt.state[net[0].weight]["exp_avg"])

    seeded, seeded_opt = _adam_run()  # a template entry added first: torch no longer initializes the moments
    seeded_opt.state[seeded[0].weight]["pat_latent"] = torch.zeros_like(seeded[0].weight)
    template = {"optimizer_0": get_optimizer_state_dict(seeded, seeded_opt)}
    assert sorted(template["optimizer_0"]["state"]) == ["0.weight"]
    assert sorted(template["optimizer_0"]["state"]["0.weight"]) == ["pat_latent"]
    dcp.load(template, checkpoint_id=tmp_path)
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter"):
        set_optimizer_state_dict(seeded, seeded_opt, optim_state_dict=template["optimizer_0"])
