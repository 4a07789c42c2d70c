"""A Hugging Face causal LM sharded for ``ModelParallelStrategy``: FSDP2 per decoder layer, tensor parallel for Llama.

:func:`shard_causal_lm` is what :meth:`lightning_pat.lm.CausalLM.configure_model` runs on the device mesh Lightning
builds (axes ``data_parallel`` and ``tensor_parallel``):

* **tensor parallel** (``tensor_parallel`` size > 1), for the Llama family (separate ``q/k/v/o_proj`` and
  ``gate/up/down_proj``): ``q/k/v`` and ``gate/up`` column-wise, ``o`` and ``down`` row-wise, so every rank holds
  whole heads and whole KV groups; the embedding, the norms and the tied ``lm_head`` stay replicated over the axis.
  Head and KV-head counts and the MLP width must divide by the axis size (refused with the numbers otherwise).
* **FSDP2** over ``data_parallel``: ``fully_shard`` on every decoder layer, then on the root (which holds the
  embedding and a tied ``lm_head`` once).
* optional activation checkpointing of every decoder layer (transformers' own ``gradient_checkpointing_enable``).

The pruning callback's sharded path then reads these DTensors as it reads any other (one packed reduction per
group, bitwise-identical selection on every rank).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

#: Llama-family module names inside a decoder layer: column-wise (rows sharded) and row-wise (columns sharded).
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


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


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Refuse a model that tensor parallelism of ``size`` ranks cannot split into whole heads.

    Raises:
        ValueError: Naming the model, the counts that do not divide and the fix.
    """
    layers = decoder_layers(model)
    found = dict(layers[0].named_modules())
    missing = [n for n in COLWISE + ROWWISE if not isinstance(found.get(n), nn.Linear)]
    if missing:
        raise ValueError(
            f"CausalLM: tensor parallelism needs a Llama-family layer; {type(layers[0]).__name__} has no nn.Linear "
            f"{missing}. Use tensor_parallel_size=1 (FSDP2 only) for this model."
        )
    config = getattr(model, "config", None)
    counts = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    bad = {k: v for k, v in counts.items() if not isinstance(v, int) or v % size}
    if bad:
        raise ValueError(
            f"CausalLM: tensor parallelism over {size} ranks splits whole heads, KV groups and MLP channels, but "
            f"{bad} do not divide by {size}; use a tensor_parallel_size that divides {counts} (or 1: FSDP2 only)."
        )


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
        ValueError: If tensor parallelism cannot split the model into whole heads (before anything is sharded).
    """
    from torch.distributed.fsdp import fully_shard

    tp = mesh["tensor_parallel"]
    layers = decoder_layers(model)
    if tp.size() > 1:
        check_tensor_parallel(model, tp.size())
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if tp.size() > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {**dict.fromkeys(COLWISE, ColwiseParallel()), **dict.fromkeys(ROWWISE, RowwiseParallel())}
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
