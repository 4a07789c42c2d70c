"""The blended distillation loss written out by hand (imports nothing from ``lightning_pat``)."""

from __future__ import annotations

import torch
from torch import Tensor


def distill_term(student: Tensor, teacher: Tensor, *, alpha: float, temperature: float) -> Tensor:
    """``alpha * T^2 * mean_tokens sum_v p_t (log p_t - log p_s)`` with ``p = softmax(logits / T)``."""
    log_s = student / temperature - torch.logsumexp(student / temperature, dim=-1, keepdim=True)
    log_t = teacher / temperature - torch.logsumexp(teacher / temperature, dim=-1, keepdim=True)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=-1).mean()
    return alpha * temperature**2 * kl
