"""Edit collection and validation of the shrink: what :func:`~lightning_pat.shrink.surgery.apply_plan` will change.

Every parameter in the plan is traced to the modules that own it (a tied tensor to all of them); each owner must be a
module whose metadata the surgery knows how to rewrite: ``nn.Linear``, transformers ``Conv1D``, ``nn.Embedding``
(columns only), ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face ``*RMSNorm`` modules, affine BatchNorms (their
running statistics are cut with their weight), and ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and ``GroupNorm``
(:mod:`lightning_pat.shrink.surgery_conv`). A module's coupled axes (an output channel and its bias) must be cut
identically, and a module between a cut writer and its reader that holds per-channel tensors of the cut width that no
member covers is refused (the shrunk model could not run). :func:`validate` runs these checks, the attention checks
(:mod:`lightning_pat.shrink.attention_checks`) and the optimizer-state checks
(:mod:`lightning_pat.shrink.optimizer_state`) before the first tensor changes; :func:`check_shrinkable` runs them on a
trial plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.heads import mha_refusal
from lightning_pat.shrink.attention_checks import check_attention
from lightning_pat.shrink.cuts import Edit
from lightning_pat.shrink.experts import EXPERT_DIMS, check_experts
from lightning_pat.shrink.mixers import MIXER_DIMS
from lightning_pat.shrink.model_meta import module_kind
from lightning_pat.shrink.optimizer_state import optimizer_cuts
from lightning_pat.shrink.plan import ShrinkPlan, align_names, build_plan
from lightning_pat.shrink.surgery_conv import CONV_DIMS, CONV_TIED_AXES, check_conv_edit

_FIX_MODULE = (
    "Remove this parameter from the cluster, or replace the module by one the shrink can rewrite (nn.Linear, "
    "transformers Conv1D, nn.Embedding, nn.LayerNorm, nn.RMSNorm, a Hugging Face *RMSNorm, an affine BatchNorm, "
    "nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, GroupNorm)."
)


# ---------------------------------------------------------------------------------------------------- module kinds


# (kind, attribute) -> dims that may be cut; (kind) -> the (attr, dim) pairs that must be cut identically
_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("linear", "weight"): (0, 1),
    ("linear", "bias"): (0,),
    ("conv1d", "weight"): (0, 1),
    ("conv1d", "bias"): (0,),
    ("embedding", "weight"): (1,),
    ("layernorm", "weight"): (0,),
    ("layernorm", "bias"): (0,),
    ("batchnorm", "weight"): (0,),
    ("batchnorm", "bias"): (0,),
    ("rmsnorm", "weight"): (0,),
    ("hf_rmsnorm", "weight"): (0,),
    ("mha", "in_proj_weight"): (0,),
    ("mha", "in_proj_bias"): (0,),
    ("window_attention", "relative_position_bias_table"): (1,),
    ("window_attention_v2", "logit_scale"): (0,),
    ("maxvit_attention", "relative_position_bias_table"): (1,),
    ("sinks_attention", "sinks"): (0,),  # one logit per query head (gpt-oss): cut with the head
    ("scale", "scale"): (0,),  # a module holding only a per-head scale (Inkling 2's ScaledL2Clip): cut with the head
    **CONV_DIMS,
    **EXPERT_DIMS,
    **MIXER_DIMS,
}
_TIED_AXES: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "linear": (("weight", 0), ("bias", 0)),  # output channel: row and bias
    "conv1d": (("weight", 1), ("bias", 0)),  # Conv1D weights are [in, out]
    "layernorm": (("weight", 0), ("bias", 0)),
    "batchnorm": (("weight", 0), ("bias", 0)),
    "mha": (("in_proj_weight", 0), ("in_proj_bias", 0)),
    **CONV_TIED_AXES,
}


def _holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Tensor id -> every ``(module name, module, attribute)`` that registers it as a parameter."""
    out: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                out.setdefault(id(param), []).append((mname, module, attr))
    return out


def full_name(mname: str, attr: str) -> str:
    """The dotted name of parameter ``attr`` of module ``mname`` (the model's own: ``attr``)."""
    return f"{mname}.{attr}" if mname else attr


def _collect_edits(model: nn.Module, plan: ShrinkPlan) -> tuple[dict[str, nn.Parameter], dict[int, Edit]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    holders = _holders(model)
    edits: dict[int, Edit] = {}
    for name, dims in plan.keep.items():
        if name not in params:
            raise ValueError(
                f"Shrink: parameter {name!r} of the plan is not a parameter of {type(model).__name__}; shrink the "
                "module the clusters were resolved against (e.g. the LightningModule, or pass its inner model and "
                "let the common prefix be stripped)."
            )
        param = params[name]
        if tuple(param.shape) != plan.shapes[name]:
            raise ValueError(
                f"Shrink: parameter {name!r} has shape {tuple(param.shape)}, the plan expects {plan.shapes[name]}; the "
                "model was already shrunk or is not the model the clusters were resolved against."
            )
        for mname, module, attr in holders[id(param)]:
            kind = module_kind(module)
            full = full_name(mname, attr)
            refusal = mha_refusal(module) if isinstance(module, nn.MultiheadAttention) else None
            if refusal is not None:
                raise ValueError(
                    f"Shrink: parameter {full!r} belongs to nn.MultiheadAttention {mname!r}, whose heads the shrink "
                    f"cannot cut: {refusal}. Remove it from the cluster."
                )
            if kind is None or (kind, attr) not in _DIMS:
                raise ValueError(
                    f"Shrink: parameter {full!r} is used by module {mname!r} of type {type(module).__name__} "
                    f"(attribute {attr!r}), which the shrink cannot rewrite. {_FIX_MODULE}"
                )
            bad = sorted(set(dims) - set(_DIMS[(kind, attr)]))
            if bad:
                raise ValueError(
                    f"Shrink: parameter {full!r} ({type(module).__name__}.{attr}) would lose indices on dim {bad[0]}, "
                    f"but only dims {_DIMS[(kind, attr)]} can be cut there (e.g. an embedding keeps its vocabulary). "
                    "Remove that member from the cluster."
                )
            edit = edits.setdefault(id(module), Edit(mname, module, kind, {}))
            edit.cuts[attr] = dims
    return params, edits


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.numel() == b.numel() and bool(torch.equal(a.cpu(), b.cpu()))


def _check_edit(edit: Edit) -> None:
    """A module's coupled axes (a Linear's rows and bias, a norm's weight and bias) must be cut identically."""
    check_conv_edit(edit.name, edit.module, edit.kind, edit.cuts)
    axes = _TIED_AXES.get(edit.kind)
    if axes is None:
        return
    (wa, wd), (ba, bd) = axes
    if getattr(edit.module, ba, None) is None:
        return
    w_cut = edit.cuts.get(wa, {}).get(wd)
    b_cut = edit.cuts.get(ba, {}).get(bd)
    if not _same(w_cut, b_cut):
        raise ValueError(
            f"Shrink: module {edit.name!r} ({type(edit.module).__name__}) would cut {wa} dim {wd} and {ba} "
            f"differently ({'kept ' + str(w_cut.numel()) if w_cut is not None else 'uncut'} vs "
            f"{'kept ' + str(b_cut.numel()) if b_cut is not None else 'uncut'}); list `{full_name(edit.name, ba)}` "
            f"in the same cluster as `{full_name(edit.name, wa)}` (an output channel and its bias go together)."
        )


def check_dropped_zeros(edits: Mapping[int, Edit], plan_names: Mapping[int, str]) -> None:
    """Warn if the dropped slices are not zero (then the shrunk model is not the model that was passed in)."""
    nonzero = []
    for edit in edits.values():
        for attr, dims in edit.cuts.items():
            param = edit.module._parameters[attr]
            if param is None or param.is_meta:
                continue
            for dim, kept in dims.items():
                mask = torch.ones(param.shape[dim], dtype=torch.bool)
                mask[kept] = False
                if mask.any() and bool(
                    param.detach().index_select(dim, mask.nonzero().flatten().to(param.device)).any()
                ):
                    nonzero.append(plan_names.get(id(param), full_name(edit.name, attr)))
    if nonzero:
        warnings.warn(
            f"shrink: dropped units of {sorted(set(nonzero))[:5]} are not zero in the model, so the shrunk model "
            "equals the masked model, not the one passed in. Shrink the model the pruning ran on (after `fit`, or "
            "with the checkpoint's weights loaded).",
            PruningWarning,
            stacklevel=3,
        )


# (kind) -> (attribute, dim) of the output channels a module writes, and of the input channels it reads
_WRITES: dict[str, tuple[str, int]] = {
    "linear": ("weight", 0), "conv1d": ("weight", 1), "conv": ("weight", 0), "conv_t": ("weight", 1),
}  # fmt: skip
_READS: dict[str, tuple[str, int]] = {
    "linear": ("weight", 1), "conv1d": ("weight", 0), "conv": ("weight", 1), "conv_t": ("weight", 0),
}  # fmt: skip


def _cut_width(edit: Edit, attr: str, dim: int) -> int:
    """The old length of ``attr``'s ``dim`` if the edit cuts it, else 0."""
    if dim not in edit.cuts.get(attr, {}):
        return 0
    param = edit.module._parameters[attr]  # noqa: SLF001 - the registered tensor itself
    assert param is not None  # a cut attribute holds a tensor
    return int(param.shape[dim])


def _check_between(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Refuse a module between a shrunk writer and its reader that holds a per-channel tensor nobody cuts.

    For every module whose output channels are cut (a writer), the next module in registration order whose input
    channels of the same width are cut is taken as its reader; any module registered in between, not rewritten by
    the shrink, that holds a 1-D parameter or buffer of that width (a BatchNorm's weight, bias and running
    statistics, a norm left out of a cluster) would keep the old width and fail at the first forward of the shrunk
    model.

    Raises:
        ValueError: Naming the module, its tensors and the fix.
    """
    order = [(name, m) for name, m in model.named_modules()]
    position = {id(m): i for i, (_, m) in enumerate(order)}
    reads: list[tuple[int, int]] = []  # (position, old input width) of every module whose input channels are cut
    writes: list[tuple[int, int, str]] = []  # (position, old output width, name) of every cut writer
    for edit in edits.values():
        pos = position[id(edit.module)]
        if edit.kind in _READS and (width := _cut_width(edit, *_READS[edit.kind])):
            reads.append((pos, width))
        if edit.kind in _WRITES and (width := _cut_width(edit, *_WRITES[edit.kind])):
            writes.append((pos, width, edit.name))
    for start, width, writer in writes:
        ends = [p for p, w in reads if p > start and w == width]
        if not ends:
            continue
        for name, module in order[start + 1 : min(ends)]:
            if id(module) in edits:
                continue
            own = {**module._parameters, **module._buffers}  # noqa: SLF001 - this module's own tensors only
            hit = [k for k, t in own.items() if t is not None and t.dim() == 1 and t.shape[0] == width]
            if hit:
                members = ", ".join(f"`{full_name(name, k)}`" for k in hit if k in module._parameters)  # noqa: SLF001
                raise ValueError(
                    f"Shrink: module {name!r} ({type(module).__name__}) sits between {writer!r}, whose {width} output "
                    f"channels are cut, and the module that reads them, and holds {hit} of width {width} that no "
                    f"cluster member covers; the shrunk model would fail at its first forward. Add its per-channel "
                    f"parameters ({members or 'none: make it affine or remove it'}) to the same cluster as 1-D "
                    "writers (a BatchNorm's running statistics are then cut with them), or leave this axis unpruned."
                )


def validate(
    model: nn.Module, plan: ShrinkPlan, optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[str, nn.Parameter], dict[int, Edit], list[list[tuple[Tensor, str]]]]:
    """Everything :func:`~lightning_pat.shrink.surgery.apply_plan` checks before the first tensor changes.

    Args:
        model: The module whose parameter names the plan uses.
        plan: The plan to apply.
        optimizers: Optimizers whose state would be sliced.

    Returns:
        Parameter name -> parameter, module id -> its :class:`Edit`, and per optimizer its ``(parameter, plan name)``
        pairs (see :func:`~lightning_pat.shrink.optimizer_state.optimizer_cuts`).

    Raises:
        ValueError: As for :func:`~lightning_pat.shrink.surgery.apply_plan`.
    """
    params, edits = _collect_edits(model, plan)
    for edit in edits.values():
        _check_edit(edit)
    check_attention(model, edits)
    check_experts(model, edits)
    _check_between(model, edits)
    return params, edits, [optimizer_cuts(opt, plan, params) for opt in optimizers]


def check_shrinkable(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> None:
    """Check, without changing anything, that a shrink of these clusters could rewrite ``model``.

    Used before training with ``shrink_on_freeze`` (the dropped units are not known yet): a trial plan drops the first
    unit of every cluster with more than one unit, which exercises every module type, every bias/weight pairing and
    every attention module the clusters touch.

    Args:
        model: The module the clusters were resolved against.
        clusters: The resolved clusters.

    Raises:
        ValueError: As for :func:`~lightning_pat.shrink.surgery.apply_plan`.
    """
    trial = {  # the first unit of every group (a cluster of balanced groups, see ResolvedCluster.unit_groups)
        rc.name: list(range(0, rc.num_units, rc.num_units // rc.unit_groups))
        for rc in clusters
        if rc.num_units > rc.unit_groups
    }
    validate(model, align_names(build_plan(clusters, trial), model), ())
