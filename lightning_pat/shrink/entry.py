r"""Physical shrink: cut the dropped units out of a model, so it becomes a smaller dense model of the same class.

Two layers, both usable on their own (both re-exported by :mod:`lightning_pat.shrink`):

* :class:`ShrinkPlan` (:func:`build_plan`, in :mod:`lightning_pat.shrink.plan`): per parameter, which indices
  survive on which dim. Pure data, built from resolved clusters and dropped unit indices.
* :func:`apply_plan` (in :mod:`lightning_pat.shrink.surgery`, with :mod:`lightning_pat.shrink.model_meta`): surgery.
  Every parameter in the plan is traced to the modules that own it (a tied tensor to all of them); each owner must
  be a module whose metadata the shrink knows how to rewrite: ``nn.Linear``, transformers ``Conv1D``,
  ``nn.Embedding`` (columns only), ``nn.LayerNorm``, ``nn.RMSNorm`` and Hugging Face ``*RMSNorm`` modules
  (``weight * x / rms(x)`` with ``variance_epsilon``). Attention modules (``q/k/v/o_proj`` with ``head_dim``;
  GPT-2's packed ``c_attn``) are checked to lose whole heads / whole query groups and get their head counts
  updated; MLP modules get ``intermediate_size``; ``model.config`` gets the new sizes where uniform. Everything is
  validated before the first tensor changes; the optimizer state can be sliced in the same pass
  (:func:`slice_optimizer_state`).

:func:`shrink` is the entry point: it reads the plan from a ``PruneResult``, a callback, the callback's state or a
Lightning checkpoint.

Parameters keep their identity: each shrunk ``nn.Parameter`` gets new (smaller, contiguous) data, so tied modules
stay tied and an optimizer keeps pointing at the right objects.

Norms over a shrunk residual: a dropped residual channel is exactly zero, but the norm divided by the full width
``d``. RMSNorm over the ``d'`` kept channels reproduces it with weight ``w * sqrt(d / d')`` and eps
``eps * d / d'`` (``nn.RMSNorm(eps=None)`` gets ``finfo(weight.dtype).eps * d / d'``), which :func:`apply_plan` does.
LayerNorm subtracts the mean over all ``d`` channels, zeros included, which no LayerNorm over ``d'`` channels can
reproduce: the shrink warns (``LayerNormShrinkWarning``); on the tiny GPT-2 models of the tests, shrinking 25/50/75%
of the residual changes the logits by about 17/40/80% relative (``python bench/bench_shrink.py --layernorm``, see
``BENCHMARKS.md``), so fine-tune after such a shrink.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.shrink import depth
from lightning_pat.shrink.plan import (
    ShrinkPlan,
    align_names,
    build_plan,
    checkpoint_state,
    read_source,
    state_source,
)
from lightning_pat.shrink.surgery import apply_plan

log = logging.getLogger(__name__)


def shrink(model: nn.Module, source: Any, *, inplace: bool = True) -> nn.Module:
    """Physically remove the dropped units of ``model``: a smaller dense model of the same class.

    ``shrunk(x)`` equals the masked model's output (RMSNorm residuals are rescaled; a LayerNorm residual warns
    because it cannot be exact). Dropped layer units (``preset_options={"layers": True}``) delete their layers and
    renumber the rest (``layer_idx``, ``config.num_hidden_layers`` and ``layer_types`` follow; see
    :mod:`lightning_pat.shrink.depth`). Module metadata (``in_features``/``out_features``, ``nf``, ``embedding_dim``,
    ``normalized_shape``, head counts, ``intermediate_size``, hidden sizes) and ``model.config`` (uniform values)
    are updated. Tied parameters stay one parameter.

    Args:
        model: The pruned model: the module the clusters were resolved against (a LightningModule), or the model it
            holds (a common name prefix of the clusters is then stripped).
        source: A ``PruneResult`` (from ``prune_clusters`` or ``Pruner.result()``), a ``CoupledPruningCallback``
            after ``fit``, the callback's ``state_dict()``, or a whole Lightning checkpoint dict.
        inplace: Shrink ``model`` itself (default: a large model is never held twice); if false, shrink a deep copy.

    Returns:
        The shrunk model (``model`` itself when ``inplace``).

    Raises:
        ValueError: Before anything changes, if the source holds no clusters, the plan does not match the model, a
            member belongs to a module the shrink cannot rewrite (the message names the parameter, the module type and
            the fix), an attention module would lose partial heads, or a dropped layer is not an element of an
            ``nn.ModuleList``.
        TypeError: If ``source`` is of an unknown type.

    Example::

        >>> from lightning_pat import Cluster, prune_clusters
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> res = prune_clusters(net, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]), 0.5)
        >>> small = shrink(net, res)
        >>> small[0], small[2]
        (Linear(in_features=4, out_features=4, bias=True), Linear(in_features=4, out_features=2, bias=True))
    """
    clusters, dropped = read_source(source)
    cut = depth.split_layers(clusters, dropped)
    if not cut.prefixes and already_shrunk(model, align_names(build_plan(cut.clusters, cut.dropped), model)):
        log.info(
            "shrink: the model already has the shrunk shapes (shrink_on_freeze cut it during fit); returned as it is"
        )
        return model if inplace else copy.deepcopy(model)
    target = model if inplace else copy.deepcopy(model)
    where = depth.locate(target, cut)  # validated before anything changes
    if where:
        depth.check_identity(target, cut)
    target = apply_plan(target, align_names(build_plan(cut.clusters, cut.dropped), target))
    depth.remove_layers(target, where)
    return target


def already_shrunk(model: nn.Module, plan: ShrinkPlan) -> bool:
    """Whether every parameter the plan cuts already has its shape after the cut (and the plan cuts something).

    What ``shrink_on_freeze`` leaves: the callback still holds the dropped units, the model is already small.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    if not plan.keep or any(name not in params for name in plan.keep):
        return False
    for name, dims in plan.keep.items():
        after = list(plan.shapes[name])
        for dim, idx in dims.items():
            after[dim] = idx.numel()
        if tuple(params[name].shape) != tuple(after) or tuple(after) == plan.shapes[name]:
            return False
    return True


# ---------------------------------------------------------------------------------------------------- during training
def shrink_for_training(
    module: nn.Module,
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, Sequence[int]],
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Shrink a model that is being trained, and its optimizers' state the same way (``shrink_on_freeze``).

    The parameters stay the same objects (with smaller data), so the optimizers' param groups stay valid; their
    state (momentum, Adam moments) keeps the kept indices, ``step`` counters are kept.

    Args:
        module: The module the clusters were resolved against (the LightningModule).
        clusters: The resolved clusters.
        dropped: The frozen mask: cluster name -> dropped unit indices.
        optimizers: The optimizers training ``module``.

    Raises:
        ValueError: As for :func:`apply_plan` (before anything changes).
    """
    apply_plan(module, build_plan(clusters, dropped), optimizers=optimizers)


def restore_shrunk(module: nn.Module, state: Mapping[str, Any]) -> bool:
    """Give a freshly built module the shapes a checkpoint written after ``shrink_on_freeze`` holds.

    Call it before loading the checkpoint's weights (the values are about to be overwritten, so no zero check).

    Args:
        module: The full-size module the clusters were resolved against.
        state: The callback's state, or a whole Lightning checkpoint dict.

    Returns:
        Whether the state records a shrink (and ``module`` was shrunk).

    Raises:
        ValueError: As for :func:`read_source` and :func:`apply_plan`.
    """
    if "callbacks" in state and "clusters" not in state:
        state = checkpoint_state(state)
    if not state.get("shrunk"):
        return False
    clusters, dropped = state_source(state, "the callback state")
    apply_plan(module, align_names(build_plan(clusters, dropped), module), check_zeros=False)
    return True
