"""A checkpoint written after a ``shrink_on_freeze`` shrink, restored: the module given its small shapes first.

The weights of such a checkpoint have the small shapes, so a fresh (full-size) module must be cut to them before they
load; this module's one job is that moment (no Lightning here: the callback calls it through the controller, from
the hooks :mod:`lightning_pat.training.trainer_facts` installs):

* :func:`before_restore` on one device (and DDP): a load-state-dict pre-hook on the module, the shapes compared
  with the checkpoint's weights, :func:`~lightning_pat.shrink.restore_shrunk` when they differ;
* :func:`before_sharded_restore` under ``ModelParallelStrategy`` (FSDP2, tensor parallel): before the strategy
  loads the checkpoint (its ``meta.pt`` read without the weights), the sharded model laid out small
  (:func:`~lightning_pat.training.sharded_shrink.restore_shrunk_sharded`, the optimizers' param groups repointed).

Both keep, with distillation, a dense copy of the still full-size model to rebuild the teacher into
(:meth:`~lightning_pat.training.distill.Distiller.keep_skeleton`: the teacher is the dense model), and refuse a
checkpoint that predates the shrink of a module that was shrunk already. The rest of a resume (the state checked
and applied at fit start) is :mod:`lightning_pat.training.resume`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pat.core.saved_state import is_shrunk, split_distill
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.shrink import restore_shrunk
from lightning_pat.shrink.plan import read_saved
from lightning_pat.training.distill import Distiller
from lightning_pat.training.errors import WHO, ConfigurationError, prefixed
from lightning_pat.training.sharded_shrink import restore_shrunk_sharded


def before_restore(
    module: nn.Module,
    saved: Mapping[str, Any] | None,
    *,
    weights: Mapping[str, Any],
    distiller: Distiller | None,
    options: PruningOptions,
    shrunk: bool,
) -> tuple[list[ResolvedCluster], dict[str, list[int]]] | None:
    """Before a checkpoint's ``weights`` load into ``module``: reconcile the shapes of a ``shrink_on_freeze``.

    Returns:
        The saved clusters and dropped units when ``module`` was given the shrunk shapes of ``saved``, else ``None``.

    Raises:
        ConfigurationError: If the module cannot be shrunk to the saved shapes, or the checkpoint predates the
            shrink of this (``shrunk``) module.
    """
    body, distill = split_distill(saved or {})
    if distiller is not None and is_shrunk(body):  # a dense copy to rebuild the teacher into
        distiller.keep_skeleton(module, distill, options.distillation.module)
    differ = _shape_mismatches(module, weights)
    if not differ:
        return None
    if is_shrunk(body):  # a checkpoint written after the shrink: give the module its shapes
        with prefixed(f"{WHO}: cannot resume the shrunk model"):
            small = read_saved(body, "the callback state")  # the schema, once
            restore_shrunk(module, small)
        return list(small.clusters), dict(small.dropped)
    if shrunk:  # this module was shrunk; the checkpoint holds the full-size weights
        name, (mine, theirs) = next(iter(differ.items()))
        raise ConfigurationError(
            f"{WHO}(shrink_on_freeze=True): the checkpoint predates the shrink: it holds the "
            f"full-size weights ({name!r} of shape {theirs}), but this module was shrunk at the final ramp step "
            f"({name!r} is now {mine}; {len(differ)} tensor(s) differ). Evaluate that checkpoint on a fresh, "
            "full-size module (`trainer.validate(MyModule(), ckpt_path=...)`), pass a checkpoint written after the "
            "shrink, or omit `ckpt_path` to use the shrunk module's current weights."
        )
    return None


def before_sharded_restore(
    module: nn.Module,
    saved: Mapping[str, Any] | None,
    *,
    optimizers: Sequence[torch.optim.Optimizer],
    distiller: Distiller | None,
    options: PruningOptions,
    shrunk: bool,
) -> tuple[list[ResolvedCluster], dict[str, list[int]]] | None:
    """Before ``ModelParallelStrategy`` loads a checkpoint: give an FSDP2 model the shapes of a ``shrink_on_freeze``.

    The sharded counterpart of :func:`before_restore`: a distributed checkpoint is loaded into the module's current
    (sharded) state dict, so a checkpoint written after the shrink needs the small model first
    (:func:`~lightning_pat.training.sharded_shrink.restore_shrunk_sharded`, no communication; the optimizers' param
    groups repointed before their state loads). Every rank reads the same ``saved``, so every rank does the same.
    With distillation, the teacher stays the dense model: a copy sharded like the full-size student is kept first
    (:meth:`~lightning_pat.training.distill.Distiller.keep_skeleton`), and the saved teacher loads into it before
    the next batch.

    Returns:
        The saved clusters and dropped units when ``module`` was given the shrunk shapes of ``saved``, else ``None``.

    Raises:
        ConfigurationError: Before anything is loaded: if the module cannot be shrunk to the saved shapes, or if
            this module was shrunk and the checkpoint predates the shrink.
    """
    body, distill = split_distill(saved or {})
    if shrunk:  # the same Trainer's next fit: the module is small already
        if is_shrunk(body):
            return None
        raise ConfigurationError(
            f"{WHO}(shrink_on_freeze=True): the checkpoint predates the shrink: it holds the full-size weights, but "
            "this module was shrunk at the final ramp step. Evaluate that checkpoint on a fresh, full-size module "
            "(`trainer.validate(MyModule(), ckpt_path=...)`), pass a checkpoint written after the shrink, or omit "
            "`ckpt_path` to use the shrunk module's current weights."
        )
    if not is_shrunk(body):
        return None
    if distiller is not None:  # a dense copy, sharded like the full-size student, to rebuild the teacher into
        distiller.keep_skeleton(module, distill, options.distillation.module)
    with prefixed(f"{WHO}: cannot resume the shrunk model"):
        small = read_saved(body, "the callback state")
        restore_shrunk_sharded(module, list(small.clusters), small.dropped, optimizers=optimizers)
    return list(small.clusters), {name: list(units) for name, units in small.dropped.items()}


def _shape_mismatches(
    module: nn.Module, weights: Mapping[str, Any]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Name -> (the module's shape, the checkpoint's shape) of every tensor whose shapes differ."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        other = weights.get(name)
        if other is not None and hasattr(other, "shape") and tuple(other.shape) != tuple(tensor.shape):
            out[name] = (tuple(tensor.shape), tuple(other.shape))
    return out
