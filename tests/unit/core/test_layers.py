"""Layer units (``core/layers.py``): which clusters drop a whole layer, and the module path they remove.

References written here: resolved clusters built by hand (members with their parameter names) and the prefixes
read off those names.
"""

from __future__ import annotations

from lightning_pat.core.layers import LAYER_BUDGET, is_layer_cluster, layer_prefix
from lightning_pat.core.spec import Member, ResolvedCluster


def _cluster(names: list[str], *, num_units: int = 1, budget: str | None = LAYER_BUDGET) -> ResolvedCluster:
    members = tuple(Member(name, "writer", 0, 0, 4, 4, (4, 4)) for name in names)
    return ResolvedCluster("c", members, num_units=num_units, budget=budget)


def test_a_layer_unit_is_a_one_unit_cluster_in_the_layers_budget():
    assert LAYER_BUDGET == "layers"
    assert is_layer_cluster(_cluster(["model.layers.0.mlp.weight"]))
    assert not is_layer_cluster(_cluster(["model.layers.0.mlp.weight"], num_units=2))
    assert not is_layer_cluster(_cluster(["model.layers.0.mlp.weight"], budget=None))
    assert not is_layer_cluster(_cluster(["model.layers.0.mlp.weight"], budget="mlp"))


def test_layer_prefix_is_the_common_module_path_of_the_members():
    names = [
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.3.norm.weight",
    ]
    assert layer_prefix(_cluster(names)) == "model.layers.3"
    assert layer_prefix(_cluster(["h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias"])) == "h.1.attn.c_proj"
    # "layers.1" and "layers.10" share no module: the prefix stops at whole names, not characters
    assert layer_prefix(_cluster(["layers.1.fc.weight", "layers.10.fc.weight"])) == "layers"
    assert layer_prefix(_cluster(["a.weight", "b.weight"])) == ""
