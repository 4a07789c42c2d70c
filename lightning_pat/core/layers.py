"""Layer units: 1-unit clusters that drop a whole layer, marked by the :data:`LAYER_BUDGET` budget (pure, no torch).

Read by the size solver, the scorers and the shrink (which removes the layer a dropped one names).
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_pat.core.spec import ResolvedCluster

#: The ``budget`` name that marks 1-unit layer clusters (see :mod:`lightning_pat.shrink.depth`).
LAYER_BUDGET = "layers"


def is_layer_cluster(rc: ResolvedCluster) -> bool:
    """Whether ``rc`` is a layer unit: a 1-unit cluster in the :data:`LAYER_BUDGET` budget."""
    return rc.budget == LAYER_BUDGET and rc.num_units == 1


def layer_prefix(rc: ResolvedCluster) -> str:
    """The module path a layer cluster removes: the longest common dotted prefix of its members' modules."""
    return common_module_path(m.name for m in rc.members)


def common_module_path(names: Iterable[str]) -> str:
    """The longest module path every one of the parameter ``names`` lies under (``""`` if none).

    Example::

        >>> common_module_path(["model.layers.0.mlp.up.weight", "model.layers.0.mlp.down.weight"])
        'model.layers.0.mlp'
    """
    paths = [name.split(".")[:-1] for name in names]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
