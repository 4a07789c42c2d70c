"""Per-layer sizes of a Hugging Face config: read for every layer, written back per layer.

A heterogeneous transformers config (``per_layer_config``: Dots3-note's sliding layers, Gemma 4's full-attention
head size) holds some fields per layer; reading such a field on the global config raises transformers'
``AmbiguousGlobalPerLayerAttributeError``. :func:`layer_values` reads a field for every layer (the layer's own config
where the config has per-layer ones, else the one global value), :func:`config_value` a field all layers agree on,
and :func:`write_per_layer` writes new per-layer values as the config's own per-layer overrides, so that stock
``from_pretrained`` builds each layer with its size. Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def is_heterogeneous(config: Any) -> bool:
    """Whether ``config`` holds fields per layer (transformers' ``per_layer_config`` with overrides)."""
    try:
        return bool(getattr(config, "is_heterogeneous", False))
    except Exception:  # noqa: BLE001 - a config whose property raises is not one we can read per layer
        return False


def per_layer_fields(config: Any) -> frozenset[str]:
    """The fields ``config`` holds per layer (empty for a homogeneous config)."""
    if not is_heterogeneous(config):
        return frozenset()
    fields = getattr(config, "per_layer_attributes", None)
    return frozenset(fields) if isinstance(fields, (set, frozenset, list, tuple)) else frozenset()


def _layer_count(config: Any) -> int | None:
    count = getattr(config, "num_hidden_layers", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def layer_values(config: Any, name: str) -> list[Any] | None:
    """``name`` of every decoder layer: each layer's own config for a per-layer field, else ``[global value]``.

    ``None`` where the config has no such field (nor do its layers).
    """
    if name in per_layer_fields(config) and (count := _layer_count(config)) is not None:
        layers = config.per_layer_config
        return [getattr(layers[i], name, None) for i in range(count)]
    try:
        return [getattr(config, name)]
    except Exception:  # noqa: BLE001 - AttributeError, or a per-layer field of a config we cannot read per layer
        return None


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``name`` of ``config`` where every layer holds the same value (a global field: its value), else ``default``."""
    values = layer_values(config, name)
    if not values or any(v != values[0] for v in values[1:]):
        return default
    return values[0]


def has_field(config: Any, name: str) -> bool:
    """Whether ``config`` holds ``name``, globally or per layer (reading it on the global config may raise)."""
    return name in per_layer_fields(config) or layer_values(config, name) is not None


def write_per_layer(config: Any, values: Mapping[str, Sequence[Any]]) -> None:
    """Set field ``name`` of layer ``i`` to ``values[name][i]`` as the config's per-layer overrides.

    The other per-layer overrides the config holds are kept (read through its ``to_dict``); a field whose layers all
    hold one value becomes a global field again (transformers drops overrides equal to the global value).

    Raises:
        ValueError: If ``config`` has no per-layer configs, or a list does not hold one value per layer.
    """
    count = _layer_count(config)
    if count is None or not hasattr(type(config), "per_layer_config"):
        raise ValueError(
            f"{type(config).__name__} holds no per-layer configs (`per_layer_config`), so per-layer values of "
            f"{sorted(values)} cannot be written; expected a transformers config with `num_hidden_layers`."
        )
    for name, per_layer in values.items():
        if len(per_layer) != count:
            raise ValueError(
                f"write_per_layer: {name!r} needs one value per layer ({count}), got {len(per_layer)}: "
                f"{list(per_layer)}."
            )
    saved = config.to_dict().get("per_layer_config") or {}
    overrides: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in saved.items()}
    for name, per_layer in values.items():
        common = per_layer[0] if all(v == per_layer[0] for v in per_layer) else None
        for i, value in enumerate(per_layer):
            layer = overrides.setdefault(i, {})
            if common is None:
                layer[name] = value
            else:
                layer.pop(name, None)
        if common is not None:
            setattr(config, name, common)
        elif name not in per_layer_fields(config):
            setattr(config, name, per_layer[0])  # a global value must exist for the layers' overrides
    # an empty mapping, never None: a config saved with `per_layer_config: {}` is told that no layer differs from the
    # global values (Gemma 4 adds its default full-attention head size as an override where it is missing)
    config.per_layer_config = {i: v for i, v in overrides.items() if v}
