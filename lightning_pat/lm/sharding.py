"""A Hugging Face causal LM sharded for ``ModelParallelStrategy``: FSDP2 per layer, tensor parallel by the model's plan.

:func:`shard_causal_lm` is what :meth:`lightning_pat.lm.CausalLM.configure_model` runs on the device mesh Lightning
builds (axes ``data_parallel`` and ``tensor_parallel``):

* **tensor parallel** (``tensor_parallel`` size > 1), from the decoder layer's entries of the config's
  ``base_model_tp_plan`` where transformers gives one (``"layers.*.self_attn.q_proj": "colwise"``), else ours for
  the Llama family (:data:`COLWISE`, :data:`ROWWISE`). :data:`STYLES` translates transformers' strings to DTensor
  parallel styles: ``colwise`` and ``rowwise`` (``ColwiseParallel`` / ``RowwiseParallel`` on an ``nn.Linear``:
  every rank holds whole heads, whole KV groups and whole MLP channels), ``replicated_with_grad_allreduce`` on a
  per-head norm (``q_norm``/``k_norm``: weights replicated over the axis, their gradients summed over it); any
  other style is refused with the entry, the style and the fix. The plan's entries outside the decoder layers (an
  ``embedding_rowwise`` embedding) are left out: the embedding, the final norm and a tied ``lm_head`` stay
  replicated over the axis. The entries are split by the module holding them (``self_attn``, ``mlp``): one whose
  sizes the axis cannot split into whole units (9 query heads over 2 ranks, SmolLM2) stays replicated over the axis
  as a whole, with a warning naming the counts; when no part can be split, tensor parallelism is refused with the
  numbers.
* **FSDP2** over ``data_parallel``: ``fully_shard`` on every decoder layer, then on the root (which holds the
  embedding and a tied ``lm_head`` once).
* optional activation checkpointing of every decoder layer (transformers' own ``gradient_checkpointing_enable``).

The pruning callback's sharded path then reads these DTensors as it reads any other (one packed reduction per
group, bitwise-identical selection on every rank).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

#: Llama-family module names inside a decoder layer: column-wise (rows sharded) and row-wise (columns sharded); the
#: plan used when the model's config has no ``base_model_tp_plan``.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
#: transformers' tensor-parallel style strings this module translates (the others are refused).
STYLES: tuple[str, ...] = ("colwise", "rowwise", "replicated_with_grad_allreduce")
#: Config counts that a module holding attention heads must split into whole heads / KV groups.
HEAD_COUNTS: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM: the modules whose class ``_no_split_modules`` names.

    Raises:
        ValueError: If the model names none, or none is found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"CausalLM under ModelParallelStrategy: cannot find the decoder layers of {type(model).__name__} "
            f"(its _no_split_modules is {sorted(names)}); shard it yourself in a LightningModule's configure_model."
        )
    return layers


def layer_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of one decoder layer, as transformers spells it: module path in the layer -> style.

    The config's ``base_model_tp_plan`` entries of the form ``<layers>.*.<path>`` (the other entries are left out: what
    they name stays replicated), else the Llama plan (:data:`COLWISE`, :data:`ROWWISE`) when the layer has its
    ``nn.Linear`` modules.

    Raises:
        ValueError: If the config has no plan and the layer is not Llama-shaped.
    """
    layer = decoder_layers(model)[0]
    given = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    plan = {key.split(".*.", 1)[1]: str(style) for key, style in dict(given).items() if ".*." in key}
    if plan:
        return plan
    found = dict(layer.named_modules())
    missing = [n for n in COLWISE + ROWWISE if not isinstance(found.get(n), nn.Linear)]
    if missing:
        raise ValueError(
            f"CausalLM: tensor parallelism needs a tensor-parallel plan: {type(model).__name__}'s config has no "
            f"base_model_tp_plan and its {type(layer).__name__} is not Llama-shaped (no nn.Linear {missing}). Use "
            f"tensor_parallel_size=1 (FSDP2 only) for this model."
        )
    return {**dict.fromkeys(COLWISE, "colwise"), **dict.fromkeys(ROWWISE, "rowwise")}


def _style(path: str, style: str, module: nn.Module | None, *, model: str) -> Callable[[], Any]:
    """The DTensor parallel style (a factory) for one plan entry, or a ValueError naming what cannot be translated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    fix = "Use tensor_parallel_size=1 (FSDP2 only), or shard the model yourself in a LightningModule's configure_model."
    if module is None:
        raise ValueError(f"CausalLM: {model}'s tensor-parallel plan names {path!r}, not in its decoder layer. {fix}")
    if style in ("colwise", "rowwise"):
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"CausalLM: {model}'s tensor-parallel plan makes {path!r} {style!r}, but it is a "
                f"{type(module).__name__}, not an nn.Linear. {fix}"
            )
        return ColwiseParallel if style == "colwise" else RowwiseParallel
    if style == "replicated_with_grad_allreduce" and path.rsplit(".", 1)[-1] in ("q_norm", "k_norm"):
        # a per-head norm of the local heads [B, T, H/tp, D]: weights replicated, the heads dim sharded
        return lambda: SequenceParallel(sequence_dim=-2, use_local_output=True)
    raise ValueError(
        f"CausalLM: {model}'s tensor-parallel plan gives {path!r} the style {style!r}, which lightning_pat cannot "
        f"translate to a DTensor parallel style (it translates {list(STYLES)}; "
        f"replicated_with_grad_allreduce on a q_norm/k_norm only). {fix}"
    )


def _split_counts(part: str, entries: Mapping[str, str], found: Mapping[str, nn.Module], config: Any) -> dict[str, Any]:
    """The sizes tensor parallelism must split into whole units for one part of a layer (``self_attn``, ``mlp``)."""
    counts: dict[str, Any] = {}
    for path, style in entries.items():
        module = found[path]
        if isinstance(module, nn.Linear):
            counts[f"{path}.{'out' if style == 'colwise' else 'in'}_features"] = (
                module.out_features if style == "colwise" else module.in_features
            )
    if "attn" in part or "attention" in part:
        counts.update({name: getattr(config, name, None) for name in HEAD_COUNTS})
    return counts


def tensor_parallel_plan(model: nn.Module, size: int) -> dict[str, Any]:
    """The DTensor parallel styles of one decoder layer for a tensor-parallel axis of ``size`` ranks.

    Args:
        model: A Hugging Face causal LM (plain parameters).
        size: The ``tensor_parallel`` axis size.

    Returns:
        Module path in the decoder layer -> a ``ParallelStyle``; the parts the axis cannot split are left out
        (replicated over the axis; a warning names their counts).

    Raises:
        ValueError: If the plan holds a style or module that cannot be translated (:data:`STYLES`), or no part of the
            layer can be split into whole units by ``size`` (the counts and the fix).
    """
    name = type(model).__name__
    layer = decoder_layers(model)[0]
    found = dict(layer.named_modules())
    plan = layer_plan(model)
    styles = {path: _style(path, style, found.get(path), model=name) for path, style in plan.items()}
    config = getattr(model, "config", None)
    parts: dict[str, dict[str, str]] = {}
    for path, style in plan.items():
        parts.setdefault(path.rsplit(".", 1)[0] if "." in path else path, {})[path] = style
    kept: dict[str, Any] = {}
    left: dict[str, dict[str, Any]] = {}
    for part, entries in parts.items():
        counts = _split_counts(part, entries, found, config)
        bad = {k: v for k, v in counts.items() if not isinstance(v, int) or v % size}
        if bad:
            left[part] = bad
        else:
            kept.update({path: styles[path]() for path in entries})
    if not kept:
        raise ValueError(
            f"CausalLM: tensor parallelism over {size} ranks splits whole heads, KV groups and MLP channels, but in "
            f"every part of {type(layer).__name__} some do not divide by {size}: {left}; use a tensor_parallel_size "
            f"that divides them (or 1: FSDP2 only)."
        )
    if left:
        warnings.warn(
            f"CausalLM: tensor parallelism over {size} ranks leaves {sorted(left)} of every {type(layer).__name__} "
            f"replicated over the axis (computed on every rank of it): {left} do not divide by {size}. The other "
            f"parts ({sorted({p.rsplit('.', 1)[0] for p in kept})}) are split.",
            stacklevel=2,
        )
    return kept


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Refuse a model that tensor parallelism of ``size`` ranks cannot split at all (see :func:`tensor_parallel_plan`).

    Raises:
        ValueError: As :func:`tensor_parallel_plan`.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor_parallel_plan(model, size)


def activation_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' activation (gradient) checkpointing is on for ``model``."""
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:  # transformers before the rename
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in the backward (non-reentrant), with the API this transformers has."""
    enable: Any = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        older: Any = model.gradient_checkpointing_enable  # a transformers PreTrainedModel method
        older(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_causal_lm(model: nn.Module, mesh: Any, *, activation_checkpointing: bool = False) -> None:
    """Shard ``model`` in place on Lightning's 2-D mesh (see the module docstring).

    Args:
        model: A Hugging Face causal LM with plain (not yet sharded) parameters.
        mesh: The ``DeviceMesh`` with axes ``data_parallel`` and ``tensor_parallel``.
        activation_checkpointing: Recompute every decoder layer's activations in the backward.

    Raises:
        ValueError: If tensor parallelism cannot split the model (see :func:`tensor_parallel_plan`; before anything
            is sharded).
    """
    from torch.distributed.fsdp import fully_shard

    tp = mesh["tensor_parallel"]
    layers = decoder_layers(model)
    plan = tensor_parallel_plan(model, tp.size()) if tp.size() > 1 else {}
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if plan:
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in layers:
            parallelize_module(layer, tp, plan)
    dp = mesh["data_parallel"]
    for layer in layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    log.info(
        "CausalLM: %d decoder layers sharded (FSDP2 over %d ranks, tensor parallel over %d)%s",
        len(layers), dp.size(), tp.size(), ", activation checkpointing" if activation_checkpointing else "",
    )  # fmt: skip
