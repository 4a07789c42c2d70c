"""The distillation loss (``T^2 * mean_tokens KL(softmax(t / T) || softmax(s / T))``), its gradient, DistillGrad.

Pure tensor math (torch only, no module, no state): :class:`DistillGrad` is the identity forward on the student's
logits and adds the gradient of the distillation term backward (see :mod:`lightning_pat.training.distill`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def kl_grad(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``d(T^2 * mean_tokens KL(softmax(t/T) || softmax(s/T))) / ds`` = ``T * (softmax(s/T) - softmax(t/T)) / N``.

    ``N`` is the number of tokens (every dim but the last); computed in at least float32.
    """
    dtype = torch.promote_types(student.dtype, torch.float32)
    s = torch.softmax(student.to(dtype) / temperature, dim=-1)
    t = torch.softmax(teacher.to(dtype) / temperature, dim=-1)
    tokens = max(student.numel() // max(student.shape[-1], 1), 1)
    return (s - t) * (temperature / tokens)


def kl_value(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``mean_tokens KL(softmax(t/T) || softmax(s/T))`` (no ``T^2``), detached, in at least float32."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    with torch.no_grad():
        log_s = torch.log_softmax(student.detach().to(dtype) / temperature, dim=-1)
        log_t = torch.log_softmax(teacher.to(dtype) / temperature, dim=-1)
        kl = (log_t.exp() * (log_t - log_s)).sum(dim=-1)
    return kl.mean()


class DistillGrad(torch.autograd.Function):
    """Identity on the student's logits forward; backward adds ``scale * kl_grad(logits, teacher, T)``."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, teacher: Tensor, scale: float, temperature: float) -> Tensor:  # noqa: D102
        ctx.save_for_backward(logits, teacher)
        ctx.scale, ctx.temperature = scale, temperature
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: D102
        logits, teacher = ctx.saved_tensors
        extra = kl_grad(logits, teacher, ctx.temperature) * ctx.scale
        return grad + extra.to(grad.dtype), None, None, None
