"""Latent checkpoint formats and the step tracker (lightning_pat._state), single process."""

from __future__ import annotations

import pytest
import torch

from lightning_pat import _state as S
from lightning_pat.latent import LatentStore


def test_latent_format_by_layout():
    plain = [torch.zeros(2)]
    assert S.latent_format(plain, fsdp1=False, sharded_ckpt=False) == "tensors"
    assert S.latent_format(plain, fsdp1=True, sharded_ckpt=False) == "per_rank"


@pytest.mark.parametrize("fmt", ["tensors", "per_rank"])
def test_latent_state_round_trip_is_a_copy(fmt):
    params = {"a": torch.nn.Parameter(torch.arange(6.0).view(2, 3)), "b": torch.nn.Parameter(torch.ones(3))}
    store = LatentStore(params, ["a", "b"])
    store.commit()  # creates the latents from the weights
    state = S.latent_state(store.state_dict(), params, fmt=fmt)
    with torch.no_grad():
        params["a"].add_(1.0)
        store.commit()  # puts the latent back: the weights hold the saved values again
    assert torch.equal(params["a"], torch.arange(6.0).view(2, 3))
    restored = LatentStore(params, ["a", "b"])
    restored.load_state_dict(S.saved_latents(state, params, ckpt_path=None))
    for name, latent in restored.state_dict().items():
        assert torch.equal(latent, store.state_dict()[name])
        assert latent.data_ptr() != store.state_dict()[name].data_ptr()


def test_latent_store_rejects_other_shapes():
    params = {"a": torch.nn.Parameter(torch.zeros(2, 3))}
    with pytest.raises(ValueError, match=r"latent of 'a' has shape \(3, 2\).*same parallel layout"):
        LatentStore(params, ["a"]).load_state_dict({"a": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"lack parameters \['a'\]"):
        LatentStore(params, ["a"]).load_state_dict({})


def test_step_tracker_counts_only_real_steps():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.25)
    tracker = S.StepTracker()
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


def test_progress_prox_step_per_mode_and_old_checkpoints():
    """Latent mode steps by the lr sum since warmup; direct mode by the lrs since the last selection."""
    from lightning_pat._state import Progress

    p = Progress()
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
    again = Progress.from_state(p.state_dict())
    assert again == p
    old = Progress.from_state({"step": 7, "gamma": 1.5})  # written before gamma_prox existed
    assert (old.step, old.gamma, old.gamma_prox, old.prox_step(latent=False)) == (7, 1.5, 1.5, 0.0)
    assert Progress.from_state({}) == Progress()
