"""Walk the tensors of a forward's inputs and outputs (tensors inside tuples, lists and mappings), pure torch.

:func:`map_tensors` rebuilds a value with a function applied to every tensor in it, :func:`tensors_of` lists them;
used by discovery's trace and the shrink's check. The forward hooks that count training batches are in
:mod:`lightning_pat.scoring.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it; anything else is returned as it is.

    Tuples, lists and mappings are rebuilt (a mapping, a ``ModelOutput`` included, becomes a dict).
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [map_tensors(v, fn) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output, in order.

    Tensors, tuples, lists and mappings (a ``ModelOutput``) are walked; other objects (a key/value cache) are not
    outputs.
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []
