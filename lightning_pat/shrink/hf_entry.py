"""The ``"lightning_pat"`` entry of a Hugging Face config: what a stock config cannot say about a shrunk model.

A stock model built from ``model.config`` has the shrunk model's shapes when the new sizes are uniform. Otherwise
(GPT-2 with dropped heads, per-layer widths, a rescaled RMSNorm eps that differs between norms) the entry names the
loader, the class, the config to build before resizing, every parameter shape and every module attribute that
differs. :func:`record` puts it on ``model.config`` at shrink time, so that the model's own ``save_pretrained``
writes it into ``config.json`` and ``lightning_pat.load_pretrained`` reloads that directory exactly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, cast

from torch import nn

log = logging.getLogger(__name__)

ENTRY = "lightning_pat"
LOADER = "lightning_pat.load_pretrained"
VERSION = 1

# the model's config before its first shrink (plain dict), kept on the model so that an export can say what to build
BASE_CONFIG_ATTR = "_lightning_pat_base_config"


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model (``save_pretrained`` and a config with ``to_dict``)."""
    return callable(getattr(model, "save_pretrained", None)) and callable(
        getattr(getattr(model, "config", None), "to_dict", None)
    )


def shapes(model: nn.Module) -> dict[str, list[int]]:
    """Parameter name (every name of a tied parameter) -> shape."""
    return {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _scalar(value: object) -> bool:
    if isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(isinstance(v, int) for v in value)


def attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Module name -> its public scalar attributes (sizes, head counts, eps, ...)."""
    out = {}
    for name, module in model.named_modules():
        out[name] = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and _scalar(v)}
    return out


class _Config(Protocol):
    """What is read here of a transformers ``PretrainedConfig`` (the shrink does not import transformers)."""

    def to_dict(self) -> dict[str, Any]: ...


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device (no memory, no init); buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:  # an already-meta parameter is a tie: keep its identity
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    # patched on the class for the build (a plain function where a method was): every module registers on meta
    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]  # the original method back


def build_empty(cls: type[nn.Module], config: Any) -> nn.Module:
    """``cls(config)`` with its parameters on the meta device."""
    with _parameters_on_meta():
        return cls(config)


def differences(model: nn.Module, other: nn.Module) -> list[str]:
    """What differs between two models' parameter shapes and module attributes (empty: same architecture)."""
    diffs = []
    mine, theirs = shapes(model), shapes(other)
    if mine != theirs:
        diffs += [
            f"{n}: {mine.get(n)} vs {theirs.get(n)}"
            for n in sorted(set(mine) | set(theirs))
            if mine.get(n) != theirs.get(n)
        ]
    a, b = attributes(model), attributes(other)
    for name in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(name, {})) | set(b.get(name, {}))):
            if a.get(name, {}).get(key) != b.get(name, {}).get(key):
                diffs.append(f"{name}.{key}: {a.get(name, {}).get(key)!r} vs {b.get(name, {}).get(key)!r}")
    return diffs


def _changed(
    attrs: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Module name -> the attributes whose value differs from ``base`` (modules with no change are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for name, values in attrs.items():
        changed = {k: v for k, v in values.items() if base.get(name, {}).get(k) != v}
        if changed:
            out[name] = changed
    return out


def stock_differences(model: nn.Module) -> list[str]:
    """Why a stock model built from ``model.config`` would not be this model (empty: it would be)."""
    config = copy.deepcopy(model.config)
    with contextlib.suppress(AttributeError):
        delattr(config, ENTRY)
    try:
        validate = getattr(config, "validate", None)
        if callable(validate):
            validate()  # e.g. Llama: hidden_size must be a multiple of the head count
        return differences(model, build_empty(type(model), config))
    except Exception as err:  # noqa: BLE001 - a config that cannot validate or build is "not expressible"
        return [f"the stock config does not validate or build: {type(err).__name__}: {str(err).strip()[-200:]}"]


def base_config(model: nn.Module) -> tuple[dict[str, Any], Any]:
    """The config dict the model was built from before its first shrink, and that config object.

    Raises:
        ValueError: If no model can be built from it (the message names the class and the fix).
    """
    cls = type(model)
    base_dict = getattr(model, BASE_CONFIG_ATTR, None) or cast(_Config, model.config).to_dict()
    base_dict = {k: v for k, v in base_dict.items() if k != ENTRY}
    try:
        config = cast(Any, cls).config_class.from_dict(copy.deepcopy(base_dict))  # a transformers model class
        build_empty(cls, config)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"save_pretrained: {cls.__name__}'s shapes are not expressible by its config, and no model can be built "
            f"from the config it was shrunk from ({err}). Shrink with lightning_pat.shrink, which records that config."
        ) from err
    return base_dict, config


def entry(model: nn.Module) -> dict[str, Any] | None:
    """The ``"lightning_pat"`` entry for ``model``'s config, or ``None`` when the stock config expresses the model.

    Raises:
        ValueError: As for :func:`base_config`.
    """
    diffs = stock_differences(model)
    if not diffs:
        return None
    base_dict, config = base_config(model)
    base = build_empty(type(model), config)
    return {
        "loader": LOADER,
        "version": VERSION,
        "class": type(model).__name__,
        "base_config": base_dict,
        "shapes": shapes(model),
        "attributes": _changed(attributes(model), attributes(base)),
        "why": diffs[:10],
    }


def record(model: nn.Module) -> dict[str, Any] | None:
    """Put :func:`entry` on ``model.config`` (or remove a stale one); the model's own ``save_pretrained`` writes it.

    Returns:
        The entry, or ``None`` if the stock config expresses the model.

    Raises:
        ValueError: As for :func:`base_config`.
    """
    found = entry(model)
    if found is None:
        with contextlib.suppress(AttributeError):
            delattr(model.config, ENTRY)
    else:
        setattr(model.config, ENTRY, found)
    return found
