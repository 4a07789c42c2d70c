"""The encoders a causal LM holds beside its decoder, discovered on their own inputs (``clusters="auto"``).

A multimodal causal LM (Phi-4-multimodal) holds a vision and an audio encoder that a text forward never runs, so
the trace of the LM on token ids never sees them, and ``from_pretrained`` still loads them: on the tiny
Phi-4-multimodal they are 84% of the non-embedding parameters. :func:`encoder_clusters` finds every Hugging Face
model inside the LM (a module with its own ``config`` and ``main_input_name``) whose parameters the LM's trace did
not reach, makes an example input from its config (:func:`example_for`: ``pixel_values`` of ``image_size``, or
features of ``input_size`` / ``num_mel_bins`` / ``feature_size``), and discovers its clusters by tracing it on that
input (each exact by the same trial shrink). Their names are the LM's; which cuts the stock config can express
(the encoder's sub-config: ``intermediate_size``, and heads only where its head size is not ``hidden // heads``) is
decided afterwards for all clusters alike. An encoder without a known example input, or one that does not trace,
is left whole, and the log says so.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_pat.core.spec import Cluster
from lightning_pat.core.spec.patterns import split_dim, split_slice

log = logging.getLogger(__name__)

#: Config fields that give the feature width of an audio encoder's input ``(batch, frames, features)``.
_FEATURES = ("input_size", "num_mel_bins", "feature_size")
_FRAMES = 64  # frames of the example audio input (Phi-4-multimodal's encoder subsamples them by 8)


def _is_hf_model(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return callable(getattr(config, "to_dict", None)) and isinstance(getattr(module, "main_input_name", None), str)


def example_for(encoder: nn.Module) -> Any:
    """An example input for a Hugging Face encoder, made from its config; ``None`` where none is known.

    ``pixel_values`` ``(1, num_channels, H, W)`` at the config's ``image_size``; otherwise, for a config with an
    ``input_size``, ``num_mel_bins`` or ``feature_size``, features ``(1, 64, width)``, with ``None`` for the
    forward's other required positional arguments (a mask).
    """
    config = getattr(encoder, "config", None)
    gen = torch.Generator().manual_seed(0)
    if getattr(encoder, "main_input_name", None) == "pixel_values":
        size = getattr(config, "image_size", None)
        hw = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (list, tuple)) else None
        if hw is None or len(hw) != 2:
            return None
        return torch.randn(1, int(getattr(config, "num_channels", 3)), *hw, generator=gen)
    width = next((v for k in _FEATURES if isinstance(v := getattr(config, k, None), int) and v > 0), None)
    if width is None:
        return None
    try:
        params = list(inspect.signature(encoder.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    extra = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    return (torch.randn(1, _FRAMES, width, generator=gen), *([None] * len(extra)))


def prefixed(cluster: Cluster, path: str) -> Cluster:
    """``cluster`` of the submodule at ``path``, under the enclosing model's names."""
    return replace(
        cluster,
        name=f"{path}.{cluster.name}",
        writers=[f"{path}.{m}" for m in cluster.writers],
        readers=[f"{path}.{m}" for m in cluster.readers],
    )


def untraced_encoders(model: nn.Module, reached: Iterable[str]) -> list[tuple[str, nn.Module, Any]]:
    """The Hugging Face models inside ``model`` that its trace did not reach: ``(path, module, example input)``.

    Args:
        model: The traced model (a causal LM).
        reached: The members of the clusters and left-out channels its trace found (an encoder holding any of these
            parameters was traced with the model and is not listed).

    Returns:
        The outermost such modules in registration order, each with :func:`example_for`'s input (``None``: none
        known).
    """
    touched = {split_dim(split_slice(m)[0])[0] for m in reached}
    out: list[tuple[str, nn.Module, Any]] = []
    for path, sub in model.named_modules():
        if not path or sub is model or not _is_hf_model(sub) or any(path.startswith(f"{p}.") for p, _, _ in out):
            continue
        names = [f"{path}.{n}" for n, _ in sub.named_parameters()]
        if names and not any(n in touched for n in names):
            out.append((path, sub, example_for(sub)))
    return out
