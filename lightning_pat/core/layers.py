"""Layer units: 1-unit clusters that drop a whole layer, marked by the :data:`LAYER_BUDGET` budget (pure, no torch).

Read by the size solver, the scorers and the shrink (which removes the layer a dropped one names).
"""

from __future__ import annotations

from lightning_pat.core.spec import ResolvedCluster

#: The ``budget`` name that marks 1-unit layer clusters (see :mod:`lightning_pat.shrink.depth`).
LAYER_BUDGET = "layers"


def is_layer_cluster(rc: ResolvedCluster) -> bool:
    """Whether ``rc`` is a layer unit: a 1-unit cluster in the :data:`LAYER_BUDGET` budget."""
    return rc.budget == LAYER_BUDGET and rc.num_units == 1


def layer_prefix(rc: ResolvedCluster) -> str:
    """The module path a layer cluster removes: the longest common dotted prefix of its members' modules."""
    paths = [m.name.split(".")[:-1] for m in rc.members]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
