r"""Module surgery: cut a model in place according to a :class:`~lightning_pat.shrink.plan.ShrinkPlan`.

:func:`apply_plan` first validates everything (:func:`lightning_pat.shrink.edits.validate`: the modules that own each
planned parameter and what may be cut there, :mod:`lightning_pat.shrink.edits`; whole heads and query groups,
:mod:`lightning_pat.shrink.attention_checks`; the optimizers' state, :mod:`lightning_pat.shrink.optimizer_state`),
then rewrites: every owner gets its parameters' new data and its metadata (``nn.Linear`` features, ``Conv1D``
``nx/nf``, embedding width, norm shapes, a BatchNorm's running statistics, the convolutions of
:mod:`lightning_pat.shrink.surgery_conv`); attention modules get their head counts updated, and
``nn.MultiheadAttention``, torchvision's Swin V1 and V2 window attention and MaxViT's attention are replaced by modules
of :mod:`lightning_pat.heads.replace` holding the same parameters (their stock forwards cannot run with fewer
heads); MLP modules get ``intermediate_size``; ``model.config`` gets the new sizes where uniform. The optimizer state
is sliced in the same pass (:func:`~lightning_pat.shrink.optimizer_state.slice_optimizer_state`). See
:mod:`lightning_pat.shrink` for the norms over a shrunk residual.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.heads import replace_attention
from lightning_pat.shrink import hf_entry
from lightning_pat.shrink.cuts import Edit
from lightning_pat.shrink.edits import check_dropped_zeros, validate
from lightning_pat.shrink.experts import EXPERT_KINDS, rewrite_experts, update_blocks
from lightning_pat.shrink.hf_entry import BASE_CONFIG_ATTR
from lightning_pat.shrink.mixers import MIXER_KINDS, rewrite_mixer
from lightning_pat.shrink.model_meta import (
    config_owners,
    head_counts_before,
    in_width,
    input_embedding,
    update_config,
    update_containers,
    update_head_counts,
)
from lightning_pat.shrink.optimizer_state import slice_optimizer_state
from lightning_pat.shrink.plan import ShrinkPlan
from lightning_pat.shrink.surgery_conv import CONV_KINDS, rewrite_conv

log = logging.getLogger(__name__)

#: Module kinds whose heads are cut by putting a module of :mod:`lightning_pat.heads.replace` in place.
REPLACED_KINDS = ("mha", "window_attention", "window_attention_v2", "maxvit_attention")


class LayerNormShrinkWarning(PruningWarning):
    """A LayerNorm lost channels: the shrunk model is not output-preserving (fine-tune after the shrink)."""


def _rescale_norm(edit: Edit, old: int, new: int) -> None:
    """RMSNorm over the kept channels of a zero-padded input: weight * sqrt(d/d'), eps * d/d'."""
    module: Any = edit.module  # nn.RMSNorm, or a transformers RMSNorm (variance_epsilon), not a type imported here
    ratio = old / new
    with torch.no_grad():
        module.weight.mul_(math.sqrt(ratio))
    if edit.kind == "hf_rmsnorm":
        module.variance_epsilon = module.variance_epsilon * ratio
    else:
        eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
        module.eps = eps * ratio


def _whole_groups(module: nn.Module, width: int) -> bool:
    """Whether a norm over groups of ``group_size`` channels (Mamba 2's gated norm) lost whole groups: no rescale."""
    size = getattr(module, "group_size", None)
    return isinstance(size, int) and size > 0 and width % size == 0


def _width(module: nn.Module) -> int:
    weight = module._parameters["weight"]  # noqa: SLF001 - a norm's own weight
    return int(weight.shape[0]) if weight is not None else 0


def _rewrite(edit: Edit, new_params: Mapping[int, Tensor]) -> None:
    """Give the module's parameters their new data and update its metadata (norms: rescale, see module docs)."""
    module: Any = edit.module  # its attributes by edit.kind, some of classes not imported here (Conv1D, HF norms)
    if edit.kind in (*REPLACED_KINDS, "sinks_attention", "scale"):  # replaced afterwards, or sinks / a scale only
        for attr in edit.cuts:
            param = module._parameters[attr]
            if param is not None and param.shape != new_params[id(param)].shape:
                param.data = new_params[id(param)]
        return
    if edit.kind in EXPERT_KINDS:
        rewrite_experts(edit, new_params)
        return
    if edit.kind in MIXER_KINDS:
        for attr in edit.cuts:
            param = module._parameters[attr]
            if param is not None and param.shape != new_params[id(param)].shape:
                param.data = new_params[id(param)]
        rewrite_mixer(module)
        return
    old_width = module.weight.shape[0]
    for attr in edit.cuts:
        param = module._parameters[attr]
        if param is not None and param.shape != new_params[id(param)].shape:  # a tied tensor is cut only once
            param.data = new_params[id(param)]
    w = module.weight
    if edit.kind == "linear":
        module.out_features, module.in_features = w.shape
    elif edit.kind == "conv1d":
        module.nx, module.nf = w.shape
    elif edit.kind == "embedding":
        module.embedding_dim = w.shape[1]
    elif edit.kind == "batchnorm":  # per-channel statistics go with the channels (exact: w = b = 0 when dropped)
        kept = edit.cuts["weight"][0]
        for stat in ("running_mean", "running_var"):
            buf = getattr(module, stat, None)
            if buf is not None:
                setattr(module, stat, buf.index_select(0, kept.to(buf.device)).contiguous())
        module.num_features = w.shape[0]
    elif edit.kind in CONV_KINDS:
        rewrite_conv(module, edit.kind, old_width)
    else:
        if hasattr(module, "normalized_shape"):
            module.normalized_shape = (w.shape[0],)
        if edit.kind in ("rmsnorm", "hf_rmsnorm") and not _whole_groups(module, w.shape[0]):
            _rescale_norm(edit, old_width, w.shape[0])


def _record_entry(owner: nn.Module) -> None:
    """Put the export entry on a Hugging Face model's config, so that its own ``save_pretrained`` can be reloaded."""
    if not hf_entry.is_hf(owner):
        return
    try:
        hf_entry.record(owner)
    except ValueError as err:  # the shrink itself is done; lightning_pat.save_pretrained raises this again
        log.warning("shrink: cannot describe the new sizes of %s in its config: %s", type(owner).__name__, err)


def apply_plan(
    model: nn.Module, plan: ShrinkPlan, *, optimizers: Sequence[torch.optim.Optimizer] = (), check_zeros: bool = True
) -> nn.Module:
    """Cut ``model`` in place according to ``plan`` (and the optimizers' state the same way).

    Args:
        model: The module whose parameter names the plan uses.
        plan: See :func:`~lightning_pat.shrink.plan.build_plan`.
        optimizers: Optimizers whose state is sliced with the parameters (see
            :func:`~lightning_pat.shrink.optimizer_state.slice_optimizer_state`).
        check_zeros: Warn if a dropped slice is not exactly zero (skipped on the meta device).

    Returns:
        ``model``, shrunk.

    Raises:
        ValueError: Before anything changes: if a planned parameter is missing or has another shape, is used by a
            module the shrink cannot rewrite or on a dim it cannot cut, a module's output channel and bias (or a
            norm's weight and bias) would be cut differently, an attention module would lose partial heads or
            partial query groups, or an optimizer holds state it cannot slice.
    """
    params, edits, cut_by_opt = validate(model, plan, optimizers)
    plan_names = {id(params[n]): n for n in plan.keep}
    if check_zeros:
        check_dropped_zeros(edits, plan_names)
    # ---- validated; mutate from here on
    owners = config_owners(model)
    for owner in owners:
        to_dict = getattr(owner.config, "to_dict", None)
        if callable(to_dict) and not hasattr(owner, BASE_CONFIG_ATTR):
            setattr(owner, BASE_CONFIG_ATTR, copy.deepcopy(to_dict()))
    embeddings = {id(m): input_embedding(m) for m in [model, *owners]}
    hidden_before = {k: e.embedding_dim for k, e in embeddings.items() if e is not None}
    for opt, cuts in zip(optimizers, cut_by_opt, strict=True):
        slice_optimizer_state(opt, plan, {n: p for p, n in cuts})
    new_params: dict[int, Tensor] = {}
    grads: dict[str, Tensor] = {}
    for name in plan.keep:
        param = params[name]
        new_params[id(param)] = plan.slice(name, param.detach())
        if param.grad is not None:
            grads[name] = plan.slice(name, param.grad)
            param.grad = None
    heads = head_counts_before(model, edits)
    reads_before = {key: in_width(e.module) for key, e in edits.items()}
    layernorms: list[str] = []
    rescaled_eps: dict[int, float] = {}  # both norms' eps is a float after _rescale_norm
    with torch.no_grad():
        for edit in edits.values():
            _rewrite(edit, new_params)
            if edit.kind == "layernorm":
                layernorms.append(edit.name)
            elif edit.kind in ("hf_rmsnorm", "rmsnorm") and _whole_groups(edit.module, _width(edit.module)):
                continue  # a grouped norm that lost whole groups keeps its eps
            elif edit.kind == "hf_rmsnorm":
                rescaled_eps[id(edit.module)] = cast(float, edit.module.variance_epsilon)
            elif edit.kind == "rmsnorm":
                rescaled_eps[id(edit.module)] = cast(float, edit.module.eps)
    for name, grad in grads.items():
        params[name].grad = grad
    replace_attention(model, [e.module for e in edits.values() if e.kind in REPLACED_KINDS])
    emb = embeddings[id(model)]
    update_containers(model, (hidden_before[id(model)], emb.embedding_dim) if emb is not None else None)
    update_head_counts(heads)
    update_blocks(model, edits)
    # (name, old, new input width); a module that read a width before still reads one
    reads = cast(
        "list[tuple[str, int, int]]",
        [(e.name, old, in_width(e.module)) for key, e in edits.items() if (old := reads_before[key]) is not None],
    )
    by_owner = _reads_by_owner(model, owners, reads)
    for owner in owners:
        emb = embeddings[id(owner)]
        changed = emb is not None and emb.embedding_dim != hidden_before[id(owner)]
        update_config(owner, rescaled_eps, changed, reads=by_owner[id(owner)])
        _record_entry(owner)
    if layernorms:
        warnings.warn(
            f"shrink: LayerNorm modules {layernorms[:3]} lost channels; LayerNorm subtracts the mean over the full "
            "width (pruned zeros included), which no smaller LayerNorm reproduces, so the shrunk model is NOT "
            "output-preserving (tiny GPT-2: 17/40/80% relative change of the logits at 25/50/75% of the residual). "
            "Fine-tune after the shrink, or do not prune the residual of LayerNorm models.",
            LayerNormShrinkWarning,
            stacklevel=2,
        )
    return model


def _reads_by_owner(
    model: nn.Module, owners: Sequence[nn.Module], reads: Sequence[tuple[str, int, int]]
) -> dict[int, list[tuple[str, int, int]]]:
    """Each config owner's cut readers: those under it and under no deeper owner; one under no owner counts for all.

    A multimodal model's encoders hold configs of their own (Phi-4-multimodal's vision and audio encoders), whose
    width fields must not follow the text model's cut.
    """
    names = {id(m): name for name, m in model.named_modules()}
    prefixes = {id(o): f"{names[id(o)]}." if names.get(id(o)) else "" for o in owners}
    out: dict[int, list[tuple[str, int, int]]] = {id(o): [] for o in owners}
    for read in reads:
        holders = [key for key, prefix in prefixes.items() if read[0].startswith(prefix)]
        deepest = max(holders, key=lambda key: len(prefixes[key]), default=None)
        for key in [deepest] if deepest is not None else list(out):
            out[key].append(read)
    return out
