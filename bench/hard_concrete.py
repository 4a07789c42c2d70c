"""Hard-concrete gates and the Lagrangian sparsity term, for the ``gates*`` variants of ``bench_quality.py``.

Benchmark-side, not a library feature (issue 16: shipped as a ``method`` only if it wins beyond the seed spread).
Formulas (facts from the papers, code written here):

- Louizos, Welling, Kingma 2018, "Learning sparse neural networks through L0 regularization": the hard-concrete
  gate of a unit with parameter ``log_alpha``: ``u ~ U(0, 1)``,
  ``s = sigmoid((log u - log(1 - u) + log_alpha) / beta)``, ``z = clamp(s * (zeta - gamma) + gamma, 0, 1)``, with
  ``beta = 2/3``, ``gamma = -0.1``, ``zeta = 1.1``; ``P(z > 0) = sigmoid(log_alpha - beta * log(-gamma / zeta))``;
  at test time the deterministic gate ``clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)``.
- Xia et al. 2023, "Sheared LLaMA": the target is reached through a Lagrangian term
  ``lambda1 * (s_exp - s_t) + lambda2 * (s_exp - s_t)^2`` added to the loss, where ``s_exp`` is the expected pruned
  fraction and ``s_t`` the target (ramped up); the multipliers are trained by gradient *ascent* (so the term grows
  while the constraint is violated and the gates are pushed harder), the gates by descent.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1


def sample_gate(log_alpha: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    """One hard-concrete sample per entry of ``log_alpha`` (differentiable in ``log_alpha``)."""
    u = torch.rand(log_alpha.shape, generator=generator, dtype=log_alpha.dtype, device=log_alpha.device)
    u = u.clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((u.log() - (-u).log1p() + log_alpha) / BETA)
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def deterministic_gate(log_alpha: Tensor) -> Tensor:
    """The test-time gate ``clamp(sigmoid(log_alpha) * (zeta - gamma) + gamma, 0, 1)``."""
    return (torch.sigmoid(log_alpha) * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def prob_open(log_alpha: Tensor) -> Tensor:
    """``P(z > 0) = sigmoid(log_alpha - beta * log(-gamma / zeta))`` per gate."""
    return torch.sigmoid(log_alpha - BETA * math.log(-GAMMA / ZETA))


def expected_sparsity(log_alpha: Tensor) -> Tensor:
    """The expected fraction of closed gates (``z == 0``) of one cluster."""
    return 1.0 - prob_open(log_alpha).mean()


def ramped_target(step: int, *, target: float, ramp_steps: int) -> float:
    """The target pruned fraction at ``step``: linear from 0 to ``target`` over ``ramp_steps``, then held."""
    return target * min(step / max(ramp_steps, 1), 1.0)


def snap_top_k(log_alpha: Tensor, drop: int) -> tuple[list[int], list[int]]:
    """The exact cut of one cluster: keep the ``len - drop`` gates with the largest ``log_alpha``.

    Returns:
        ``(kept, dropped)``: sorted unit indices (ties: the lower index is kept, a stable sort).
    """
    n = log_alpha.numel()
    if not 0 <= drop <= n:
        raise ValueError(f"`drop` must be in [0, {n}], got {drop}.")
    order = torch.sort(log_alpha.detach().flatten(), descending=True, stable=True).indices.tolist()
    return sorted(order[: n - drop]), sorted(order[n - drop :])


class Lagrangian(nn.Module):
    """``lambda1 * (s - t) + lambda2 * (s - t)^2`` per cluster, the multipliers trained by gradient ascent.

    The multipliers are ordinary parameters (start at 0) whose gradient is negated by a hook, so any minimizing
    optimizer step on them *ascends* the term; give them their own param group (no weight decay).

    Args:
        names: The clusters (one pair of multipliers each).
    """

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = list(names)
        self.lambdas = nn.Parameter(torch.zeros(len(self.names), 2))
        self.lambdas.register_hook(lambda g: -g)

    def forward(self, expected: Tensor, target: float) -> Tensor:
        """The summed term for the clusters' expected pruned fractions ``expected`` (shape ``[len(names)]``)."""
        gap = expected - target
        return (self.lambdas[:, 0] * gap + self.lambdas[:, 1] * gap.pow(2)).sum()
