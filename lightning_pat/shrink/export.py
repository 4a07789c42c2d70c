r"""Save and load shrunk models.

:func:`save_pretrained` writes

* a Hugging Face model with ``model.save_pretrained(directory)``: ``config.json`` carries the new sizes. When a stock
  model built from that config has exactly the shrunk model's parameter shapes and module attributes (uniform widths;
  ``head_dim`` is written explicitly), nothing else is added and ``AutoModelForCausalLM.from_pretrained(directory)``
  loads it with no lightning_pat code. Otherwise (GPT-2 with dropped heads, per-layer widths, a residual shrink whose
  rescaled RMSNorm eps differs from Qwen3's q/k norms) ``config.json`` gets a ``"lightning_pat"`` entry naming the
  loader, the class, the config to build before resizing, every parameter shape and every module attribute that
  differs; stock ``from_pretrained`` then refuses the size mismatch, and :func:`load_pretrained` loads it.
* any other module as ``model.pt`` (``torch.save`` of the module) plus ``lightning_pat.json`` (its class, parameter
  shapes and, for a dataclass config such as ``TinyGPTConfig``, the config).

:func:`load_pretrained` loads any of the three. ``transformers`` is imported only when a Hugging Face export is read.
Loading ``model.pt`` unpickles Python objects: load only files you trust.

Example::

    small = lightning_pat.shrink(model, trainer_callback)
    lightning_pat.shrink.export.save_pretrained(small, "out/small")
    again = lightning_pat.load_pretrained("out/small")
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pat.shrink.surgery import BASE_CONFIG_ATTR

log = logging.getLogger(__name__)

ENTRY = "lightning_pat"
LOADER = "lightning_pat.load_pretrained"
MODULE_FILE = "model.pt"
SIZES_FILE = "lightning_pat.json"
_VERSION = 1


# ---------------------------------------------------------------------------------------------------- helpers
def _is_hf(model: nn.Module) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and callable(
        getattr(getattr(model, "config", None), "to_dict", None)
    )


def _shapes(model: nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _scalar(value: object) -> bool:
    if isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(isinstance(v, int) for v in value)


def _attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Module name -> its public scalar attributes (sizes, head counts, eps, ...)."""
    out = {}
    for name, module in model.named_modules():
        out[name] = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and _scalar(v)}
    return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device (no memory, no init); buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:  # an already-meta parameter is a tie: keep its identity
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _build_empty(cls: type[nn.Module], config: Any) -> nn.Module:
    with _parameters_on_meta():
        return cls(config)


def _differences(model: nn.Module, other: nn.Module) -> list[str]:
    """What differs between two models' parameter shapes and module attributes (empty: same architecture)."""
    diffs = []
    mine, theirs = _shapes(model), _shapes(other)
    if mine != theirs:
        diffs += [
            f"{n}: {mine.get(n)} vs {theirs.get(n)}"
            for n in sorted(set(mine) | set(theirs))
            if mine.get(n) != theirs.get(n)
        ]
    a, b = _attributes(model), _attributes(other)
    for name in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(name, {})) | set(b.get(name, {}))):
            if a.get(name, {}).get(key) != b.get(name, {}).get(key):
                diffs.append(f"{name}.{key}: {a.get(name, {}).get(key)!r} vs {b.get(name, {}).get(key)!r}")
    return diffs


def _changed(attrs: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]]) -> dict[str, dict]:
    """Module name -> the attributes whose value differs from ``base`` (modules with no change are left out)."""
    out = {}
    for name, values in attrs.items():
        changed = {k: v for k, v in values.items() if base.get(name, {}).get(k) != v}
        if changed:
            out[name] = changed
    return out


# ---------------------------------------------------------------------------------------------------- save
def save_pretrained(model: nn.Module, directory: str | Path) -> Path:
    """Write a (shrunk) model so that :func:`load_pretrained` (and, where possible, stock tools) can load it.

    Args:
        model: A Hugging Face ``PreTrainedModel`` or any ``nn.Module``.
        directory: Output directory (created if needed).

    Returns:
        The directory.

    Raises:
        ValueError: If a Hugging Face model's shapes are not expressible by its config and the config it was built
            from cannot be rebuilt (the message names the class and the fix).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if _is_hf(model):
        _save_hf(model, directory)
    else:
        _save_module(model, directory)
    return directory


def _stock_differences(model: nn.Module) -> list[str]:
    """Why a stock model built from ``model.config`` would not be this model (empty: it would be)."""
    config = copy.deepcopy(model.config)
    try:
        if callable(getattr(config, "validate", None)):
            config.validate()  # e.g. Llama: hidden_size must be a multiple of the head count
        return _differences(model, _build_empty(type(model), config))
    except Exception as err:  # noqa: BLE001 - a config that cannot validate or build is "not expressible"
        return [f"the stock config does not validate or build: {type(err).__name__}: {str(err).strip()[-200:]}"]


def _save_hf(model: nn.Module, directory: Path) -> None:
    diffs = _stock_differences(model)
    if not diffs:
        model.save_pretrained(directory)
        log.info("save_pretrained: %s is expressible by its stock config; no lightning_pat entry", type(model).__name__)
        return
    cls = type(model)
    base_dict = getattr(model, BASE_CONFIG_ATTR, None) or model.config.to_dict()
    try:
        base_config = cls.config_class.from_dict(copy.deepcopy(base_dict))
        base = _build_empty(cls, base_config)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"save_pretrained: {cls.__name__}'s shapes are not expressible by its config ({diffs[:3]}), and no model "
            f"can be built from the config it was shrunk from ({err}). Shrink with lightning_pat.shrink, which "
            "records that config."
        ) from err
    shrunk_config = model.config
    model.config = base_config  # transformers validates the config it writes; the weights are written as they are
    try:
        model.save_pretrained(directory)
    finally:
        model.config = shrunk_config
    config = {**shrunk_config.to_dict(), "architectures": [cls.__name__]}
    config[ENTRY] = {
        "loader": LOADER,
        "version": _VERSION,
        "class": cls.__name__,
        "base_config": base_dict,
        "shapes": _shapes(model),
        "attributes": _changed(_attributes(model), _attributes(base)),
        "why": diffs[:10],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    log.warning(
        "save_pretrained: the stock %s config cannot express this model (%s); load it with "
        "lightning_pat.load_pretrained(%r)",
        cls.__name__,
        diffs[0],
        str(directory),
    )


def _save_module(model: nn.Module, directory: Path) -> None:
    torch.save(model, directory / MODULE_FILE)
    config = getattr(model, "config", None)
    info = {
        "loader": LOADER,
        "version": _VERSION,
        "format": "torch.save",
        "file": MODULE_FILE,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "shapes": _shapes(model),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        info["config"] = dataclasses.asdict(config)
    (directory / SIZES_FILE).write_text(json.dumps(info, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------- load
def load_pretrained(directory: str | Path) -> nn.Module:
    """Load anything :func:`save_pretrained` wrote (and plain Hugging Face model directories).

    Args:
        directory: The export directory.

    Returns:
        The model, in eval mode for Hugging Face exports (as ``from_pretrained`` returns it).

    Raises:
        FileNotFoundError: If the directory holds neither ``config.json`` nor ``lightning_pat.json``.
        ValueError: If the saved shapes and the loaded weights disagree, or the export's version is unknown.
    """
    directory = Path(directory)
    if (directory / SIZES_FILE).is_file():
        return _load_module(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"load_pretrained: {directory} holds neither config.json nor {SIZES_FILE}; pass a directory written by "
            "lightning_pat.shrink.export.save_pretrained or by a transformers model's save_pretrained."
        )
    import transformers

    config = json.loads((directory / "config.json").read_text())
    entry = config.get(ENTRY)
    if entry is None:
        arch = (config.get("architectures") or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        return (cls or transformers.AutoModelForCausalLM).from_pretrained(directory)
    if entry.get("version") != _VERSION:
        raise ValueError(f"load_pretrained: export version {entry.get('version')!r} is not {_VERSION}; upgrade.")
    cls = getattr(transformers, entry["class"])
    base_config = cls.config_class.from_dict(copy.deepcopy(entry["base_config"]))
    model = _build_empty(cls, base_config)
    state = _read_safetensors(directory)
    _materialize(model, entry["shapes"], state)
    for name, values in entry["attributes"].items():
        module = model.get_submodule(name)
        for key, value in values.items():
            old = getattr(module, key, None)
            setattr(module, key, tuple(value) if isinstance(old, tuple) else value)
    model.config.update({k: v for k, v in config.items() if k not in (ENTRY, "transformers_version", "architectures")})
    setattr(model, BASE_CONFIG_ATTR, entry["base_config"])
    return model.eval()


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(directory / name))
    return state


def _materialize(model: nn.Module, shapes: Mapping[str, list[int]], state: Mapping[str, torch.Tensor]) -> None:
    """Give every (meta) parameter a real tensor of its saved shape, filled from ``state``; ties are kept."""
    groups: dict[int, list[str]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        groups.setdefault(id(param), []).append(name)
    if set(shapes) != set(params):
        raise ValueError(
            f"load_pretrained: the export lists parameters {sorted(set(shapes) ^ set(params))[:5]} that the rebuilt "
            "model does not have (or the reverse); the export does not belong to this transformers version's class."
        )
    owners = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    for names in groups.values():
        source = next((state[n] for n in names if n in state), None)
        if source is None:
            raise ValueError(f"load_pretrained: no weights for {names} in the export's safetensors files.")
        if list(source.shape) != list(shapes[names[0]]):
            raise ValueError(
                f"load_pretrained: {names[0]} has shape {list(source.shape)} in the weights but {shapes[names[0]]} in "
                "config.json; the export is inconsistent."
            )
        old = params[names[0]]
        new = nn.Parameter(source.clone().contiguous(), requires_grad=old.requires_grad)
        for module, attr in owners[id(old)]:
            module._parameters[attr] = new


def _load_module(directory: Path) -> nn.Module:
    info = json.loads((directory / SIZES_FILE).read_text())
    if info.get("version") != _VERSION:
        raise ValueError(f"load_pretrained: export version {info.get('version')!r} is not {_VERSION}; upgrade.")
    model = torch.load(directory / info.get("file", MODULE_FILE), weights_only=False)
    if not isinstance(model, nn.Module) or _shapes(model) != info["shapes"]:
        raise ValueError(
            f"load_pretrained: {directory / MODULE_FILE} does not hold the module {SIZES_FILE} describes "
            f"({info.get('class')}); write the export again with save_pretrained."
        )
    return model
