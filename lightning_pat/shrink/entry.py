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
  updated (``nn.MultiheadAttention`` and torchvision's Swin window attention are replaced by modules of
  :mod:`lightning_pat.heads.replace` holding the same parameters); MLP modules get ``intermediate_size``;
  ``model.config`` gets the new sizes where uniform. Everything is validated before the first tensor changes; the
  optimizer state can be sliced in the same pass (:func:`slice_optimizer_state`).

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

from lightning_pat.core.saved_state import SavedState, callback_state, is_checkpoint
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.shrink import depth, verify
from lightning_pat.shrink.plan import ShrinkPlan, align_names, build_plan, check_source_fits, read_saved, read_source
from lightning_pat.shrink.surgery import apply_plan

log = logging.getLogger(__name__)


def shrink(model: nn.Module, source: Any, *, inplace: bool = True, example_input: Any = "auto") -> nn.Module:
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
            after ``fit``, the callback's ``state_dict()``, a whole Lightning checkpoint dict, or a state already
            read from one (:func:`~lightning_pat.shrink.plan.read_saved`).
        inplace: Shrink ``model`` itself (default: a large model is never held twice); if false, shrink a deep copy.
        example_input: What the shrink checks its result on: ``forward``'s input (a tensor, a tuple of positional
            arguments or a dict of keyword arguments), or the :class:`~lightning_pat.Discovery` that found the
            clusters (its example input). ``"auto"`` (default): the model's ``example_input_array`` (a
            LightningModule's), if it has one; ``None``: no check. With an input, the masked model is run once
            before the surgery, a meta copy of the shrunk model is run before anything changes, and the shrunk model
            is run and compared with the masked one after (eval mode, no gradient, the RNG state restored; relative
            tolerance 1e-4 in float32, 2e-2 in half precision). A LayerNorm that loses channels cannot be exact (it
            warns), so then only that the shrunk model runs is checked.

    Returns:
        The shrunk model (``model`` itself when ``inplace``).

    Raises:
        ValueError: Before anything changes, if the source holds no clusters, a state or checkpoint does not fit its
            schema (:mod:`lightning_pat.core.state_schema`) or this model (a member missing or of another shape, two
            clusters on the same channels, a dropped unit that is not zero in the weights), the plan does not match
            the model, a member belongs to a module the shrink cannot rewrite (the message names the parameter, the
            module type and the fix), an attention module would lose partial heads, a dropped layer is not an element
            of an ``nn.ModuleList``, the example input does not fit the model's forward, or a meta copy of the shrunk
            model does not run (the message names the module that raised); after the surgery
            (:class:`~lightning_pat.shrink.verify.ShrinkCheckError`, a ``ValueError``), if the shrunk model does not
            run or its outputs differ from the masked model's (the message names the first module whose output
            differs).
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
    if isinstance(source, (Mapping, SavedState)):  # read from a file: it must belong to this model and its weights
        what = "the pruning state" if isinstance(source, Mapping) and "callbacks" not in source else None
        check_source_fits(model, clusters, dropped, what=what or "the checkpoint's pruning state")
    example = _example_input(model, example_input)
    target = model if inplace else copy.deepcopy(model)
    where = depth.locate(target, cut)  # validated before anything changes
    if where:
        depth.check_identity(target, cut)
    plan = align_names(build_plan(cut.clusters, cut.dropped), target)
    before = None
    if example is not None:
        example = verify.move(example, _device_of(target))
        before = verify.record(target, example)
        _dry_run(target, plan, where, example)
        exact = not _loses_layernorm_channels(target, plan)  # a LayerNorm cannot be exact (it warns)
    target = apply_plan(target, plan)
    depth.remove_layers(target, where)
    if before is not None:
        try:
            verify.compare(target, example, before, values=exact)
        except verify.ShrinkCheckError as err:
            state = "in place" if inplace else "as a copy"
            raise verify.ShrinkCheckError(
                f"shrink: {err} (checked on the example input; the model was shrunk {state} and is not usable). "
                "Leave the clusters whose members belong to that module out of the pruning, or report the model: "
                "discovery should not have offered them.",
                err.module,
            ) from err
    return target


def _example_input(model: nn.Module, example_input: Any) -> Any:
    if isinstance(example_input, str) and example_input == "auto":
        return getattr(model, "example_input_array", None)
    if hasattr(example_input, "left_out") and hasattr(example_input, "clusters"):  # a Discovery
        return getattr(example_input, "example_input", None)
    return example_input


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None and first.device.type != "meta" else torch.device("cpu")


def _loses_layernorm_channels(model: nn.Module, plan: ShrinkPlan) -> bool:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return any(
        isinstance(m, nn.LayerNorm) and any(names.get(id(p)) in plan.keep for p in m.parameters(recurse=False))
        for m in model.modules()
    )


def _dry_run(model: nn.Module, plan: ShrinkPlan, where: Mapping[str, Sequence[int]], example: Any) -> None:
    """Shrink a meta copy and run it (nothing allocated): a shrunk model that cannot run is refused unchanged."""
    if any(p.is_meta for p in model.parameters()):
        return
    twin = verify.meta_copy(model)
    apply_plan(twin, plan, check_zeros=False)
    depth.remove_layers(twin, where)
    failed = verify.runs_on_meta(twin, example)
    if failed is None or verify.runs_on_meta(verify.meta_copy(model), example) is not None:
        return  # it runs, or the model does not run on meta at all (then the check after the surgery decides)
    module, message = failed
    raise verify.ShrinkCheckError(
        f"shrink: a meta copy of the shrunk model does not run on the example input: {message}; nothing was changed. "
        "That module's forward holds a channel count of these clusters in an attribute or a literal, or reads the "
        "cut channels where they are not cut. Leave the clusters whose members belong to it out of the pruning.",
        module,
    )


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


def restore_shrunk(module: nn.Module, state: Mapping[str, Any] | SavedState) -> bool:
    """Give a freshly built module the shapes a checkpoint written after ``shrink_on_freeze`` holds.

    Call it before loading the checkpoint's weights (the values are about to be overwritten, so no zero check).

    Args:
        module: The full-size module the clusters were resolved against.
        state: The callback's state, a whole Lightning checkpoint dict, or a state already read
            (:func:`~lightning_pat.shrink.plan.read_saved`).

    Returns:
        Whether the state records a shrink (and ``module`` was shrunk).

    Raises:
        ValueError: As for :func:`read_source` and :func:`apply_plan`.
    """
    if not isinstance(state, SavedState):
        raw: Mapping[str, Any] = callback_state(state) if is_checkpoint(state) else state
        if not raw.get("shrunk"):
            return False
        state = read_saved(raw, "the callback state")
    if not state.shrunk:
        return False
    apply_plan(module, align_names(build_plan(state.clusters, state.dropped), module), check_zeros=False)
    return True
