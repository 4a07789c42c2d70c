"""The registry of presets by name, family detection (``clusters="auto"``) and the ``clusters=`` argument's reading.

:data:`PRESETS` maps names to presets (the built-in families and those added with :func:`register`); :func:`detect`
names a model's family from its structure (the modules its decoder layers hold); :func:`resolve_preset` turns a
callback's ``clusters`` argument into declarations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_pat.core.spec import Cluster, as_cluster
from lightning_pat.presets.chains import linear_chain, linear_pairs
from lightning_pat.presets.experts import covers, moe
from lightning_pat.presets.transformers import (
    HOW_TO,
    LAYOUTS,
    Layout,
    find_backbone,
    gpt2,
    llama,
    param_names,
    uncovered,
)

log = logging.getLogger(__name__)

#: A preset: ``(model, *, mlp, heads, residual, layers, query_heads) -> list[Cluster]``.
Preset = Callable[..., list[Cluster]]
#: The option names a preset takes (``preset_options``).
OPTIONS: tuple[str, ...] = ("mlp", "heads", "residual", "layers", "query_heads", "experts")
#: Layouts that :func:`detect` tries: the built-in families, then those registered with one.
_LAYOUTS: dict[str, Layout] = dict(LAYOUTS)
#: Structural detectors that :func:`detect` asks next: family -> ``model -> whether the family's preset covers it``
#: (registered with :func:`register`'s ``detector``, e.g. the mixture-of-experts presets).
_DETECTORS: dict[str, Callable[[nn.Module], bool]] = {}


def model_type(model: nn.Module) -> str | None:
    """``config.model_type`` of ``model``, or of the first Hugging Face model it holds (a LightningModule wrapper)."""
    types = (getattr(getattr(m, "config", None), "model_type", None) for m in model.modules())
    return next((t for t in types if isinstance(t, str)), None)


_DETECTORS["moe"] = covers  # fused routed experts in every decoder layer, found by structure


def detect(model: nn.Module) -> str:
    """The preset name for ``model``, read from its structure (what its modules are, not what they are called).

    A layout fits when its anchor parameter is found (``<prefix>layers.N.self_attn.q_proj.weight``) and it covers
    every decoder layer (:func:`~lightning_pat.presets.transformers.uncovered`: separate ``nn.Linear`` q/k/v/o and
    gate/up/down for the Llama family, ``Conv1D`` for GPT-2, only norms besides); then the structural detectors
    (:func:`register`'s ``detector``) are asked; then ``linear_chain``.

    Args:
        model: The model (or a wrapper holding one backbone).

    Returns:
        One of ``"llama"``, ``"gpt2"``, a registered family (``"tiny_gpt"`` once the demo is imported),
        ``"linear_chain"``.

    Raises:
        ValueError: If no family, or more than one, matches; the message says why each near family does not fit,
            lists the supported families and how to declare clusters by hand.
    """
    names = param_names(model)
    found, why = [], []
    for family, layout in _LAYOUTS.items():
        backbone = find_backbone(layout, names)
        if backbone is None:
            continue
        reason = uncovered(layout, model, backbone[0])
        if reason is None:
            found.append(family)
        else:
            why.append(f"not {family}: {reason}")
    found += [family for family, detector in _DETECTORS.items() if detector(model)]
    if len(found) > 1:
        raise ValueError(f"The model matches several families {found}; pass one backbone, or name a preset.")
    if found:
        return found[0]
    if not why and linear_pairs(model):
        return "linear_chain"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    reasons = f" ({'; '.join(why)})" if why else ""
    raise ValueError(
        f"Cannot detect the model family of {type(model).__name__} (model_type={model_type!r}){reasons}. {HOW_TO}"
    )


def for_model(model: nn.Module, **options: bool) -> list[Cluster]:
    """Detect the family of ``model`` (see :func:`detect`) and return its preset's declarations.

    Args:
        model: The model (or a wrapper holding one backbone).
        **options: ``mlp``, ``heads``, ``residual`` for the preset (each preset's defaults apply otherwise).

    Returns:
        The declarations.

    Raises:
        ValueError: If the family cannot be detected, or the preset rejects the options.
    """
    family = detect(model)
    log.info("presets.for_model: %s detected as %r", type(model).__name__, family)
    return PRESETS[family](model, **options)


PRESETS: dict[str, Preset] = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "gpt2": gpt2,
    "linear_chain": linear_chain,
    "moe": moe,
}


def register(
    name: str, preset: Preset, *, layout: Layout | None = None, detector: Callable[[nn.Module], bool] | None = None
) -> None:
    """Add the preset ``name`` (usable as ``clusters=name``); with a layout or a detector, :func:`detect` finds it.

    Registering the same preset again is a no-op (a module imported twice, e.g. by a notebook's re-run cell).

    Args:
        name: The preset's name (lower case).
        preset: A callable ``(model, *, mlp, heads, residual, layers) -> list[Cluster]``.
        layout: The family's parameter layout, for detection by ``clusters="auto"``.
        detector: ``model -> bool``: whether the preset covers ``model`` (every decoder layer), for a family that a
            :class:`Layout` cannot describe.

    Raises:
        ValueError: If ``name`` is ``"auto"``, not lower case, or already names another preset.
    """
    if name == "auto" or name != name.lower() or PRESETS.get(name, preset) is not preset:
        raise ValueError(
            f"presets.register: cannot register {name!r}: the name must be lower case, not 'auto', and not taken by "
            f"another preset (taken: {sorted(PRESETS)})."
        )
    PRESETS[name] = preset
    if layout is not None:
        _LAYOUTS[name] = layout
    if detector is not None:
        _DETECTORS[name] = detector


def get(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive; ``"auto"`` is :func:`for_model`).

    Args:
        name: A key of :data:`PRESETS`, or ``"auto"``.

    Returns:
        A callable ``(model, **options) -> list[Cluster]``.

    Raises:
        ValueError: If the name is unknown.
    """
    key = name.lower() if isinstance(name, str) else name
    if key == "auto":
        return for_model
    if key not in PRESETS:
        raise ValueError(
            f"Unknown preset {name!r}; expected one of {[*PRESETS, 'auto']}, or a list of Cluster declarations."
        )
    return PRESETS[key]


def check_options(options: Mapping[str, object]) -> None:
    """Raise unless ``options`` maps preset option names (:data:`OPTIONS`) to bools.

    Raises:
        ValueError: If a key is unknown or a value is not a bool.
    """
    bad = {k: v for k, v in dict(options).items() if k not in OPTIONS or not isinstance(v, bool)}
    if bad:
        raise ValueError(f"`preset_options` must map some of {OPTIONS} to bools, got {bad}; e.g. {{'residual': True}}.")


def resolve_preset(
    clusters: str | Cluster | Mapping[str, Any] | Sequence[str | Cluster | Mapping[str, Any]],
    model: nn.Module,
    **options: bool,
) -> list[Cluster]:
    """Turn a callback's ``clusters`` argument into declarations.

    Args:
        clusters: A preset name or ``"auto"``, a ``Cluster`` or mapping of its fields, or a list mixing them
            (preset names expand in place).
        model: The module the declarations will be resolved against.
        **options: ``mlp``, ``heads``, ``residual`` for the named presets.

    Returns:
        The declarations, in order.

    Raises:
        ValueError: If a preset name is unknown or rejects the model, an option is unknown or not a bool, or options
            are given without any preset name.
        TypeError: If an entry is neither a name, a ``Cluster`` nor a mapping.
    """
    check_options(options)
    return expand(clusters, model, options)


def expand(
    clusters: str | Cluster | Mapping[str, Any] | Sequence[str | Cluster | Mapping[str, Any]],
    model: nn.Module,
    options: Mapping[str, bool],
) -> list[Cluster]:
    """:func:`resolve_preset` with ``options`` taken as checked (by :func:`check_options`, once, by the caller).

    :class:`~lightning_pat.pruning.options.PruningOptions` checks its ``preset_options`` when it is built; the
    callback's declarations are expanded here, without a second check.

    Raises:
        ValueError: If a preset name is unknown or rejects the model, or options are given without any preset name.
        TypeError: If an entry is neither a name, a ``Cluster`` nor a mapping.
    """
    entries = [clusters] if isinstance(clusters, (str, Cluster, Mapping)) else list(clusters)
    if options and not any(isinstance(e, str) for e in entries):
        raise ValueError(f"`preset_options` {dict(options)} apply to preset names only; none was given.")
    out: list[Cluster] = []
    for entry in entries:
        out.extend(get(entry)(model, **options) if isinstance(entry, str) else [as_cluster(entry)])
    return out
