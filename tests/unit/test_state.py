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


def test_rank_activation_picks_this_rank_or_the_first():
    assert state.rank_activation(None) is None
    assert state.rank_activation([{"r": 0}, {"r": 1}]) == {"r": 0}  # one process: rank 0
    assert state.rank_activation([{"r": 7}]) == {"r": 7}


def test_resumed_options_refuse_what_cannot_take_effect():
    saved = {"warmup_steps": 2, "ramp_steps": 6, "target_sparsity": 0.5, "heal": True}
    with pytest.raises(ValueError, match=r"step 5 inside the ramp.*final ramp step at 4, already past"):
        state.check_resumed_options(saved, {**saved, "ramp_steps": 2}, step=5, final=False)
    with pytest.raises(ValueError, match=r"after the final ramp step, so its mask is frozen.*target_sparsity"):
        state.check_resumed_options(saved, {**saved, "target_sparsity": 0.7}, step=9, final=True)
    with pytest.warns(UserWarning, match=r"resuming at step 3 with changed options \(target_sparsity: 0.5 -> 0.7\)"):
        state.check_resumed_options(saved, {**saved, "target_sparsity": 0.7}, step=3, final=False)


def test_rank_activation_refuses_tensor_parallel_statistics_on_another_world_size():
    """Statistics split over input channels (a window after channel 0 exists) cannot move to another world size;
    statistics that cover every channel (DDP, FSDP2) can (each rank resumes some rank's statistics)."""
    ema = torch.ones(4, dtype=torch.float64)
    split = [
        {"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [0, 4]}},
        {"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [4, 4]}},
    ]
    with pytest.raises(ValueError, match=r"statistics of 2 rank\(s\) sharded by tensor parallelism.*this run has 1"):
        state.rank_activation(split)
    whole = [{"ema": {"down": ema}, "count": {"down": 1}, "window": {"down": [0, 4]}} for _ in range(2)]
    assert state.rank_activation(whole) is whole[0]
