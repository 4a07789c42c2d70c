r"""Module surgery: cut a model in place according to a :class:`~lightning_pat.shrink.plan.ShrinkPlan`.

Every parameter in the plan is traced to the modules that own it (a tied tensor to all of them); each owner must be a
module whose metadata the surgery knows how to rewrite: ``nn.Linear``, transformers ``Conv1D``, ``nn.Embedding``
(columns only), ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face ``*RMSNorm`` modules affine BatchNorms (their
running statistics are cut with their weight), and ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d`` and ``GroupNorm``
(:mod:`lightning_pat.shrink.surgery_conv`). A module between a cut writer and its reader that holds per-channel
tensors of the cut width that no member covers is refused (the shrunk model could not run). Attention modules
(``q/k/v/o_proj`` with ``head_dim``; GPT-2's packed ``c_attn``) are checked to lose whole heads / whole query groups
and get their head counts updated; ``nn.MultiheadAttention`` and torchvision's Swin window attention are checked the
same way and replaced by modules of :mod:`lightning_pat.shrink.attention_modules` holding the same parameters (their
stock forwards cannot run with fewer heads); MLP modules get ``intermediate_size``; ``model.config`` gets the new sizes
where uniform. Everything is validated before the first tensor changes; the optimizer state is sliced in the same pass
(:func:`slice_optimizer_state`). See :mod:`lightning_pat.shrink` for the norms over a shrunk residual.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.shrink import hf_entry
from lightning_pat.shrink.attention_modules import mha_refusal, replace_attention
from lightning_pat.shrink.hf_entry import BASE_CONFIG_ATTR
from lightning_pat.shrink.model_meta import (
    config_owners,
    head_counts_before,
    input_embedding,
    is_gpt2_attention,
    is_llama_attention,
    module_kind,
    update_config,
    update_containers,
    update_head_counts,
)
from lightning_pat.shrink.plan import ShrinkPlan, align_names, build_plan
from lightning_pat.shrink.surgery_conv import CONV_DIMS, CONV_KINDS, CONV_TIED_AXES, check_conv_edit, rewrite_conv

log = logging.getLogger(__name__)

_FIX_MODULE = (
    "Remove this parameter from the cluster, or replace the module by one the shrink can rewrite (nn.Linear, "
    "transformers Conv1D, nn.Embedding, nn.LayerNorm, nn.RMSNorm, a Hugging Face *RMSNorm, an affine BatchNorm, "
    "nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, GroupNorm)."
)


class LayerNormShrinkWarning(PruningWarning):
    """A LayerNorm lost channels: the shrunk model is not output-preserving (fine-tune after the shrink)."""


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
    **CONV_DIMS,
}
_TIED_AXES: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "linear": (("weight", 0), ("bias", 0)),  # output channel: row and bias
    "conv1d": (("weight", 1), ("bias", 0)),  # Conv1D weights are [in, out]
    "layernorm": (("weight", 0), ("bias", 0)),
    "batchnorm": (("weight", 0), ("bias", 0)),
    "mha": (("in_proj_weight", 0), ("in_proj_bias", 0)),
    **CONV_TIED_AXES,
}


@dataclass
class _Edit:
    """The cuts of one module: attribute -> dim -> kept indices."""

    name: str
    module: nn.Module
    kind: str
    cuts: dict[str, dict[int, Tensor]]


def _holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """Tensor id -> every ``(module name, module, attribute)`` that registers it as a parameter."""
    out: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                out.setdefault(id(param), []).append((mname, module, attr))
    return out


def _full_name(mname: str, attr: str) -> str:
    return f"{mname}.{attr}" if mname else attr


def _collect_edits(model: nn.Module, plan: ShrinkPlan) -> tuple[dict[str, nn.Parameter], dict[int, _Edit]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    holders = _holders(model)
    edits: dict[int, _Edit] = {}
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
            full = _full_name(mname, attr)
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
            edit = edits.setdefault(id(module), _Edit(mname, module, kind, {}))
            edit.cuts[attr] = dims
    return params, edits


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.numel() == b.numel() and bool(torch.equal(a.cpu(), b.cpu()))


def _check_edit(edit: _Edit) -> None:
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
            f"{'kept ' + str(b_cut.numel()) if b_cut is not None else 'uncut'}); list `{_full_name(edit.name, ba)}` "
            f"in the same cluster as `{_full_name(edit.name, wa)}` (an output channel and its bias go together)."
        )


# ---------------------------------------------------------------------------------------------------- attention
def _kept(edits: Mapping[int, _Edit], module: nn.Module, attr: str, dim: int, length: int) -> Tensor:
    edit = edits.get(id(module))
    idx = None if edit is None else edit.cuts.get(attr, {}).get(dim)
    return torch.arange(length) if idx is None else idx.cpu()


def _whole_heads(kept: Tensor, head_dim: int, where: str) -> Tensor:
    """Kept head indices, if ``kept`` channels form whole heads; else a ``ValueError``."""
    if kept.numel() % head_dim:
        raise ValueError(f"{where}: {kept.numel()} kept channels are not whole heads of head_dim {head_dim}.")
    blocks = kept.view(-1, head_dim)
    heads = blocks[:, 0] // head_dim
    if not torch.equal(blocks, heads[:, None] * head_dim + torch.arange(head_dim)):
        raise ValueError(f"{where}: the kept channels split heads of head_dim {head_dim}.")
    return heads


def _check_llama_attention(name: str, attn: nn.Module, edits: Mapping[int, _Edit]) -> None:
    hd = attn.head_dim
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    fix = (
        "prune attention with a heads cluster (whole heads / whole GQA query groups: q, k, v rows and o columns; or "
        "GQA query heads: q rows and o columns, the same number in every KV group)"
    )
    try:
        q_heads = _whole_heads(_kept(edits, q, "weight", 0, q.out_features), hd, f"{where}, q_proj rows")
        k_heads = _whole_heads(_kept(edits, k, "weight", 0, k.out_features), hd, f"{where}, k_proj rows")
        v_heads = _whole_heads(_kept(edits, v, "weight", 0, v.out_features), hd, f"{where}, v_proj rows")
        o_heads = _whole_heads(_kept(edits, o, "weight", 1, o.in_features), hd, f"{where}, o_proj columns")
    except ValueError as err:
        raise ValueError(f"{err} {fix[0].upper()}{fix[1:]}.") from err
    if q_heads.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0 (a per-cluster `target`), or fewer units in a shared budget."
        )
    num_kv = k.out_features // hd
    n_rep = (q.out_features // hd) // num_kv
    if torch.equal(q_heads, o_heads) and k_heads.numel() == v_heads.numel() == num_kv:
        per_group = torch.bincount(q_heads // n_rep, minlength=num_kv)  # query heads inside the KV groups
        if bool((per_group == per_group[0]).all()):
            return
        raise ValueError(
            f"{where}: kept query heads {q_heads.tolist()} keep {per_group.tolist()} heads of the {num_kv} KV groups "
            f"(n_rep={n_rep}); a Llama attention needs the same number in every group. Select query heads with "
            "`unit_groups` set to the KV head count (the presets' query-head units do)."
        )
    groups = (q_heads // n_rep).unique_consecutive()
    expected_q = (groups[:, None] * n_rep + torch.arange(n_rep)).flatten()
    if not (torch.equal(q_heads, o_heads) and torch.equal(k_heads, v_heads)) or not (
        torch.equal(q_heads, expected_q) and torch.equal(groups, k_heads)
    ):
        raise ValueError(
            f"{where}: kept query heads {q_heads.tolist()}, o heads {o_heads.tolist()}, kv heads k "
            f"{k_heads.tolist()} / v {v_heads.tolist()} do not keep whole query groups (n_rep={n_rep}); {fix}."
        )


def _check_gpt2_attention(name: str, attn: nn.Module, edits: Mapping[int, _Edit]) -> None:
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    if hasattr(attn, "q_attn"):
        if id(attn.c_attn) in edits or id(attn.q_attn) in edits or id(attn.c_proj) in edits:
            raise ValueError(f"{where}: cross-attention cannot be shrunk; exclude its parameters from the clusters.")
        return
    hd, width = attn.head_dim, attn.c_attn.nf // 3
    kept = _kept(edits, attn.c_attn, "weight", 1, attn.c_attn.nf)
    chunks = [kept[(kept >= i * width) & (kept < (i + 1) * width)] - i * width for i in range(3)]
    heads = [_whole_heads(c, hd, f"{where}, c_attn chunk {i}") for i, c in enumerate(chunks)]
    o_heads = _whole_heads(_kept(edits, attn.c_proj, "weight", 0, attn.c_proj.nx), hd, f"{where}, c_proj rows")
    if o_heads.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0."
        )
    if not all(torch.equal(h, o_heads) for h in heads):
        raise ValueError(
            f"{where}: the q, k, v chunks of c_attn and the c_proj rows keep different heads "
            f"({[h.tolist() for h in heads]} vs {o_heads.tolist()}); prune them with one heads cluster."
        )


def _same_heads(where: str, heads: Mapping[str, Tensor]) -> None:
    """Every part must keep the same heads, and at least one."""
    first = next(iter(heads.values()))
    if first.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0."
        )
    if not all(torch.equal(h, first) for h in heads.values()):
        shown = ", ".join(f"{k} {v.tolist()}" for k, v in heads.items())
        raise ValueError(f"{where}: the parts keep different heads ({shown}); prune them with one heads cluster.")


def _qkv_heads(kept: Tensor, inner: int, head_dim: int, where: str) -> dict[str, Tensor]:
    chunks = {p: kept[(kept >= i * inner) & (kept < (i + 1) * inner)] - i * inner for i, p in enumerate("qkv")}
    return {f"{p} rows": _whole_heads(c, head_dim, f"{where}, {p} rows") for p, c in chunks.items()}


def _check_mha(name: str, attn: nn.Module, edits: Mapping[int, _Edit]) -> None:
    """An ``nn.MultiheadAttention`` (or ours) must lose whole heads, the same in q, k, v rows and out_proj columns."""
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    hd, rows = int(attn.head_dim), attn.in_proj_weight.shape[0]
    heads = _qkv_heads(_kept(edits, attn, "in_proj_weight", 0, rows), rows // 3, hd, where)
    cols = _kept(edits, attn.out_proj, "weight", 1, attn.out_proj.in_features)
    heads["out_proj columns"] = _whole_heads(cols, hd, f"{where}, out_proj columns")
    _same_heads(where, heads)


def _check_window_attention(name: str, attn: nn.Module, edits: Mapping[int, _Edit]) -> None:
    """Swin's window attention: whole heads of qkv rows, proj columns and the bias table's columns, the same."""
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    table = attn.relative_position_bias_table
    inner, num_heads = attn.proj.in_features, int(table.shape[1])
    hd = inner // num_heads
    heads = _qkv_heads(_kept(edits, attn.qkv, "weight", 0, attn.qkv.out_features), inner, hd, where)
    heads["proj columns"] = _whole_heads(_kept(edits, attn.proj, "weight", 1, inner), hd, f"{where}, proj columns")
    heads["relative_position_bias_table columns"] = _kept(edits, attn, "relative_position_bias_table", 1, num_heads)
    _same_heads(where, heads)


def _check_attention(model: nn.Module, edits: Mapping[int, _Edit]) -> None:
    for name, module in model.named_modules():
        kind = module_kind(module)
        if not name and kind in ("mha", "window_attention") and id(module) in edits:
            raise ValueError(
                f"Shrink: the model itself is a {type(module).__name__}, whose heads are cut by putting another "
                "module in its place; wrap it in a container module to shrink it."
            )
        if kind == "mha" and (id(module) in edits or id(module.out_proj) in edits):
            _check_mha(name, module, edits)
        elif kind == "window_attention" and any(id(m) in edits for m in (module, module.qkv, module.proj)):
            _check_window_attention(name, module, edits)
        if is_llama_attention(module):
            parts = (module.q_proj, module.k_proj, module.v_proj, module.o_proj)
            if any(id(p) in edits for p in parts):
                _check_llama_attention(name, module, edits)
        elif is_gpt2_attention(module) and (id(module.c_attn) in edits or id(module.c_proj) in edits):
            _check_gpt2_attention(name, module, edits)


# ---------------------------------------------------------------------------------------------------- optimizer
def _optimizer_cuts(
    optimizer: torch.optim.Optimizer, plan: ShrinkPlan, params: Mapping[str, Tensor]
) -> list[tuple[Tensor, str]]:
    """``(parameter, plan name)`` of every shrunk parameter the optimizer holds; validates its state."""
    by_id = {id(params[n]): n for n in plan.keep if n in params}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != plan.shapes[name]:
                    raise ValueError(
                        f"Shrink: optimizer {type(optimizer).__name__} holds state {key!r} of shape "
                        f"{tuple(value.shape)} for parameter {name!r} of shape {plan.shapes[name]}; only state shaped "
                        "like its parameter (momentum, Adam moments) or scalars (step) can be sliced. Shrink before "
                        "creating this optimizer, or use SGD/Adam/AdamW."
                    )
            out.append((p, name))
    return out


def slice_optimizer_state(optimizer: torch.optim.Optimizer, plan: ShrinkPlan, params: Mapping[str, Tensor]) -> None:
    """Slice the optimizer state of shrunk parameters the same way as the parameters.

    State tensors shaped like the parameter (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) keep the kept indices; scalars (``step``) are kept as they are. The parameter objects are
    the same before and after :func:`apply_plan`, so ``params`` may be taken before or after it.

    Args:
        optimizer: The optimizer.
        plan: The plan being applied.
        params: Parameter name (as in the plan) -> parameter object.

    Raises:
        ValueError: If a state tensor is neither a scalar nor shaped like its parameter (nothing is changed then).
    """
    for param, name in _optimizer_cuts(optimizer, plan, params):
        state = optimizer.state.get(param, {})
        for key, value in list(state.items()):
            if isinstance(value, Tensor) and value.dim() > 0:
                state[key] = plan.slice(name, value)


# ---------------------------------------------------------------------------------------------------- surgery
def _rescale_norm(edit: _Edit, old: int, new: int) -> None:
    """RMSNorm over the kept channels of a zero-padded input: weight * sqrt(d/d'), eps * d/d'."""
    module = edit.module
    ratio = old / new
    with torch.no_grad():
        module.weight.mul_(math.sqrt(ratio))
    if edit.kind == "hf_rmsnorm":
        module.variance_epsilon = module.variance_epsilon * ratio
    else:
        eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
        module.eps = eps * ratio


def _rewrite(edit: _Edit, new_params: Mapping[int, Tensor]) -> None:
    """Give the module's parameters their new data and update its metadata (norms: rescale, see module docs)."""
    module = edit.module
    if edit.kind in ("mha", "window_attention"):  # replaced by a module of ours afterwards (replace_attention)
        for attr in edit.cuts:
            param = module._parameters[attr]
            if param is not None and param.shape != new_params[id(param)].shape:
                param.data = new_params[id(param)]
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
        if edit.kind in ("rmsnorm", "hf_rmsnorm"):
            _rescale_norm(edit, old_width, w.shape[0])


def _check_zeros(edits: Mapping[int, _Edit], plan_names: Mapping[int, str]) -> None:
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
                    nonzero.append(plan_names.get(id(param), _full_name(edit.name, attr)))
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


def _cut_width(edit: _Edit, attr: str, dim: int) -> int:
    """The old length of ``attr``'s ``dim`` if the edit cuts it, else 0."""
    if dim not in edit.cuts.get(attr, {}):
        return 0
    return int(edit.module._parameters[attr].shape[dim])  # noqa: SLF001 - the registered tensor itself


def _check_between(model: nn.Module, edits: Mapping[int, _Edit]) -> None:
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
                members = ", ".join(f"`{_full_name(name, k)}`" for k in hit if k in module._parameters)  # noqa: SLF001
                raise ValueError(
                    f"Shrink: module {name!r} ({type(module).__name__}) sits between {writer!r}, whose {width} output "
                    f"channels are cut, and the module that reads them, and holds {hit} of width {width} that no "
                    f"cluster member covers; the shrunk model would fail at its first forward. Add its per-channel "
                    f"parameters ({members or 'none: make it affine or remove it'}) to the same cluster as 1-D "
                    "writers (a BatchNorm's running statistics are then cut with them), or leave this axis unpruned."
                )


def _validate(
    model: nn.Module, plan: ShrinkPlan, optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[str, nn.Parameter], dict[int, _Edit], list[list[tuple[Tensor, str]]]]:
    params, edits = _collect_edits(model, plan)
    for edit in edits.values():
        _check_edit(edit)
    _check_attention(model, edits)
    _check_between(model, edits)
    return params, edits, [_optimizer_cuts(opt, plan, params) for opt in optimizers]


def check_shrinkable(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> None:
    """Check, without changing anything, that a shrink of these clusters could rewrite ``model``.

    Used before training with ``shrink_on_freeze`` (the dropped units are not known yet): a trial plan drops the first
    unit of every cluster with more than one unit, which exercises every module type, every bias/weight pairing and
    every attention module the clusters touch.

    Args:
        model: The module the clusters were resolved against.
        clusters: The resolved clusters.

    Raises:
        ValueError: As for :func:`apply_plan`.
    """
    trial = {  # the first unit of every group (a cluster of balanced groups, see ResolvedCluster.unit_groups)
        rc.name: list(range(0, rc.num_units, rc.num_units // rc.unit_groups))
        for rc in clusters
        if rc.num_units > rc.unit_groups
    }
    _validate(model, align_names(build_plan(clusters, trial), model), ())


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
        plan: See :func:`build_plan`.
        optimizers: Optimizers whose state is sliced with the parameters (see :func:`slice_optimizer_state`).
        check_zeros: Warn if a dropped slice is not exactly zero (skipped on the meta device).

    Returns:
        ``model``, shrunk.

    Raises:
        ValueError: Before anything changes: if a planned parameter is missing or has another shape, is used by a
            module the shrink cannot rewrite or on a dim it cannot cut, a module's output channel and bias (or a
            norm's weight and bias) would be cut differently, an attention module would lose partial heads or
            partial query groups, or an optimizer holds state it cannot slice.
    """
    params, edits, cut_by_opt = _validate(model, plan, optimizers)
    plan_names = {id(params[n]): n for n in plan.keep}
    if check_zeros:
        _check_zeros(edits, plan_names)
    # ---- validated; mutate from here on
    owners = config_owners(model)
    for owner in owners:
        if callable(getattr(owner.config, "to_dict", None)) and not hasattr(owner, BASE_CONFIG_ATTR):
            setattr(owner, BASE_CONFIG_ATTR, copy.deepcopy(owner.config.to_dict()))
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
    layernorms, rescaled_eps = [], {}
    with torch.no_grad():
        for edit in edits.values():
            _rewrite(edit, new_params)
            if edit.kind == "layernorm":
                layernorms.append(edit.name)
            elif edit.kind == "hf_rmsnorm":
                rescaled_eps[id(edit.module)] = edit.module.variance_epsilon
            elif edit.kind == "rmsnorm":
                rescaled_eps[id(edit.module)] = edit.module.eps
    for name, grad in grads.items():
        params[name].grad = grad
    replace_attention(model, [e.module for e in edits.values() if e.kind in ("mha", "window_attention")])
    emb = embeddings[id(model)]
    update_containers(model, (hidden_before[id(model)], emb.embedding_dim) if emb is not None else None)
    update_head_counts(heads)
    for owner in owners:
        emb = embeddings[id(owner)]
        changed = emb is not None and emb.embedding_dim != hidden_before[id(owner)]
        update_config(owner, rescaled_eps, changed)
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
