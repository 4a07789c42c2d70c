"""A large pretrained model built without its weights, then filled shard by shard (``CausalLM(empty_init=True)``).

:func:`empty_model` builds the Hugging Face model from its ``config.json`` with every parameter on the meta device
(buffers, such as the rotary frequencies, are computed as usual: they are small and the checkpoint does not hold the
non-persistent ones), so constructing it allocates no weight. After the model is sharded (or on one device as it is),
:func:`load_weights` allocates each rank's shards and fills them from the checkpoint's safetensors files, one
tensor at a time: a tensor is memory-mapped, and a DTensor parameter keeps only the slice its placements give this
rank (``distribute_tensor(..., src_data_rank=None)``: no communication). No rank ever holds more than its shards
plus the one tensor it is reading, and no rank reads another's memory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pat.core.safe_io import confined

#: The weights a Hugging Face directory holds: one file, else the shards its index names.
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every ``nn.Parameter`` a module registers lives on the meta device; buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # one already on meta (a tied one) stays the same object
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def first_layers_config(source: str | Path, num_layers: int, *, what: str) -> Any:
    """The config of ``source`` with only its first ``num_layers`` decoder layers (``CausalLM(num_layers=...)``).

    The layer count (``num_hidden_layers``) and the per-layer lists (``layer_types``) are cut to the first
    ``num_layers``; a model built from it and loaded from ``source`` holds the checkpoint's embedding, final norm,
    head and first layers (the later layers' tensors are not read).

    Raises:
        ValueError: If ``num_layers`` is not an int in [1, the checkpoint's layer count], or the config has no
            ``num_hidden_layers``.
    """
    from transformers import AutoConfig

    config: Any = AutoConfig.from_pretrained(source, trust_remote_code=False)
    total = getattr(config, "num_hidden_layers", None)
    if not isinstance(total, int):
        raise ValueError(f"{what}: num_layers needs a config with `num_hidden_layers`; {source} has none.")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(
            f"{what}: `num_layers` must be an int in [1, {total}] (the checkpoint's num_hidden_layers), got "
            f"{num_layers!r}; or None for every layer."
        )
    config.num_hidden_layers = num_layers
    for name in ("layer_types",):
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:num_layers])
    return config


def empty_model(directory: str | Path, *, dtype: torch.dtype, what: str, config: Any = None) -> Any:
    """The model of a local Hugging Face directory, its parameters on meta (nothing allocated, nothing read).

    ``config``: the model's config if not ``directory``'s own (:func:`first_layers_config`).

    Raises:
        ValueError: If ``directory`` is not a local directory with a ``config.json`` and safetensors weights.
    """
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM as AutoModel

    folder = Path(directory)
    if not (folder / "config.json").is_file() or not ((folder / WEIGHTS).is_file() or (folder / INDEX).is_file()):
        raise ValueError(
            f"{what}: empty_init=True reads the weights from a local directory with config.json and {WEIGHTS} (or "
            f"{INDEX}); {directory} is not one. Pass the directory, or empty_init=False."
        )
    if config is None:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with parameters_on_meta():
        build: Any = AutoModel.from_config  # untyped in transformers
        model = build(config, dtype=dtype, trust_remote_code=False)
    model.config._name_or_path = str(directory)
    return model


def weight_files(directory: str | Path, *, what: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (every file name confined to ``directory``)."""
    folder = Path(directory)
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS), framework="pt") as file:
            return dict.fromkeys(file.keys(), folder / WEIGHTS)
    index = json.loads(confined(folder, INDEX, what=what).read_text())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{what}: {folder / INDEX} has no `weight_map` mapping of tensor names to files.")
    return {str(name): confined(folder, file, what=f"{what}: {INDEX}") for name, file in weight_map.items()}


def load_weights(model: nn.Module, directory: str | Path, *, device: torch.device, what: str) -> None:
    """Allocate ``model``'s meta parameters on ``device`` and fill each rank's part from the checkpoint.

    Args:
        model: A model from :func:`empty_model`, sharded or not (its parameters plain or DTensors, on meta).
        directory: The directory it was built from.
        device: This rank's device.
        what: The caller, for the messages.

    Raises:
        ValueError: If a parameter is missing from the checkpoint or has another shape there (nothing is half
            loaded: every name and shape is checked before the first tensor is read).
    """
    from safetensors import safe_open

    from lightning_pat.parallel.comm.dtensor import is_dtensor, write_back_

    files = weight_files(directory, what=what)
    params = dict(model.named_parameters())  # tied parameters once, under their first name (the checkpoint's)
    missing = sorted(set(params) - set(files))
    if missing:
        raise ValueError(f"{what}: the checkpoint in {directory} has no tensors {missing[:5]} for this model.")
    handles: dict[Path, Any] = {}  # each file opened once (memory-mapped), for the headers and then the tensors

    def handle(name: str) -> Any:
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), framework="pt", device="cpu")
        return handles[files[name]]

    for name, param in params.items():  # every shape, from the headers, before anything is allocated
        shape = tuple(handle(name).get_slice(name).get_shape())
        if shape != tuple(param.shape):
            raise ValueError(
                f"{what}: {name} is {shape} in {files[name].name}, but the model built from config.json expects "
                f"{tuple(param.shape)}."
            )
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    sharded = any(is_dtensor(p) for p in params.values())
    model.to_empty(device=device)
    tie: Any = getattr(model, "tie_weights", None)
    if tie is not None and not sharded:
        tie()  # to_empty gives each module new parameter objects: tie them again before reading
    params = dict(model.named_parameters())
    if set(params) - set(files):
        raise ValueError(f"{what}: after allocation, {sorted(set(params) - set(files))[:5]} are no longer tied.")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, param in params.items():
            full = handle(name).get_tensor(name)
            write_back_(param, full.to(param.dtype))  # a DTensor keeps this rank's slice only, no collective
    handles.clear()
