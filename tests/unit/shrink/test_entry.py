"""Physical shrink: the shrunk model computes what the masked model computed, for every family, kind and fraction.

References are independent of the shrink code: the masked model's own outputs, kept indices recomputed here from
the dropped units, and the module shapes read back from the weights.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from torch import nn

import lightning_pat
from lightning_pat import Cluster, Pruner, presets, prune_clusters, resolve_clusters, shrink
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.demo import preset as demo_preset
from lightning_pat.shrink import LayerNormShrinkWarning, ShrinkPlan, apply_plan, build_plan, slice_optimizer_state
from tests.common.tiny_families import CASES, FamilyCase, llama_like, logits, tiny_gpt, token_ids

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

KINDS = {"mlp": ("mlp",), "heads": ("heads",), "residual": ("residual",), "all": ("mlp", "heads", "residual")}
FRACTIONS = (0.25, 0.5, 0.75)
case_params = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def clusters_of(case: FamilyCase, model: nn.Module, kinds: tuple[str, ...]) -> list[Cluster]:
    return presets.PRESETS[case.preset](model, **{k: k in kinds for k in ("mlp", "heads", "residual")})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def assert_modules_consistent(model: nn.Module) -> None:
    """Module metadata matches the weights; every parameter is contiguous."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert m.weight.shape == (m.out_features, m.in_features), name
        elif isinstance(m, nn.Embedding):
            assert m.weight.shape[1] == m.embedding_dim, name
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            assert tuple(m.normalized_shape) == tuple(m.weight.shape), name
        elif type(m).__name__ == "Conv1D":
            assert m.weight.shape == (m.nx, m.nf), name
    assert all(p.is_contiguous() for p in model.parameters())


def input_embedding(model: nn.Module) -> nn.Embedding:
    return model.embed if hasattr(model, "embed") else model.get_input_embeddings()


def heads_emptied(case: FamilyCase, kinds: tuple[str, ...], frac: float) -> bool:
    """Whether ``ceil(frac * KV heads)`` drops every head of a layer (refused before anything changes)."""
    return "heads" in kinds and math.ceil(round(frac * case.n_kv, 9)) >= case.n_kv


# ---------------------------------------------------------------------------------------------------- exactness
@case_params
@pytest.mark.parametrize("kind", list(KINDS))
def test_shrunk_equals_masked(case, kind):
    for frac in FRACTIONS:
        model = case.fresh()
        clusters = clusters_of(case, model, KINDS[kind])
        if heads_emptied(case, KINDS[kind], frac):  # e.g. 75% of 2 KV heads: refused up front, nothing changes
            before = snapshot(model)
            with pytest.raises(ValueError, match=r"A target below 1 would remove every unit of .*'heads\.0'"):
                prune_clusters(model, clusters, frac)
            assert_unchanged(model, before)
            result = prune_clusters(model, clusters, 1.0)  # asked for explicitly: the shrink refuses it, unchanged
            before = snapshot(model)
            with pytest.raises(ValueError, match="every head would be dropped"):
                shrink(model, result)
            assert_unchanged(model, before)
            continue
        result = prune_clusters(model, clusters, frac)
        ids = token_ids()
        masked = logits(model, ids)
        layernorm = case.preset == "gpt2" and "residual" in KINDS[kind]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            small = shrink(model, result)
        assert small is model
        assert type(small) is type(case.fresh())
        assert any(issubclass(w.category, LayerNormShrinkWarning) for w in caught) == layernorm
        assert_modules_consistent(small)
        numel = sum(p.numel() for p in small.parameters())
        assert numel < sum(p.numel() for p in case.fresh().parameters())
        err = rel_err(logits(small, ids), masked)
        if layernorm:
            assert err > 1e-2  # documented: not output-preserving
        else:
            assert err < 1e-5, (frac, err)
        if case.tied:
            assert small.lm_head.weight is input_embedding(small).weight


@case_params
def test_kept_indices_and_sizes_match_an_independent_reference(case):
    model = case.fresh()
    reference = copy.deepcopy(model)
    result = prune_clusters(model, clusters_of(case, model, ("mlp",)), 0.5)
    shrink(model, result)
    layers = reference.get_submodule(case.layers)
    small_layers = model.get_submodule(case.layers)
    for i in range(case.n_layer):
        kept = [c for c in range(case.ff) if c not in set(result.dropped[f"mlp.{i}"])]
        down = layers[i].get_submodule(case.down)
        small_down = small_layers[i].get_submodule(case.down)
        if case.preset == "gpt2":  # Conv1D: [in, out]
            torch.testing.assert_close(small_down.weight, down.weight[kept], rtol=0, atol=0)
        else:
            torch.testing.assert_close(small_down.weight, down.weight[:, kept], rtol=0, atol=0)
    width = case.ff - len(result.dropped["mlp.0"])
    config = model.config
    assert {
        getattr(config, "intermediate_size", None),
        getattr(config, "n_inner", None),
        getattr(config, "d_ff", None),
    } >= {width}


@pytest.mark.parametrize("case", [c for c in CASES if c.n_kv > 2], ids=[c.id for c in CASES if c.n_kv > 2])
def test_heads_update_module_and_config_counts(case):
    model = case.fresh()
    result = prune_clusters(model, clusters_of(case, model, ("heads",)), 0.5)
    shrink(model, result)
    kept_groups = case.n_kv - len(result.dropped["heads.0"])
    n_rep = case.n_head // case.n_kv
    attn = model.get_submodule(case.layers)[0].get_submodule(case.o.rsplit(".", 1)[0])
    if case.preset == "gpt2":
        assert attn.num_heads == kept_groups
        assert attn.split_size == kept_groups * case.head_dim
        assert model.config.n_head == kept_groups
    else:
        assert attn.q_proj.out_features == kept_groups * n_rep * case.head_dim
        assert attn.k_proj.out_features == kept_groups * case.head_dim
        assert attn.head_dim == case.head_dim
        config = model.config
        heads = getattr(config, "num_attention_heads", getattr(config, "n_head", None))
        kv = getattr(config, "num_key_value_heads", getattr(config, "n_kv_head", None))
        assert (heads, kv, config.head_dim) == (kept_groups * n_rep, kept_groups, case.head_dim)


def test_rmsnorm_residual_is_rescaled():
    case = llama_like("llama", n_head=4, n_kv=2)
    model = case.fresh()
    old_eps = model.config.rms_norm_eps
    old_w = model.model.norm.weight.detach().clone()
    result = prune_clusters(model, clusters_of(case, model, ("residual",)), 0.5)
    shrink(model, result)
    kept = [c for c in range(case.d) if c not in set(result.dropped["residual"])]
    ratio = case.d / len(kept)
    torch.testing.assert_close(model.model.norm.weight, old_w[kept] * math.sqrt(ratio))
    assert model.model.norm.variance_epsilon == pytest.approx(old_eps * ratio)
    assert model.config.rms_norm_eps == pytest.approx(old_eps * ratio)
    assert model.config.hidden_size == len(kept)


def test_torch_rmsnorm_without_eps_gets_an_explicit_one():
    net = nn.Sequential(nn.Linear(4, 8), nn.RMSNorm(8), nn.Linear(8, 3))
    [rc] = resolve_clusters(net, Cluster("r", writers=["0.weight", "0.bias", "1.weight"], readers=["2.weight"]))
    prune_clusters(net, [Cluster("r", writers=["0.weight", "0.bias", "1.weight"], readers=["2.weight"])], 0.5)
    x = torch.randn(5, 4)
    with torch.no_grad():
        ref = net(x)
        shrink(
            net, {"clusters": [rc.to_dict()], "dropped": {"r": [i for i in range(8) if net[0].weight[i].eq(0).all()]}}
        )
        torch.testing.assert_close(net(x), ref)
    assert net[1].eps == pytest.approx(torch.finfo(torch.float32).eps * 2)


# ---------------------------------------------------------------------------------------------------- plain models
def test_hand_declared_clusters_on_a_plain_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 12), nn.LayerNorm(12), nn.Linear(12, 3))
    clusters = [Cluster("hidden", writers=["0.weight", "0.bias"], readers=["2.weight"])]
    x = torch.randn(7, 6)
    for frac in FRACTIONS:
        model = copy.deepcopy(net)
        result = prune_clusters(model, clusters, frac)
        with torch.no_grad():
            ref = model(x)
            small = shrink(model, result, inplace=False)
            assert small is not model
            assert small[0].out_features == 16 - len(result.dropped["hidden"])
            assert rel_err(small(x), ref) < 1e-6
            assert model[0].out_features == 16  # the original is untouched


@pytest.mark.parametrize("frac", FRACTIONS)
def test_linear_chain_preset(frac):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 2))
    result = prune_clusters(net, presets.linear_chain(net), frac)
    x = torch.randn(9, 5)
    with torch.no_grad():
        ref = net(x)
        shrink(net, result)
        assert rel_err(net(x), ref) < 1e-6
    assert (net[0].out_features, net[2].out_features) == (
        16 - len(result.dropped["hidden.0"]),
        12 - len(result.dropped["hidden.2"]),
    )


# ---------------------------------------------------------------------------------------------------- non-uniform
def test_shared_budget_gives_each_layer_its_own_width():
    case = llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3)
    model = case.fresh()
    with torch.no_grad():  # make the layers differ, so that a shared budget ranks them differently
        model.model.layers[0].mlp.up_proj.weight.mul_(4.0)
    decls = [Cluster(**{**c.__dict__, "budget": "mlp"}) for c in clusters_of(case, model, ("mlp",))]
    result = prune_clusters(model, decls, 0.5)
    widths = {case.ff - len(result.dropped[f"mlp.{i}"]) for i in range(case.n_layer)}
    assert len(widths) > 1
    ids = token_ids()
    ref = logits(model, ids)
    shrink(model, result)
    assert rel_err(logits(model, ids), ref) < 1e-5
    assert [layer.mlp.intermediate_size for layer in model.model.layers] == [
        case.ff - len(result.dropped[f"mlp.{i}"]) for i in range(case.n_layer)
    ]
    assert model.config.intermediate_size == case.ff  # not uniform: config keeps it, the export records per layer


# ---------------------------------------------------------------------------------------------------- sources
def test_every_source_gives_the_same_model():
    case = tiny_gpt(n_head=4, n_kv=2, bias=True, tied=False)
    model = case.fresh()
    result = prune_clusters(model, clusters_of(case, model, ("mlp", "heads")), 0.5)
    state = {"clusters": [rc.to_dict() for rc in result.clusters], "dropped": result.dropped}
    state = json.loads(json.dumps(state))  # plain types only
    ckpt = {"state_dict": {}, "callbacks": {"CoupledPruningCallback{'clusters': 'x'}": state, "Other": {}}}
    outs = []
    for source in (result, state, ckpt):
        small = shrink(model, source, inplace=False)
        outs.append(snapshot(small))
    for other in outs[1:]:
        assert list(other) == list(outs[0])
        assert all(torch.equal(other[k], outs[0][k]) for k in other)


def test_a_callback_like_source_and_an_inner_model_with_a_prefix():
    case = tiny_gpt(n_head=4, n_kv=4)

    class Lit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = case.fresh()

    lit = Lit()
    resolved = resolve_clusters(lit, demo_preset.tiny_gpt(lit))
    pruner = Pruner(lit, resolved)
    with torch.no_grad():
        pruner.step({rc.name: 0.5 for rc in resolved})

    class FakeCallback:  # duck-typed like CoupledPruningCallback after fit
        def __init__(self) -> None:
            self.resolved = resolved
            self.dropped = {rc.name: pruner.dropped(rc.name) for rc in resolved}

    ids = token_ids()
    ref = logits(lit.model, ids)
    small = shrink(lit.model, FakeCallback())  # names are under "model.": the prefix is stripped
    assert rel_err(logits(small, ids), ref) < 1e-5


def test_resolved_cluster_dict_round_trip():
    case = llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True)
    model = case.fresh()
    for rc in resolve_clusters(model, clusters_of(case, model, ("mlp", "heads", "residual"))):
        data = json.loads(json.dumps(rc.to_dict()))
        assert ResolvedCluster.from_dict(data) == rc
        assert ResolvedCluster.from_dict(data).fingerprint() == rc.fingerprint()
    with pytest.raises(ValueError, match="missing or invalid field"):
        ResolvedCluster.from_dict({"name": "x"})


def test_prune_result_carries_its_clusters():
    case = tiny_gpt(n_head=4, n_kv=2)
    model = case.fresh()
    decls = clusters_of(case, model, ("mlp",))
    result = prune_clusters(model, decls, 0.5)
    assert result.clusters == tuple(resolve_clusters(case.fresh(), decls))


def test_source_errors():
    model = tiny_gpt(n_head=4, n_kv=2).fresh()
    with pytest.raises(TypeError, match="PruneResult"):
        shrink(model, 3)
    with pytest.raises(ValueError, match="no CoupledPruningCallback state"):
        shrink(model, {"callbacks": {"ModelCheckpoint": {}}})
    with pytest.raises(ValueError, match="2 CoupledPruningCallback states"):
        shrink(model, {"callbacks": {"CoupledPruningCallbackA": {}, "CoupledPruningCallbackB": {}}})
    with pytest.raises(ValueError, match="no 'clusters' entry"):
        shrink(model, {"dropped": {}, "step": 3})
    with pytest.raises(ValueError, match="not among the clusters"):
        build_plan([], {"mlp.0": [1]})
    [rc] = resolve_clusters(nn.Sequential(nn.Linear(2, 4)), Cluster("h", writers=["0.weight", "0.bias"]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        build_plan([rc], {"h": [4]})


# ---------------------------------------------------------------------------------------------------- errors
def test_unknown_module_type_raises_before_anything_changes():
    torch.manual_seed(0)
    net = nn.Sequential(nn.PReLU(8), nn.Linear(8, 2))  # PReLU has no rewrite rule
    clusters = [Cluster("c", writers=["0.weight"], readers=["1.weight"])]
    result = prune_clusters(net, clusters, 0.5)
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"'0\.weight' is used by module '0' of type PReLU.*cannot rewrite"):
        shrink(net, result)
    assert_unchanged(net, before)


def test_parameter_owned_by_a_custom_module_raises_naming_it():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.gain

    net = nn.Sequential(nn.Linear(4, 8), Scale(), nn.Linear(8, 2))
    result = prune_clusters(net, [Cluster("h", writers=["0.weight", "0.bias", "1.gain"], readers=["2.weight"])], 0.5)
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"'1\.gain' is used by module '1' of type Scale \(attribute 'gain'\)"):
        shrink(net, result)
    assert_unchanged(net, before)


def test_rows_without_their_bias_raise():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    result = prune_clusters(net, [Cluster("h", writers=["0.weight"], readers=["2.weight"])], 0.5)
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"list `0\.bias` in the same cluster as `0\.weight`"):
        shrink(net, result)
    assert_unchanged(net, before)


def test_embedding_rows_and_partial_heads_raise():
    model = tiny_gpt(n_head=4, n_kv=2, tied=False).fresh()
    before = snapshot(model)
    vocab = prune_clusters(model, [Cluster("v", writers=["embed.weight"])], 0.25)
    with pytest.raises(ValueError, match=r"'embed\.weight' \(Embedding\.weight\) would lose indices on dim 0"):
        shrink(model, vocab)
    model = tiny_gpt(n_head=4, n_kv=2, tied=False).fresh()
    partial = [Cluster("q", writers=["layers.0.attn.q_proj.weight"], readers=["layers.0.attn.o_proj.weight"])]
    result = prune_clusters(model, partial, 0.25)  # single channels, not whole heads
    before = snapshot(model)
    with pytest.raises(ValueError, match="split heads of head_dim 8.*heads cluster"):
        shrink(model, result)
    assert_unchanged(model, before)
    model = tiny_gpt(n_head=4, n_kv=2, tied=False).fresh()
    q_only = [
        Cluster("q", writers=["layers.0.attn.q_proj.weight"], readers=["layers.0.attn.o_proj.weight"], head_dim=8)
    ]
    result = prune_clusters(model, q_only, 0.25)  # whole query heads, but not as many in every KV group
    with pytest.raises(ValueError, match=r"keep \[1, 2\] heads of the 2 KV groups.*the same number in every group"):
        shrink(model, result)


def test_shape_mismatch_and_missing_parameter_raise():
    case = tiny_gpt(n_head=4, n_kv=2)
    model = case.fresh()
    result = prune_clusters(model, clusters_of(case, model, ("mlp",)), 0.5)
    shrink(model, result)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert shrink(model, result) is model  # already small (as after shrink_on_freeze): returned as it is
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    with pytest.raises(ValueError, match="is not a parameter of Sequential"):
        shrink(nn.Sequential(nn.Linear(2, 2)), result)


def test_nonzero_dropped_units_warn_for_a_result_and_are_refused_for_a_saved_state():
    """A PruneResult of another model warns (in memory, the caller's choice); a state read from a file whose mask
    is not zero in the weights is refused before anything changes (issue 23, A3): it does not belong to them."""
    from lightning_pat.pruning.pruner import PruneResult

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    [rc] = resolve_clusters(net, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=r"the dropped units are not zero in the weights \(cluster 'h' in"):
        shrink(net, {"clusters": [rc.to_dict()], "dropped": {"h": [0, 1]}})
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    with pytest.warns(UserWarning, match="not zero in the model"):
        shrink(net, PruneResult(dropped={"h": [0, 1]}, num_units={"h": 8}, clusters=(rc,)))


# ---------------------------------------------------------------------------------------------------- plan + optimizer
def test_plan_and_optimizer_state_slicing_against_a_reference():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    [rc] = resolve_clusters(net, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]))
    plan = build_plan([rc], {"h": [1, 5, 6]})
    kept = [0, 2, 3, 4, 7]
    assert isinstance(plan, ShrinkPlan)
    assert tuple(plan.slice("2.weight", net[2].weight).shape) == (3, 5)
    opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), torch.optim.AdamW(net.parameters(), lr=1e-2)]
    for _ in range(2):
        for opt in opts:
            opt.zero_grad()
            net(torch.randn(6, 4)).square().sum().backward()
            opt.step()
    with torch.no_grad():
        net[0].weight[[1, 5, 6]] = 0
        net[0].bias[[1, 5, 6]] = 0
        net[2].weight[:, [1, 5, 6]] = 0
    sgd, adam = (copy.deepcopy(o.state_dict()) for o in opts)
    apply_plan(net, plan, optimizers=opts)
    ids = {name: i for i, name in enumerate(n for n, _ in net.named_parameters())}  # state_dict keys are positions
    w0, b0, w2 = ids["0.weight"], ids["0.bias"], ids["2.weight"]
    torch.testing.assert_close(
        opts[0].state[net[0].weight]["momentum_buffer"], sgd["state"][w0]["momentum_buffer"][kept]
    )
    torch.testing.assert_close(
        opts[0].state[net[2].weight]["momentum_buffer"], sgd["state"][w2]["momentum_buffer"][:, kept]
    )
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opts[1].state[net[0].bias][key], adam["state"][b0][key][kept])
        torch.testing.assert_close(opts[1].state[net[2].weight][key], adam["state"][w2][key][:, kept])
    assert float(opts[1].state[net[0].weight]["step"]) == float(adam["state"][w0]["step"]) == 2.0
    assert torch.equal(opts[1].state[net[2].bias]["exp_avg"], adam["state"][ids["2.bias"]]["exp_avg"])  # untouched
    for opt in opts:  # and the optimizers keep stepping on the smaller parameters
        opt.zero_grad()
        net(torch.randn(6, 4)).square().sum().backward()
        opt.step()


def test_optimizer_state_of_another_shape_raises_before_anything_changes():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    [rc] = resolve_clusters(net, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]))
    plan = build_plan([rc], {"h": [1]})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.state[net[0].weight]["factored"] = torch.zeros(8)
    before = snapshot(net)
    with pytest.raises(ValueError, match="holds state 'factored' of shape"):
        apply_plan(net, plan, optimizers=[opt])
    assert_unchanged(net, before)
    with pytest.raises(ValueError, match="holds state 'factored'"):
        slice_optimizer_state(opt, plan, dict(net.named_parameters()))


def test_public_names():
    assert lightning_pat.shrink is shrink


@pytest.mark.parametrize("kinds", [("mlp", "heads"), ("mlp", "heads", "residual")])
def test_shrunk_tiny_gpt_is_the_model_its_new_config_builds(kinds):
    """No leftover masks, hooks or odd strides: the shrunk model is structurally the model built from its config."""
    from lightning_pat.demo.model import TinyGPT
    from lightning_pat.shrink.hf_entry import differences as _differences

    case = tiny_gpt(n_head=4, n_kv=2, bias=True, tied=False)
    model = case.fresh()
    shrink(model, prune_clusters(model, clusters_of(case, model, kinds), 0.5))
    fresh = TinyGPT(copy.deepcopy(model.config))
    diffs = _differences(model, fresh)
    if "residual" in kinds:  # TinyGPTConfig has no eps field: only the rescaled RMSNorm eps differs
        assert diffs
        assert all(d.split(":")[0].endswith(".eps") for d in diffs)
    else:
        assert diffs == []
    assert {n: (p.shape, p.stride()) for n, p in model.named_parameters()} == {
        n: (p.shape, p.stride()) for n, p in fresh.named_parameters()
    }
    assert all(not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks) for m in model.modules())
    assert {n for n, _ in model.named_buffers()} == {n for n, _ in fresh.named_buffers()}


def test_check_shrinkable_changes_nothing_and_names_the_problem():
    from lightning_pat.shrink import check_shrinkable

    case = tiny_gpt(n_head=4, n_kv=2, bias=True, tied=False)
    model = case.fresh()
    before = snapshot(model)
    check_shrinkable(model, resolve_clusters(model, clusters_of(case, model, ("mlp", "heads", "residual"))))
    assert_unchanged(model, before)
    no_bias = resolve_clusters(model, Cluster("h", writers=["layers.0.mlp.up_proj.weight"]))
    with pytest.raises(ValueError, match=r"list `layers\.0\.mlp\.up_proj\.bias` in the same cluster"):
        check_shrinkable(model, no_bias)
    assert_unchanged(model, before)
