"""Cluster declarations: expansion, resolution and every validation error (nothing mutated on failure)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, Pruner, prune_clusters, resolve_clusters
from lightning_pat.core.spec import Member, ResolvedCluster
from tests.common.cases import assert_state_unchanged, clone_state, make_module


class Block(nn.Module):
    def __init__(self, d: int = 4, f: int = 6) -> None:
        super().__init__()
        self.up = nn.Linear(d, f, dtype=torch.float64)
        self.down = nn.Linear(f, d, dtype=torch.float64)


class Tiny(nn.Module):
    """12 layers so that natural order (layers.10 after layers.9) matters."""

    def __init__(self, n: int = 12, d: int = 4, f: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d, f) for _ in range(n)])
        self.norm = nn.Parameter(torch.ones(d, dtype=torch.float64))
        self.qkv = nn.Parameter(torch.randn(12, d, dtype=torch.float64))
        self.cube = nn.Parameter(torch.randn(2, 3, 4, dtype=torch.float64))
        self.scalar = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.steps = nn.Parameter(torch.arange(4), requires_grad=False)  # integer "parameter"


def _tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


VALID = Cluster(name="ok", writers=["layers.0.up.weight", "layers.0.up.bias"], readers=["layers.0.down.weight"])


def _assert_rejected(model: nn.Module, decls: list, match: str, **kwargs) -> None:
    """Both resolve_clusters and prune_clusters raise, and no weight changed (a valid cluster comes first)."""
    before = clone_state(model)
    with pytest.raises(ValueError, match=match):
        resolve_clusters(model, decls)
    with pytest.raises(ValueError, match=match):
        prune_clusters(model, [VALID, *decls], 0.5, **kwargs)
    assert_state_unchanged(model, before)


# ---------------------------------------------------------------------------------------------------- errors

BAD_DECLARATIONS = {
    "no match, close names": (
        [Cluster(name="x", writers=["layers.0.up.weigth"])],
        r"Cluster 'x': writer pattern 'layers\.0\.up\.weigth' matches no parameter.*Close parameter names: "
        r"\['layers\.0\.up\.weight'",
    ),
    "no match glob": ([Cluster(name="x", readers=["layers.*.gate.weight"])], r"reader pattern .* matches no param"),
    "no match regex": ([Cluster(name="x", writers=[r"re:layers\.\d+\.gate"])], r"matches no parameter"),
    "no match is not a prefix match": ([Cluster(name="x", writers=[r"re:layers\.0\.up"])], r"matches no parameter"),
    "empty": ([Cluster(name="x")], r"Cluster 'x' is empty"),
    "empty name": ([Cluster(name="", writers=["norm"])], r"Cluster name must be a non-empty string"),
    "patterns as a string": ([Cluster(name="x", writers="norm")], r"`writers` must be a list"),
    "empty pattern": ([Cluster(name="x", writers=[""])], r"`writers` must be a list"),
    "different C": (
        [Cluster(name="x", writers=["layers.1.up.weight"], readers=["layers.1.up.weight"])],
        r"Cluster 'x': members have different channel-axis lengths",
    ),
    "different C, one parameter on both axes": (
        [Cluster(name="x", writers=["qkv"], readers=["qkv"])],
        r"different channel-axis lengths \{'qkv': 12, 'qkv \(dim 1\)': 4\}",
    ),
    "num_units not dividing": (
        [Cluster(name="x", writers=["layers.1.up.weight"], num_units=4)],
        r"not divisible by the unit count C=4",
    ),
    "head_dim: blocks not divisible": (
        [Cluster(name="x", writers=["qkv[0:9]", "layers.1.up.weight"], head_dim=3)],
        r"Cluster 'x': channel-axis lengths \{'qkv\[0:9\]': 9\} are not divisible by the unit count C=2",
    ),
    "head_dim not dividing": (
        [Cluster(name="x", writers=["layers.1.up.weight"], head_dim=4)],
        r"head_dim 4 does not divide the shortest channel-axis length 6",
    ),
    "head_dim zero": ([Cluster(name="x", writers=["norm"], head_dim=0)], r"`head_dim` must be a positive int"),
    "head_dim negative": ([Cluster(name="x", writers=["norm"], head_dim=-2)], r"`head_dim` must be a positive int"),
    "head_dim bool": ([Cluster(name="x", writers=["norm"], head_dim=True)], r"`head_dim` must be a positive int"),
    "head_dim float": ([Cluster(name="x", writers=["norm"], head_dim=2.0)], r"`head_dim` must be a positive int"),
    "num_units zero": ([Cluster(name="x", writers=["norm"], num_units=0)], r"`num_units` must be a positive int"),
    "head_dim and num_units": (
        [Cluster(name="x", writers=["norm"], head_dim=2, num_units=2)],
        r"set `head_dim` or `num_units`, not both",
    ),
    "multiple_of zero": ([Cluster(name="x", writers=["norm"], multiple_of=0)], r"`multiple_of` must be a positive"),
    "multiple_of float": ([Cluster(name="x", writers=["norm"], multiple_of=2.0)], r"`multiple_of` must be a posit"),
    "multiple_of bool": ([Cluster(name="x", writers=["norm"], multiple_of=True)], r"`multiple_of` must be a positi"),
    "target above 1": ([Cluster(name="x", writers=["norm"], target=1.5)], r"`target` must be a number in \[0, 1\]"),
    "target below 0": ([Cluster(name="x", writers=["norm"], target=-0.1)], r"`target` must be a number in \[0, 1\]"),
    "target nan": ([Cluster(name="x", writers=["norm"], target=math.nan)], r"`target` must be a number in \[0, 1\]"),
    "target bool": ([Cluster(name="x", writers=["norm"], target=True)], r"`target` must be a number in \[0, 1\]"),
    "target string": ([Cluster(name="x", writers=["norm"], target="0.5")], r"`target` must be a number in \[0, 1\]"),
    "integer tensor": (
        [Cluster(name="x", writers=["steps"])],
        r"Cluster 'x', member 'steps': expected a floating-point parameter, found dtype torch\.int64",
    ),
    "0-D tensor": ([Cluster(name="x", writers=["scalar"])], r"member 'scalar': a 0-D \(scalar\) parameter"),
    "reader on 1-D": ([Cluster(name="x", readers=["norm"])], r"member 'norm': a reader's channel axis is dim 1"),
    "same parameter twice in one cluster": (
        [Cluster(name="x", writers=["layers.1.up.weight", "layers.1.up.*"])],
        r"Cluster 'x': parameter 'layers\.1\.up\.weight' is listed twice on dim 0",
    ),
    "same parameter twice in two clusters": (
        [Cluster(name="x", writers=["norm"]), Cluster(name="y", writers=["norm"])],
        r"Cluster 'y': parameter 'norm' .* already belongs to cluster 'x'",
    ),
    "overlapping slices": (
        [Cluster(name="x", writers=["qkv[0:6]", "qkv[4:10]"], num_units=2)],
        r"parameter 'qkv' \(dim 0, channels \[4:10\]\) already belongs to this cluster",
    ),
    "overlapping slice and chunk across clusters": (
        [Cluster(name="x", writers=["qkv[0/3]"]), Cluster(name="y", writers=["qkv[2:6]"])],
        r"Cluster 'y'.*already belongs to cluster 'x'",
    ),
    "slice out of range": ([Cluster(name="x", writers=["qkv[8:16]"])], r"slice \[8:16\] is outside the channel"),
    "empty slice": ([Cluster(name="x", writers=["qkv[3:3]"])], r"slice \[3:3\] is outside the channel axis"),
    "chunk index": ([Cluster(name="x", writers=["qkv[3/3]"])], r"chunk \[3/3\] is invalid"),
    "chunk not dividing": ([Cluster(name="x", writers=["qkv[0/5]"])], r"chunk \[0/5\] is invalid"),
    "chunk of zero parts": ([Cluster(name="x", writers=["qkv[0/0]"])], r"chunk \[0/0\] is invalid"),
    "name collision of two declarations": (
        [Cluster(name="x", writers=["norm"]), Cluster(name="x", writers=["qkv"])],
        r"Cluster name 'x' occurs twice after expansion",
    ),
    "name collision after expansion": (
        [Cluster(name="mlp", writers=[r"re:layers\.(?P<layer>[1-9])\.up\.weight"])],
        r"Cluster name 'mlp' occurs twice after expansion",
    ),
    "name with an undefined group": (
        [Cluster(name="mlp.{block}", writers=[r"re:layers\.(?P<layer>[1-9])\.up\.weight"])],
        r"Cluster 'mlp\.\{block\}': the name refers to group 'block'.*available groups: \['layer'\]",
    ),
    "name with a group but patterns without groups": (
        [Cluster(name="mlp.{layer}", writers=["layers.1?.up.weight"])],
        r"the name refers to group 'layer'",
    ),
    "shared budget with different targets": (
        [
            Cluster(name="a", writers=["norm"], budget="b", target=0.5),
            Cluster(name="c", writers=["qkv"], budget="b", target=0.25),
        ],
        r"Budget 'b': clusters \['a', 'c'\] declare different targets",
    ),
    "shared budget, one target left to the default": (
        [Cluster(name="a", writers=["norm"], budget="b", target=0.5), Cluster(name="c", writers=["qkv"], budget="b")],
        r"Budget 'b'.*different targets",
    ),
    "mapping with an unknown field": ([{"name": "x", "writer": ["norm"]}], r"Cannot build a Cluster from"),
}


@pytest.mark.parametrize("case", list(BAD_DECLARATIONS), ids=list(BAD_DECLARATIONS))
def test_bad_declaration_raises_before_any_mutation(case):
    decls, match = BAD_DECLARATIONS[case]
    _assert_rejected(_tiny(), decls, match)


def test_meta_tensor_is_rejected():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"member 'weight': the parameter is on the meta device"):
        resolve_clusters(model, Cluster(name="x", writers=["weight"]))


def test_non_cluster_object_is_a_type_error():
    with pytest.raises(TypeError, match=r"Expected a `Cluster` or a mapping"):
        resolve_clusters(_tiny(), [42])


BAD_OPTIONS = {
    "score": (
        {"score": "max"},
        r"`score` must be one of \('auto', 'rms', 'l2', 'param_cost', 'activation', 'taylor'\), got 'max'",
    ),
    "method": ({"method": "lasso"}, r"`method` must be one of \('hard', 'group_lasso'\), got 'lasso'"),
    "executor": ({"executor": "fast"}, r"`executor` must be one of"),
    "sharded on plain tensors": ({"executor": "sharded"}, r"Cluster 'ok': executor='sharded'"),
    "group_count_ref zero": ({"group_count_ref": 0}, r"`group_count_ref` must be an int >= 1"),
    "group_count_ref bool": ({"group_count_ref": True}, r"`group_count_ref` must be an int >= 1"),
    "negative lambda": (
        {"method": "group_lasso", "reg_lambda": -1.0},
        r"`reg_lambda` must be a number >= 0.0, got -1.0",
    ),
    "negative gamma": ({"method": "group_lasso", "gamma": -1.0}, r"`gamma` must be a number >= 0.0, got -1.0"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS), ids=list(BAD_OPTIONS))
def test_bad_option_raises_before_any_mutation(case):
    kwargs, match = BAD_OPTIONS[case]
    model = _tiny()
    before = clone_state(model)
    with pytest.raises(ValueError, match=match):
        prune_clusters(model, VALID, 0.5, **kwargs)
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("sparsity", [-0.1, 1.5, math.nan, True, "0.5"])
def test_sparsity_outside_unit_interval(sparsity):
    model = _tiny()
    before = clone_state(model)
    with pytest.raises(ValueError, match=r"`sparsity` must be a (finite )?number \[0.0, 1.0\]"):
        prune_clusters(model, VALID, sparsity)
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("budget", [None, "shared"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_non_finite_weights_name_the_cluster(budget, sparsity):
    model = _tiny()
    with torch.no_grad():
        model.layers[3].down.weight[1, 2] = math.nan
    decls = [
        Cluster(name="ok", writers=["layers.0.up.weight"], budget=budget),
        Cluster(name="bad", writers=["layers.3.up.weight"], readers=["layers.3.down.weight"], budget=budget),
    ]
    before = clone_state(model)
    with pytest.raises(ValueError, match=r"Cluster 'bad'.*non-finite scores at units \[2\]"):
        prune_clusters(model, decls, sparsity)
    assert_state_unchanged(model, before)
    with torch.no_grad():
        model.layers[3].down.weight[1, 2] = math.inf
    with pytest.raises(ValueError, match=r"Cluster 'bad'.*non-finite"):
        prune_clusters(model, decls, sparsity, method="group_lasso", reg_lambda=0.1)


def test_pruner_rejects_bad_options():
    model = _tiny()
    resolved = resolve_clusters(model, VALID)
    with pytest.raises(ValueError, match=r"`score` must be one of"):
        Pruner(model, resolved, score="linf")
    with pytest.raises(ValueError, match=r"`group_count_ref` must be an int >= 1, got -3"):
        Pruner(model, resolved, group_count_ref=-3)
    with pytest.raises(ValueError, match=r"`method` must be one of"):
        Pruner(model, resolved).select({"ok": 0.5}, method="soft")


# ---------------------------------------------------------------------------------------------------- resolution


def test_mlp_cluster_members_and_unit_numel():
    [rc] = resolve_clusters(_tiny(), VALID)
    assert isinstance(rc, ResolvedCluster)
    assert rc.name == "ok"
    assert rc.num_units == 6
    assert rc.target is None
    assert rc.multiple_of == 1
    assert rc.budget is None
    assert rc.members == (
        Member("layers.0.up.weight", "writer", 0, 0, 6, 1, (6, 4)),
        Member("layers.0.up.bias", "writer", 0, 0, 6, 1, (6,)),
        Member("layers.0.down.weight", "reader", 1, 0, 6, 1, (4, 6)),
    )
    assert rc.unit_numel == 4 + 1 + 4
    assert rc.param_names == ("layers.0.up.weight", "layers.0.up.bias", "layers.0.down.weight")


def test_mapping_declarations_are_accepted():
    [rc] = resolve_clusters(_tiny(), {"name": "n", "writers": ["norm"], "target": 1, "multiple_of": 2})
    assert rc.name == "n"
    assert rc.target == 1.0
    assert isinstance(rc.target, float)
    assert rc.multiple_of == 2


def test_regex_expansion_in_natural_order():
    decl = Cluster(
        name="mlp.{layer}",
        writers=[r"re:layers\.(?P<layer>\d+)\.up\.(weight|bias)"],
        readers=[r"re:layers\.(?P<layer>\d+)\.down\.weight"],
        target=0.5,
    )
    resolved = resolve_clusters(_tiny(), decl)
    assert [rc.name for rc in resolved] == [f"mlp.{i}" for i in range(12)]
    for i, rc in enumerate(resolved):
        assert rc.param_names == (f"layers.{i}.up.weight", f"layers.{i}.up.bias", f"layers.{i}.down.weight")
        assert rc.target == 0.5
        assert rc.num_units == 6


def test_regex_is_a_full_match():
    resolved = resolve_clusters(_tiny(), Cluster(name="l{i}", writers=[r"re:layers\.(?P<i>1)\.up\.weight"]))
    assert [rc.param_names for rc in resolved] == [("layers.1.up.weight",)]  # not layers.10 / layers.11


def test_pattern_without_groups_joins_every_expanded_cluster():
    model = _tiny()
    [rc] = resolve_clusters(model, Cluster(name="c{layer}", writers=[r"re:layers\.(?P<layer>3)\.down\.weight", "norm"]))
    assert rc.name == "c3"
    assert rc.param_names == ("norm", "layers.3.down.weight")
    # with two expanded clusters the shared member would be pruned by both: rejected
    decl = Cluster(
        name="c{layer}", writers=[r"re:layers\.(?P<layer>[01])\.down\.weight"], readers=["layers.0.up.weight"]
    )
    with pytest.raises(ValueError, match=r"Cluster 'c1': parameter 'layers\.0\.up\.weight'.*cluster 'c0'"):
        resolve_clusters(model, decl)
    decl = Cluster(name="c{layer}", writers=[r"re:layers\.(?P<layer>[01])\.down\.weight", "norm"])
    with pytest.raises(ValueError, match=r"already belongs to cluster 'c0'"):
        resolve_clusters(model, decl)


def test_globs_expand_to_one_cluster():
    [rc] = resolve_clusters(_tiny(), Cluster(name="all_up", writers=["layers.?.up.weight"], num_units=6))
    assert rc.param_names == tuple(f"layers.{i}.up.weight" for i in range(10))
    [rc] = resolve_clusters(_tiny(), Cluster(name="res", writers=["norm", "layers.*.down.weight"]))
    assert rc.num_units == 4
    assert len(rc.members) == 13


def test_packed_slices_and_chunks():
    model = _tiny()
    [q, kv] = resolve_clusters(
        model,
        [
            Cluster(name="q", writers=["qkv[0:4]"], readers=["layers.0.down.weight[2:6]"]),
            Cluster(name="kv", writers=["qkv[1/3]", "qkv[2/3]"], head_dim=2),
        ],
    )
    assert q.num_units == 4
    assert q.members == (
        Member("qkv", "writer", 0, 0, 4, 1, (12, 4)),
        Member("layers.0.down.weight", "reader", 1, 2, 6, 1, (4, 6)),
    )
    assert kv.num_units == 2
    assert [(m.start, m.stop, m.block) for m in kv.members] == [(4, 8, 2), (8, 12, 2)]


def test_gqa_blocks_from_head_dim():
    hd, n_heads, n_kv = 2, 6, 2
    model = make_module(
        {
            "q.weight": torch.randn(n_heads * hd, 8),
            "k.weight": torch.randn(n_kv * hd, 8),
            "v.weight": torch.randn(n_kv * hd, 8),
            "o.weight": torch.randn(8, n_heads * hd),
        }
    )
    [rc] = resolve_clusters(
        model, Cluster(name="attn", writers=["q.weight", "k.weight", "v.weight"], readers=["o.weight"], head_dim=hd)
    )
    assert rc.num_units == n_kv
    assert [m.block for m in rc.members] == [n_heads // n_kv * hd, hd, hd, n_heads // n_kv * hd]
    assert rc.unit_numel == (6 + 2 + 2 + 6) * 8


def test_one_parameter_in_two_clusters_on_different_axes():
    resolved = resolve_clusters(
        _tiny(),
        [
            Cluster(name="mlp", writers=["layers.0.up.weight"], readers=["layers.0.down.weight"]),
            Cluster(name="res", writers=["norm", "layers.0.down.weight"], readers=["layers.0.up.weight"]),
        ],
    )
    assert [(m.name, m.dim) for m in resolved[1].members] == [
        ("norm", 0),
        ("layers.0.down.weight", 0),
        ("layers.0.up.weight", 1),
    ]


def test_one_parameter_on_both_axes_of_one_square_cluster():
    model = make_module({"mix": torch.randn(4, 4), "norm": torch.ones(4)})
    [rc] = resolve_clusters(model, Cluster(name="res", writers=["norm", "mix"], readers=["mix"]))
    assert [(m.name, m.dim) for m in rc.members] == [("norm", 0), ("mix", 0), ("mix", 1)]


def test_disjoint_slices_of_one_parameter_in_one_cluster():
    [rc] = resolve_clusters(_tiny(), Cluster(name="gu", writers=["qkv[0/2]", "qkv[1/2]"]))
    assert rc.num_units == 6
    assert [(m.start, m.stop) for m in rc.members] == [(0, 6), (6, 12)]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.Parameter(torch.ones(4))
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def test_tied_parameters_count_once_with_aliases():
    model = TiedLM()
    for readers in (["embed.weight", "lm_head.weight"], ["lm_head.weight", "embed.weight"], ["*.weight"]):
        [rc] = resolve_clusters(model, Cluster(name="res", writers=["norm"], readers=readers))
        assert len(rc.members) == 2, readers
        assert rc.members[1].name == "embed.weight"
        assert rc.members[1].aliases == ("lm_head.weight",)
        assert rc.unit_numel == 1 + 10
    [rc] = resolve_clusters(model, Cluster(name="res", writers=["norm"], readers=["lm_head.weight"]))
    assert rc.members[1].name == "embed.weight"
    # the tied tensor under its second name in another cluster on the same axis is still a duplicate
    with pytest.raises(ValueError, match=r"parameter 'lm_head\.weight'.*already belongs to cluster 'a'"):
        resolve_clusters(
            model, [Cluster(name="a", readers=["embed.weight"]), Cluster(name="b", readers=["lm_head.weight"])]
        )


def test_fingerprint_is_stable_and_sensitive():
    model = _tiny()
    [a] = resolve_clusters(model, VALID)
    [b] = resolve_clusters(_tiny(), VALID)
    [c] = resolve_clusters(model, Cluster(name="ok", writers=VALID.writers, readers=VALID.readers, target=0.5))
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() != c.fingerprint()


def test_resolution_does_not_mutate():
    model = _tiny()
    before = clone_state(model)
    resolve_clusters(model, [VALID, Cluster(name="res", writers=["norm"], readers=["layers.*.up.weight"])])
    assert_state_unchanged(model, before)


# ---------------------------------------------------------------------------------------------------- explicit dims
def test_explicit_dim_sets_a_members_channel_axis_with_slices():
    params = {"gate_up": torch.zeros(4, 12, 8), "down": torch.zeros(4, 8, 6)}
    [rc] = resolve_clusters(params, Cluster("mlp", ["gate_up@1[0/2]", "gate_up@1[1/2]"], ["down@2"]))
    assert [(m.name, m.role, m.dim, m.start, m.stop, m.block) for m in rc.members] == [
        ("gate_up", "writer", 1, 0, 6, 1), ("gate_up", "writer", 1, 6, 12, 1), ("down", "reader", 2, 0, 6, 1),
    ]  # fmt: skip
    assert rc.num_units == 6
    assert ResolvedCluster.from_dict(rc.to_dict()) == rc


def test_explicit_dim_outside_the_tensor_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"Cluster 'mlp', member 'down': the pattern sets channel-axis dim 3 \(`@3`\), "
                       r"but the tensor is 3-D \(shape \(4, 8, 6\)\); use a dim in \[0, 2\]"):  # fmt: skip
        resolve_clusters({"down": torch.zeros(4, 8, 6)}, Cluster("mlp", readers=["down@3"]))


def test_explicit_dim_axes_are_owned_per_dim():
    params = {"down": torch.zeros(4, 8, 6)}
    experts, channels = resolve_clusters(params, [Cluster("e", ["down"]), Cluster("c", readers=["down@2"])])
    assert (experts.members[0].dim, channels.members[0].dim) == (0, 2)
    with pytest.raises(ValueError, match=r"Cluster 'd': parameter 'down' \(dim 2, channels \[0:6\]\) already belongs"):
        resolve_clusters(params, [Cluster("c", readers=["down@2"]), Cluster("d", ["down@2"])])
