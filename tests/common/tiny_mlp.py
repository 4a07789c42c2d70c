"""A seeded 4 -> 8 -> 3 MLP, its hidden-channel cluster, and a check that a refused call changed nothing."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pat import Cluster

#: The hidden channels of :func:`tiny_mlp`: written by layer 0, read by layer 2.
H = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


def tiny_mlp(width: int = 8) -> nn.Sequential:
    """``Linear(4, width) -> ReLU -> Linear(width, 3)``, the same weights on every call (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s state equals ``before`` bitwise."""
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
