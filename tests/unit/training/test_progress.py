"""Where a run stands in steps (lightning_pat.training.progress): real optimizer steps and the prox step's lr sums."""

from __future__ import annotations

import torch

from lightning_pat.training.progress import Progress, StepTracker


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
    assert Progress.from_state(p.state_dict()) == p
    assert Progress.from_state({}) == Progress()
