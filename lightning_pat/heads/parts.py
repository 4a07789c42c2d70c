"""What every attention module of ours shares: taking over a stock module's hooks, the relative position index."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """``new`` takes over the hooks registered on ``old`` and its training flag."""
    for attr in (
        "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
    ):  # fmt: skip
        if attr in old.__dict__:
            new.__dict__[attr] = old.__dict__[attr]
    new.train(old.training)


def relative_index(wh: int, ww: int, device: torch.device | str | None) -> Tensor:
    """Index into the bias table of every (query, key) pair of a window, flattened (``N * N``)."""
    ys, xs = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[:, None] - ys[None, :] + (wh - 1)
    dx = xs[:, None] - xs[None, :] + (ww - 1)
    return (dy * (2 * ww - 1) + dx).flatten().to(device)
