r"""Physical shrink: cut the dropped units out of a model, so it becomes a smaller dense model of the same class.

Two layers, both usable on their own:

* :class:`ShrinkPlan` (:func:`build_plan`): per parameter, which indices survive on which dim. Pure data, built
  from resolved clusters and dropped unit indices.
* :func:`apply_plan`: module surgery. Every parameter in the plan is traced to the modules that own it (a tied tensor
  to all of them); each owner must be a module whose metadata the shrink knows how to rewrite: ``nn.Linear``,
  transformers ``Conv1D``, ``nn.Embedding`` (columns only), ``nn.LayerNorm``, ``nn.RMSNorm`` and Hugging Face
  ``*RMSNorm`` modules (``weight * x / rms(x)`` with ``variance_epsilon``). Attention modules (``q/k/v/o_proj`` with
  ``head_dim``; GPT-2's packed ``c_attn``) are checked to lose whole heads / whole query groups and get their head
  counts updated; MLP modules get ``intermediate_size``; ``model.config`` gets the new sizes where uniform.
  Everything is validated before the first tensor changes; the optimizer state can be sliced in the same pass
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
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.spec import ResolvedCluster

log = logging.getLogger(__name__)

_FIX_MODULE = (
    "Remove this parameter from the cluster, or replace the module by one the shrink can rewrite (nn.Linear, "
    "transformers Conv1D, nn.Embedding, nn.LayerNorm, nn.RMSNorm, a Hugging Face *RMSNorm)."
)


# the model's config before its first shrink (plain dict), kept on the model so that an export can say what to build
BASE_CONFIG_ATTR = "_lightning_pat_base_config"


class LayerNormShrinkWarning(UserWarning):
    """A LayerNorm lost channels: the shrunk model is not output-preserving (fine-tune after the shrink)."""


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class ShrinkPlan:
    """Which indices of which parameter survive a shrink.

    Attributes:
        keep: Parameter name -> tensor dim -> sorted kept indices (a ``LongTensor``).
        shapes: Parameter name -> shape before the shrink.
    """

    keep: dict[str, dict[int, Tensor]]
    shapes: dict[str, tuple[int, ...]]

    def new_shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter ``name`` after the shrink."""
        shape = list(self.shapes[name])
        for dim, idx in self.keep.get(name, {}).items():
            shape[dim] = idx.numel()
        return tuple(shape)

    def slice(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` (shaped like parameter ``name`` before the shrink) with only the kept indices, contiguous."""
        out = tensor
        for dim, idx in sorted(self.keep.get(name, {}).items()):
            out = out.index_select(dim, idx.to(out.device))
        return out.contiguous()

    def renamed(self, mapping: Mapping[str, str]) -> ShrinkPlan:
        """The same plan with parameter names replaced through ``mapping`` (names not in it are kept)."""
        return ShrinkPlan(
            keep={mapping.get(n, n): v for n, v in self.keep.items()},
            shapes={mapping.get(n, n): v for n, v in self.shapes.items()},
        )


def build_plan(clusters: Sequence[ResolvedCluster], dropped: Mapping[str, Sequence[int]]) -> ShrinkPlan:
    """Turn resolved clusters and their dropped units into per-parameter kept indices.

    Args:
        clusters: The resolved clusters (``PruneResult.clusters``, ``callback.resolved``).
        dropped: Cluster name -> dropped unit indices (clusters not listed drop nothing).

    Returns:
        The plan; parameters with nothing dropped are left out.

    Raises:
        ValueError: If ``dropped`` names an unknown cluster or an index is outside ``[0, C)``.

    Example::

        >>> from lightning_pat.spec import Member
        >>> rc = ResolvedCluster("h", (Member("a.weight", "writer", 0, 0, 4, 1, (4, 2)),), num_units=4)
        >>> build_plan([rc], {"h": [1, 2]}).keep["a.weight"][0].tolist()
        [0, 3]
    """
    by_name = {rc.name: rc for rc in clusters}
    unknown = sorted(set(dropped) - set(by_name))
    if unknown:
        raise ValueError(
            f"`dropped` names clusters {unknown[:5]} that are not among the clusters {sorted(by_name)[:5]}...; pass "
            "the dropped units and the clusters of the same run."
        )
    cut: dict[tuple[str, int], set[int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, units in dropped.items():
        rc = by_name[name]
        units = sorted({int(u) for u in units})
        if not units:
            continue
        if units[0] < 0 or units[-1] >= rc.num_units:
            raise ValueError(
                f"Cluster {name!r}: dropped unit indices must lie in [0, {rc.num_units}), got {units[:8]}; the dropped "
                "units do not belong to these clusters."
            )
        for m in rc.members:
            shapes[m.name] = m.shape
            channels = cut.setdefault((m.name, m.dim), set())
            for u in units:
                channels.update(range(m.start + u * m.block, m.start + (u + 1) * m.block))
    keep: dict[str, dict[int, Tensor]] = {}
    for (name, dim), channels in cut.items():
        kept = [i for i in range(shapes[name][dim]) if i not in channels]
        keep.setdefault(name, {})[dim] = torch.tensor(kept, dtype=torch.long)
    return ShrinkPlan(keep=keep, shapes={n: shapes[n] for n in keep})


# ---------------------------------------------------------------------------------------------------- module kinds
def _kind(module: nn.Module) -> str | None:
    """The rewrite rule for a module that owns a shrunk parameter, or ``None`` if it has none."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.RMSNorm):
        return "rmsnorm"
    if type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "variance_epsilon", None), float):
        return "hf_rmsnorm"
    return None


# (kind, attribute) -> dims that may be cut; (kind) -> the (attr, dim) pairs that must be cut identically
_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("linear", "weight"): (0, 1),
    ("linear", "bias"): (0,),
    ("conv1d", "weight"): (0, 1),
    ("conv1d", "bias"): (0,),
    ("embedding", "weight"): (1,),
    ("layernorm", "weight"): (0,),
    ("layernorm", "bias"): (0,),
    ("rmsnorm", "weight"): (0,),
    ("hf_rmsnorm", "weight"): (0,),
}
_TIED_AXES: dict[str, tuple[tuple[str, int], tuple[str, int]]] = {
    "linear": (("weight", 0), ("bias", 0)),  # output channel: row and bias
    "conv1d": (("weight", 1), ("bias", 0)),  # Conv1D weights are [in, out]
    "layernorm": (("weight", 0), ("bias", 0)),
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
            kind = _kind(module)
            full = _full_name(mname, attr)
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
    fix = "prune attention with a heads cluster (whole heads / whole GQA query groups: q, k, v rows and o columns)"
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
    n_rep = (q.out_features // hd) // (k.out_features // hd)
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


def _is_llama_attention(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and (
        isinstance(getattr(m, "head_dim", None), int)
    )


def _is_gpt2_attention(m: nn.Module) -> bool:
    return _kind(getattr(m, "c_attn", nn.Identity())) == "conv1d" and isinstance(getattr(m, "split_size", None), int)


def _check_attention(model: nn.Module, edits: Mapping[int, _Edit]) -> None:
    for name, module in model.named_modules():
        if _is_llama_attention(module):
            parts = (module.q_proj, module.k_proj, module.v_proj, module.o_proj)
            if any(id(p) in edits for p in parts):
                _check_llama_attention(name, module, edits)
        elif _is_gpt2_attention(module) and (id(module.c_attn) in edits or id(module.c_proj) in edits):
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
    else:
        if hasattr(module, "normalized_shape"):
            module.normalized_shape = (w.shape[0],)
        if edit.kind in ("rmsnorm", "hf_rmsnorm"):
            _rescale_norm(edit, old_width, w.shape[0])


def _set_if_int(module: nn.Module, attr: str, value: int) -> None:
    if isinstance(getattr(module, attr, None), int) and not isinstance(getattr(module, attr), bool):
        setattr(module, attr, value)


def _update_containers(model: nn.Module, hidden: tuple[int, int] | None) -> None:
    """Head counts of attention modules, MLP widths and hidden-size attributes of every container module."""
    for module in model.modules():
        if _is_llama_attention(module):
            hd = module.head_dim
            n_q, n_kv = module.q_proj.out_features // hd, module.k_proj.out_features // hd
            for attr in ("num_heads", "num_attention_heads", "n_head"):
                _set_if_int(module, attr, n_q)
            for attr in ("num_key_value_heads", "num_kv_heads", "n_kv_head"):
                _set_if_int(module, attr, n_kv)
        elif _is_gpt2_attention(module) and not hasattr(module, "q_attn"):
            module.split_size = module.c_attn.nf // 3
            _set_if_int(module, "num_heads", module.split_size // module.head_dim)
        down = getattr(module, "down_proj", None)
        if isinstance(down, nn.Linear) and isinstance(getattr(module, "up_proj", None), nn.Linear):
            _set_if_int(module, "intermediate_size", down.in_features)
        if hidden is not None and hidden[0] != hidden[1]:
            for attr in ("hidden_size", "embed_dim", "d_model"):
                if getattr(module, attr, None) == hidden[0]:
                    _set_if_int(module, attr, hidden[1])


def _input_embedding(model: nn.Module) -> nn.Embedding | None:
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _uniform(values: Iterable[int | float]) -> int | float | None:
    found = set(values)
    return found.pop() if len(found) == 1 else None


def _set_config(config: Any, names: Sequence[str], value: int | float | None, what: str) -> None:
    if value is None:
        if any(hasattr(config, n) for n in names):
            log.info("shrink: %s differs between layers; `config` keeps its value, the export records per layer", what)
        return
    for n in names:
        if hasattr(config, n):
            setattr(config, n, value)


def _config_owners(model: nn.Module) -> list[nn.Module]:
    """The outermost module holding each distinct ``config`` object.

    For a LightningModule this is its inner HF model or TinyGPT; HF attention modules share their model's config
    object and are skipped.
    """
    owners, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and not isinstance(config, (int, float, str, Mapping)):
            seen.add(id(config))
            owners.append(module)
    return owners


def _update_config(model: nn.Module, rescaled_eps: Mapping[int, float], hidden_changed: bool) -> None:
    """Write the new uniform sizes into ``model.config`` (Hugging Face configs and ``TinyGPTConfig``)."""
    config = model.config
    norm_eps = [rescaled_eps[id(m)] for m in model.modules() if id(m) in rescaled_eps]
    attns = [m for m in model.modules() if _is_llama_attention(m)]
    gpt2 = [m for m in model.modules() if _is_gpt2_attention(m) and not hasattr(m, "q_attn")]
    mlp_widths = [
        m.down_proj.in_features
        for m in model.modules()
        if isinstance(getattr(m, "down_proj", None), nn.Linear) and isinstance(getattr(m, "up_proj", None), nn.Linear)
    ]
    mlp_widths += [m.c_fc.nf for m in model.modules() if _kind(getattr(m, "c_fc", nn.Identity())) == "conv1d"]
    if mlp_widths:
        _set_config(config, ("intermediate_size", "n_inner", "d_ff"), _uniform(mlp_widths), "the MLP width")
    if attns:
        _set_config(
            config,
            ("num_attention_heads", "n_head"),
            _uniform(a.q_proj.out_features // a.head_dim for a in attns),
            "the head count",
        )
        _set_config(
            config,
            ("num_key_value_heads", "n_kv_head"),
            _uniform(a.k_proj.out_features // a.head_dim for a in attns),
            "the KV head count",
        )
        head_dim = _uniform(a.head_dim for a in attns)
        if head_dim is not None and not hasattr(config, "head_dim") and hasattr(config, "model_type"):
            config.head_dim = head_dim  # HF attention reads `getattr(config, "head_dim", hidden // heads)`
        _set_config(config, ("head_dim",), head_dim, "head_dim")
    if gpt2:
        _set_config(config, ("n_head",), _uniform(a.split_size // a.head_dim for a in gpt2), "the head count")
    emb = _input_embedding(model)
    if emb is not None and hidden_changed:
        _set_config(config, ("hidden_size", "n_embd", "d_model"), emb.embedding_dim, "the hidden size")
    if norm_eps:
        _set_config(config, ("rms_norm_eps",), _uniform(norm_eps), "the RMSNorm eps")


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
            UserWarning,
            stacklevel=3,
        )


def _validate(
    model: nn.Module, plan: ShrinkPlan, optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[str, nn.Parameter], dict[int, _Edit], list[list[tuple[Tensor, str]]]]:
    params, edits = _collect_edits(model, plan)
    for edit in edits.values():
        _check_edit(edit)
    _check_attention(model, edits)
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
    trial = {rc.name: [0] for rc in clusters if rc.num_units > 1}
    _validate(model, _align_names(build_plan(clusters, trial), model), ())


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
    owners = _config_owners(model)
    for owner in owners:
        if callable(getattr(owner.config, "to_dict", None)) and not hasattr(owner, BASE_CONFIG_ATTR):
            setattr(owner, BASE_CONFIG_ATTR, copy.deepcopy(owner.config.to_dict()))
    embeddings = {id(m): _input_embedding(m) for m in [model, *owners]}
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
    emb = embeddings[id(model)]
    _update_containers(model, (hidden_before[id(model)], emb.embedding_dim) if emb is not None else None)
    for owner in owners:
        emb = embeddings[id(owner)]
        changed = emb is not None and emb.embedding_dim != hidden_before[id(owner)]
        _update_config(owner, rescaled_eps, changed)
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


# ---------------------------------------------------------------------------------------------------- sources
def _from_state(state: Mapping[str, Any], what: str) -> tuple[list[ResolvedCluster], dict[str, list[int]]]:
    if "clusters" not in state or "dropped" not in state:
        raise ValueError(
            f"shrink: {what} has no {'clusters' if 'clusters' not in state else 'dropped'!r} entry (keys: "
            f"{sorted(state)[:8]}); pass a PruneResult, a CoupledPruningCallback after fit, its state_dict() or a "
            "checkpoint written by a version of lightning_pat that stores the clusters."
        )
    clusters = [rc if isinstance(rc, ResolvedCluster) else ResolvedCluster.from_dict(rc) for rc in state["clusters"]]
    return clusters, {str(k): [int(i) for i in v] for k, v in state["dropped"].items()}


def checkpoint_state(ckpt: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one ``CoupledPruningCallback`` state in a Lightning checkpoint dict.

    Args:
        ckpt: The checkpoint (``torch.load`` of a ``.ckpt`` file).

    Returns:
        The callback's state (what its ``state_dict()`` returned).

    Raises:
        ValueError: If the checkpoint holds no such state, or several.
    """
    callbacks = ckpt.get("callbacks") or {}
    keys = [k for k in callbacks if str(k).startswith("CoupledPruningCallback")]
    if len(keys) != 1:
        found = "no CoupledPruningCallback state" if not keys else f"{len(keys)} CoupledPruningCallback states {keys}"
        raise ValueError(
            f"shrink: the checkpoint holds {found} under 'callbacks' (keys: {list(callbacks)[:5]}); pass the "
            "callback's state itself (ckpt['callbacks'][key]) or a checkpoint of a run with exactly one such callback."
        )
    return callbacks[keys[0]]


def read_source(source: Any) -> tuple[list[ResolvedCluster], dict[str, list[int]]]:
    """The resolved clusters and dropped units held by ``source``.

    Args:
        source: A ``PruneResult``, a ``CoupledPruningCallback`` after ``fit``, the callback's ``state_dict()``, or a
            Lightning checkpoint dict (the callback state is found under ``ckpt["callbacks"]``).

    Returns:
        ``(clusters, dropped)``.

    Raises:
        ValueError: If the source holds no clusters, or a checkpoint holds no or several callback states.
        TypeError: If ``source`` is none of the above.
    """
    if isinstance(source, Mapping):
        if "callbacks" in source and "clusters" not in source:
            return _from_state(checkpoint_state(source), "the checkpoint's callback state")
        return _from_state(source, "the mapping")
    if hasattr(source, "resolved") and hasattr(source, "dropped"):  # the callback, without importing Lightning
        if not source.resolved:
            raise ValueError("shrink: the callback has no resolved clusters; call `trainer.fit` first.")
        return list(source.resolved), {k: list(v) for k, v in source.dropped.items()}
    if hasattr(source, "clusters") and hasattr(source, "dropped"):  # a PruneResult
        if not source.clusters and any(source.dropped.values()):
            raise ValueError("shrink: the PruneResult carries no clusters; get it from `prune_clusters` or a Pruner.")
        return list(source.clusters), {k: list(v) for k, v in source.dropped.items()}
    raise TypeError(
        f"shrink: `source` must be a PruneResult, a CoupledPruningCallback, its state_dict() or a Lightning "
        f"checkpoint dict, got {type(source).__name__}."
    )


def _align_names(plan: ShrinkPlan, model: nn.Module) -> ShrinkPlan:
    """Strip one common prefix from the plan's names when the model is the inner module (``lit.model``)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if not plan.keep or all(n in names for n in plan.keep):
        return plan
    first = next(iter(plan.keep))
    parts = first.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i]) + "."
        if all(n.startswith(prefix) and n[len(prefix) :] in names for n in plan.keep):
            log.info("shrink: the clusters name parameters under %r; stripped it to match the model", prefix)
            return plan.renamed({n: n[len(prefix) :] for n in plan.keep})
    return plan  # the missing name is reported by apply_plan


def plan_for(model: nn.Module, source: Any) -> ShrinkPlan:
    """The :class:`ShrinkPlan` of ``source`` (see :func:`read_source`), with names matched to ``model``.

    Args:
        model: The model to shrink.
        source: As for :func:`shrink`.

    Returns:
        The plan.

    Raises:
        ValueError: As for :func:`read_source` and :func:`build_plan`.
        TypeError: As for :func:`read_source`.
    """
    clusters, dropped = read_source(source)
    return _align_names(build_plan(clusters, dropped), model)


def shrink(model: nn.Module, source: Any, *, inplace: bool = True) -> nn.Module:
    """Physically remove the dropped units of ``model``: a smaller dense model of the same class.

    ``shrunk(x)`` equals the masked model's output (RMSNorm residuals are rescaled; a LayerNorm residual warns
    because it cannot be exact). Module metadata (``in_features``/``out_features``, ``nf``, ``embedding_dim``,
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
            the fix), or an attention module would lose partial heads.
        TypeError: If ``source`` is of an unknown type.

    Example::

        >>> from lightning_pat import Cluster, prune_clusters
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> res = prune_clusters(net, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]), 0.5)
        >>> small = shrink(net, res)
        >>> small[0], small[2]
        (Linear(in_features=4, out_features=4, bias=True), Linear(in_features=4, out_features=2, bias=True))
    """
    plan = plan_for(model, source)
    target = model if inplace else copy.deepcopy(model)
    return apply_plan(target, plan)


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
    clusters, dropped = _from_state(state, "the callback state")
    apply_plan(module, _align_names(build_plan(clusters, dropped), module), check_zeros=False)
    return True
