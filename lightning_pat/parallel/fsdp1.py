"""FSDP1 (``FSDPStrategy``) compatibility, in one place.

FSDP1 keeps parameters in flat shards between steps, under wrapped names (``_fsdp_wrapped_module.`` and the
other :data:`~lightning_pat.core.spec.WRAPPER_NAMES`). The controller works on full parameters by their unwrapped names
only while they are summoned (:func:`summoned_params`), writes its changes back on exit, and keeps latent copies of
every local flat shard (the ``per_rank`` latent format of :mod:`lightning_pat.training.state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_pat.core.spec import WRAPPER_NAMES


@contextmanager
def summon_full_params(root: torch.nn.Module) -> Iterator[None]:
    """Gather every flat parameter into full original parameters; write local changes back on exit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(root, writeback=True):
        yield


@contextmanager
def summoned_params(root: torch.nn.Module, module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """``module``'s full parameters by their unwrapped names while summoned (:func:`summon_full_params`)."""
    with summon_full_params(root):
        params: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            for wrapper in WRAPPER_NAMES:
                name = name.replace(f"{wrapper}.", "")
            params[name] = param
        yield params
