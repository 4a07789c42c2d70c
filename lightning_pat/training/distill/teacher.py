"""The teacher's copy and the logits in a forward output.

A teacher copied from the student is frozen (eval mode, ``requires_grad=False``, no hooks) and sharded like it when its
parameters are DTensors (:func:`~lightning_pat.parallel.teacher.sharded_frozen_copy`); the logits are found in, and
put back into, a forward output that is a tensor, a Hugging Face ``ModelOutput`` or a mapping.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, TypeGuard

from torch import Tensor, nn

from lightning_pat.parallel.teacher import HOOK_DICTS, has_dtensors, sharded_frozen_copy


def find_logits(output: Any) -> Tensor | None:
    """The logits in a forward output: the tensor itself, a ``logits`` attribute (HF ``ModelOutput``) or key."""
    if isinstance(output, Tensor):
        return output
    value = getattr(output, "logits", None)
    if value is None and isinstance(output, Mapping):
        value = output.get("logits")
    return value if isinstance(value, Tensor) else None


def replace_logits(output: Any, logits: Tensor) -> Any:
    """``output`` with its logits replaced (a ``ModelOutput`` in place, a plain mapping copied)."""
    if isinstance(output, Tensor):
        return logits
    if hasattr(output, "logits"):
        output.logits = logits  # a ModelOutput updates its mapping too
        return output
    return {**output, "logits": logits}


def frozen_copy(module: nn.Module, *, share: tuple[Any, ...] = ()) -> nn.Module:
    """A deep copy of ``module`` without hooks, in eval mode, with ``requires_grad=False``.

    Args:
        module: The module to copy.
        share: Objects referenced by the module that must not be copied (e.g. the Trainer).
    """
    memo: dict[int, Any] = {id(obj): obj for obj in share if obj is not None}
    for sub in module.modules():
        for attr in HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if hooks is not None:
                memo[id(hooks)] = OrderedDict()
    teacher = copy.deepcopy(module, memo)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def teacher_copy(student: nn.Module, *, share: tuple[Any, ...] = ()) -> nn.Module:
    """The default teacher: a frozen copy of ``student``, sharded like it if its parameters are DTensors."""
    if has_dtensors(student):
        return sharded_frozen_copy(student, share=share)
    return frozen_copy(student, share=share)


def is_sharded_entry(saved: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether a saved teacher is a sharded entry (``{"format": ...}``, see :func:`sharded_teacher_entry`)."""
    return isinstance(saved, Mapping) and isinstance(saved.get("format"), str)
