"""Depth shrink: delete dropped decoder layers and renumber the rest (layer units, see ``presets.layer_units``).

A layer unit is a 1-unit cluster in the ``layers`` budget over a layer's output projections; once they are zero
the layer is the identity on the residual stream (pre-norm), so deleting it keeps the output. The layer's module
is the longest common module prefix of the cluster's members (``model.layers.3``); it must be an element of an
``nn.ModuleList``. After the deletion every module attribute ``layer_idx`` (Hugging Face attention, used by the
KV cache) holds the new index, and each ``config`` gets the new layer count (``num_hidden_layers``, ``n_layer``,
``num_layers``) and its per-layer lists (``layer_types``) filtered to the kept layers.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from torch import nn

from lightning_pat.core.layers import is_layer_cluster, layer_prefix
from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.shrink.model_meta import config_owners

log = logging.getLogger(__name__)

#: Config attributes holding the number of layers.
LAYER_COUNTS: tuple[str, ...] = ("num_hidden_layers", "n_layer", "num_layers")
#: Config attributes holding one entry per layer.
PER_LAYER: tuple[str, ...] = ("layer_types",)


@dataclass(frozen=True)
class LayerCut:
    """Dropped layers, split from the width clusters.

    Attributes:
        prefixes: Module paths of the dropped layers (as named in the clusters).
        clusters: The width clusters (layer units removed).
        dropped: Their dropped units.
        members: Parameter names of the dropped layer units' members (checked to be zero).
    """

    prefixes: tuple[str, ...]
    clusters: tuple[ResolvedCluster, ...]
    dropped: dict[str, list[int]]
    members: tuple[str, ...]


def split_layers(clusters: Sequence[ResolvedCluster], dropped: Mapping[str, Sequence[int]]) -> LayerCut:
    """Separate layer units from width clusters.

    A dropped layer's width clusters stay: their cut keeps the widths uniform for the config, and the layer goes
    afterwards.
    """
    prefixes = tuple(layer_prefix(rc) for rc in clusters if is_layer_cluster(rc) and dropped.get(rc.name))
    members = tuple(m.name for rc in clusters if is_layer_cluster(rc) and dropped.get(rc.name) for m in rc.members)

    width = tuple(rc for rc in clusters if not is_layer_cluster(rc))  # a dropped layer's widths are cut too
    names = {rc.name for rc in width}
    return LayerCut(prefixes, width, {k: list(v) for k, v in dropped.items() if k in names}, members)


def _strip(name: str, names: set[str]) -> str | None:
    """``name``, or ``name`` with a leading module path removed, as found in ``names`` (a LightningModule's prefix)."""
    parts = name.split(".")
    for i in range(len(parts)):
        candidate = ".".join(parts[i:])
        if candidate in names:
            return candidate
    return None


def locate(model: nn.Module, cut: LayerCut) -> dict[str, list[int]]:
    """ModuleList path -> dropped indices; validates before anything changes.

    Raises:
        ValueError: If a dropped layer is not an element of an ``nn.ModuleList`` of ``model``, or every layer of a
            list would go.
    """
    modules = {n for n, _ in model.named_modules()}
    out: dict[str, list[int]] = {}
    for prefix in cut.prefixes:
        found = _strip(prefix, modules)
        parent, _, index = (found or "").rpartition(".")
        holder = model.get_submodule(parent) if found else None
        if found is None or not isinstance(holder, nn.ModuleList) or not index.isdigit():
            raise ValueError(
                f"shrink: dropped layer {prefix!r} is not an element of an nn.ModuleList of {type(model).__name__}; "
                "a layer unit's members must share the layer's module path (e.g. `model.layers.3.`)."
            )
        out.setdefault(parent, []).append(int(index))
    for parent, idx in out.items():
        if len(set(idx)) >= len(cast(nn.ModuleList, model.get_submodule(parent))):  # checked by the loop above
            raise ValueError(f"shrink: every layer of {parent!r} is dropped; keep at least one layer.")
    return out


def check_identity(model: nn.Module, cut: LayerCut) -> None:
    """Warn if a dropped layer's output projections are not exactly zero (the shrink would then change the output)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in cut.members:
        found = _strip(name, set(params))
        if found is not None and bool(params[found].detach().ne(0).any()):
            warnings.warn(
                f"shrink: layer member {found!r} is not zero; removing its layer changes the model's output (was "
                "the mask applied?).",
                PruningWarning,
                stacklevel=3,
            )


def remove_layers(model: nn.Module, where: Mapping[str, Sequence[int]]) -> None:
    """Delete the layers at ``where`` (from :func:`locate`), renumber ``layer_idx`` and update the configs."""
    for parent, idx in where.items():
        holder = model.get_submodule(parent)
        assert isinstance(holder, nn.ModuleList)
        old = len(holder)
        kept = [i for i in range(old) if i not in set(idx)]
        new_list = nn.ModuleList([holder[i] for i in kept])
        owner_name, _, attr = parent.rpartition(".")
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, new_list)
        for new, layer in enumerate(new_list):
            for module in layer.modules():
                if isinstance(getattr(module, "layer_idx", None), int):
                    module.layer_idx = new  # type: ignore[assignment]  # an int attribute (transformers' layers)
        for owner in config_owners(model):
            _update_config(owner.config, old, kept)
        log.info("shrink: removed layers %s of %s (%d -> %d)", sorted(set(idx)), parent, old, len(kept))


def _update_config(config: object, old: int, kept: Sequence[int]) -> None:
    for name in LAYER_COUNTS:
        if getattr(config, name, None) == old:
            setattr(config, name, len(kept))
    for name in PER_LAYER:
        values = getattr(config, name, None)
        if isinstance(values, list) and len(values) == old:
            setattr(config, name, [values[i] for i in kept])
