"""The engine (``prune_clusters`` / ``Pruner``) against the independent float64 reference in tests/common."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, Pruner, prune_clusters, resolve_clusters
from lightning_pat.core.norms import ACCUMULATION_DTYPE, channel_sq_sums
from tests.common.cases import Case, make_module, random_case
from tests.common.reference import RefCluster, RefMember, reference_step


def _run(case: Case, dtype: torch.dtype):
    model = make_module({n: t.to(dtype) for n, t in case.tensors.items()})
    result = prune_clusters(model, case.decls, case.sparsity, **case.kwargs)
    ref_kwargs = {k: v for k, v in case.kwargs.items() if k != "executor"}
    weights = {n: t.to(dtype).to(torch.float64) for n, t in case.tensors.items()}
    ref = reference_step(weights, case.refs, case.sparsity, **ref_kwargs)
    return model, result, ref


def _check(case: Case, model: nn.Module, result, ref, *, exact_weights: bool, rtol: float) -> None:
    msg = case.description
    assert result.dropped == ref.dropped, msg
    assert result.num_units == ref.num_units, msg
    assert result.zeros == ref.zeros, msg
    assert result.numel == ref.numel, msg
    params = dict(model.named_parameters())
    for name, original in case.tensors.items():
        got = params[name].detach().to(torch.float64)
        want = ref.weights.get(name, original)
        if exact_weights:
            assert torch.equal(got, want), f"{name}: {msg}"
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=0.0, msg=lambda m, n=name: f"{n}: {msg}\n{m}")
        # literal zeros are exact in every mode
        assert torch.equal(got == 0, want == 0), f"{name}: {msg}"


@pytest.mark.parametrize("seed", range(60))
def test_random_clusters_float64_match_reference(seed):
    case = random_case(seed)
    model, result, ref = _run(case, torch.float64)
    _check(case, model, result, ref, exact_weights=case.kwargs["method"] == "hard", rtol=1e-12)


@pytest.mark.parametrize("seed", range(100, 120))
def test_random_clusters_float32_match_reference(seed):
    case = random_case(seed, dtype=torch.float32)
    model, result, ref = _run(case, torch.float32)
    _check(case, model, result, ref, exact_weights=case.kwargs["method"] == "hard", rtol=1e-5)


@pytest.mark.parametrize("seed", range(200, 215))
def test_random_clusters_group_lasso_float64(seed):
    case = random_case(seed, method="group_lasso")
    model, result, ref = _run(case, torch.float64)
    _check(case, model, result, ref, exact_weights=False, rtol=1e-12)
    # the threshold was placed between two unit norms: something is shrunk but not everything zeroed
    shrunk = [n for n in ref.weights if not torch.equal(ref.weights[n], case.tensors[n].to(torch.float64))]
    assert shrunk, case.description


def test_random_cases_cover_the_feature_matrix():
    """Guard against the generator silently losing coverage (packed slices, GQA, budgets, methods, ...)."""
    descriptions = " ".join(random_case(s).description for s in range(60))
    for needle in (
        "fused_mlp",
        "split_mlp",
        "heads",
        "'gqa'",
        "fused_gqa",
        "residual",
        "'shared'",
        "'rms'",
        "'l2'",
        "'param_cost'",
        "'hard'",
        "'group_lasso'",
        "group_count_ref",
    ):
        assert needle in descriptions, needle
    cases = [random_case(s) for s in range(60)]
    assert any(d.target is not None and d.budget is None for c in cases for d in c.decls)
    assert any(d.multiple_of > 1 for c in cases for d in c.decls)
    assert any(any(d.writers[i].endswith("/2]") for i in range(len(d.writers))) for c in cases for d in c.decls)
    # incidental zeros are present before pruning
    assert sum(int((t == 0).sum()) for c in cases for t in c.tensors.values()) > 20


# ---------------------------------------------------------------------------------------------------- fixed cases


def _mlp(f: int = 6, d: int = 4, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    return make_module(
        {
            "up.weight": torch.randn(f, d, generator=gen, dtype=dtype),
            "up.bias": torch.randn(f, generator=gen, dtype=dtype),
            "down.weight": torch.randn(d, f, generator=gen, dtype=dtype),
        }
    )


MLP = Cluster(name="mlp", writers=["up.weight", "up.bias"], readers=["down.weight"])


def _set_unit_scale(model: nn.Module, scales: list[float]) -> None:
    with torch.no_grad():
        for c, s in enumerate(scales):
            model.up.weight[c] = s
            model.up.bias[c] = s
            model.down.weight[:, c] = s


def test_exact_ties_drop_lowest_index_first():
    model = _mlp()
    _set_unit_scale(model, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert prune_clusters(model, MLP, 0.5).dropped == {"mlp": [0, 1, 2]}


def test_ties_among_the_lowest_scores_break_by_index():
    model = _mlp()
    _set_unit_scale(model, [3.0, 2.0, 5.0, 2.0, 2.0, 4.0])
    assert prune_clusters(model, MLP, 0.34).dropped == {"mlp": [1, 3, 4]}  # ceil(0.34 * 6) = 3
    model = _mlp()
    _set_unit_scale(model, [3.0, 2.0, 5.0, 2.0, 2.0, 4.0])
    assert prune_clusters(model, MLP, 0.3).dropped == {"mlp": [1, 3]}  # ceil(1.8) = 2: the two lowest indices


def test_shared_budget_ties_break_by_cluster_order_then_index():
    model = make_module(
        {
            "a.weight": torch.ones(4, 3, dtype=torch.float64),
            "b.weight": torch.ones(4, 3, dtype=torch.float64),
        }
    )
    decls = [Cluster(name="b", writers=["b.weight"], budget="x"), Cluster(name="a", writers=["a.weight"], budget="x")]
    result = prune_clusters(model, decls, 0.5)  # 4 of 8 tied units: the first declared cluster goes first
    assert result.dropped == {"b": [0, 1, 2, 3], "a": []}
    assert bool((model.a.weight != 0).all())


def test_multiple_of_rounds_kept_count_down():
    model = _mlp(f=10)
    _set_unit_scale(model, [10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    result = prune_clusters(
        model, Cluster(name="mlp", writers=["up.weight", "up.bias"], readers=["down.weight"], multiple_of=4), 0.3
    )
    assert result.dropped == {"mlp": [4, 5, 6, 7, 8, 9]}  # drop 3 -> keep 7 -> rounded down to 4 kept
    model = _mlp(f=10)
    _set_unit_scale(model, [10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    result = prune_clusters(
        model, Cluster(name="mlp", writers=["up.weight", "up.bias"], readers=["down.weight"], multiple_of=4), 0.1
    )
    assert result.dropped == {"mlp": [8, 9]}  # drop 1 -> keep 9 -> 8 kept


def test_multiple_of_nothing_dropped_keeps_all():
    model = _mlp(f=10)
    result = prune_clusters(
        model, Cluster(name="mlp", writers=["up.weight"], readers=["down.weight"], multiple_of=4), 0.0
    )
    assert result.dropped == {"mlp": []}


def test_shared_budget_rounds_each_cluster_to_its_multiple():
    a = torch.tensor([1.0, 2.0, 3.0, 10.0, 11.0, 12.0], dtype=torch.float64)[:, None].expand(6, 3).clone()
    b = torch.tensor([5.0, 6.0, 7.0, 8.0], dtype=torch.float64)[:, None].expand(4, 3).clone()
    decls = [
        Cluster(name="a", writers=["a"], budget="x", multiple_of=2),
        Cluster(name="b", writers=["b"], budget="x", multiple_of=4),
    ]
    # ceil(0.3 * 10) = 3 joint drops, all in a: keep 3 -> 2, so a3 goes too; b drops nothing and is not rounded
    result = prune_clusters(make_module({"a": a, "b": b}), decls, 0.3)
    assert result.dropped == {"a": [0, 1, 2, 3], "b": []}
    # ceil(0.5 * 10) = 5: a0..a2, b0, b1; a keeps 2; b keeps 2 -> 0
    result = prune_clusters(make_module({"a": a, "b": b}), decls, 0.5)
    assert result.dropped == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    refs = [
        RefCluster("a", [RefMember("a", 0, 0, 6)], 6, multiple_of=2, budget="x"),
        RefCluster("b", [RefMember("b", 0, 0, 4)], 4, multiple_of=4, budget="x"),
    ]
    assert reference_step({"a": a, "b": b}, refs, 0.5).dropped == result.dropped


def test_literal_zero_counts_include_incidental_zeros_and_overlaps_once():
    # pat-algorithm.md 1.9: a 4x2 tensor with one zero row plus one isolated zero, one channel chosen, gives 5
    w = torch.tensor([[5.0, 5.0], [0.0, 0.0], [3.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    model = make_module({"w": w})
    result = prune_clusters(model, Cluster(name="rows", writers=["w"]), 0.5)
    assert result.dropped == {"rows": [1, 3]}
    assert result.zeros == {"w": 5}
    assert result.numel == {"w": 8}
    # the isolated zero inside a dropped row is not counted twice
    model = make_module({"w": w})
    result = prune_clusters(model, Cluster(name="rows", writers=["w"]), 0.75)
    assert result.dropped == {"rows": [1, 2, 3]}
    assert result.zeros == {"w": 6}
    # rows of one cluster and columns of another: the overlap entry is counted once
    w = torch.arange(1.0, 13.0, dtype=torch.float64).view(3, 4)
    model = make_module({"w": w})
    result = prune_clusters(model, [Cluster(name="r", writers=["w"]), Cluster(name="c", readers=["w"])], 0.25)
    assert result.dropped == {"r": [0], "c": [0]}
    assert result.zeros == {"w": 4 + 3 - 1}
    assert result.numel == {"w": 12}
    assert model.w[0].tolist() == [0.0] * 4
    assert model.w[:, 0].tolist() == [0.0] * 3
    assert model.w[1:, 1:].tolist() == w[1:, 1:].tolist()


def test_group_count_correction_changes_the_joint_ranking():
    # cluster "small" (C=2) has slightly larger rms than cluster "big" (C=8) per unit
    model = make_module(
        {
            "small.weight": torch.full((2, 3), 1.1, dtype=torch.float64),
            "big.weight": torch.ones(8, 3, dtype=torch.float64),
        }
    )
    decls = [
        Cluster(name="small", writers=["small.weight"], budget="b"),
        Cluster(name="big", writers=["big.weight"], budget="b"),
    ]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = prune_clusters(model, decls, 0.2)  # ceil(0.2 * 10) = 2 -> the two lowest big units
    assert plain.dropped == {"small": [], "big": [0, 1]}
    model.load_state_dict(state)
    corrected = prune_clusters(model, decls, 0.2, group_count_ref=4)  # small * sqrt(2/4), big * sqrt(8/4)
    assert corrected.dropped == {"small": [0, 1], "big": []}
    # the reference agrees
    refs = [
        RefCluster("small", [RefMember("small.weight", 0, 0, 2)], 2, budget="b"),
        RefCluster("big", [RefMember("big.weight", 0, 0, 8)], 8, budget="b"),
    ]
    assert reference_step(state, refs, 0.2, group_count_ref=4).dropped == corrected.dropped
    assert reference_step(state, refs, 0.2).dropped == plain.dropped


def test_score_types_differ_across_a_shared_budget():
    # same per-element magnitude, G differs: rms ties (lowest order first), l2 favours keeping the wide cluster
    model = make_module(
        {
            "narrow.weight": torch.full((4, 2), 1.0, dtype=torch.float64),
            "wide.weight": torch.full((4, 8), 0.9, dtype=torch.float64),
        }
    )
    decls = [
        Cluster(name="narrow", writers=["narrow.weight"], budget="b"),
        Cluster(name="wide", writers=["wide.weight"], budget="b"),
    ]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for score in ("rms", "l2", "param_cost"):
        model.load_state_dict(state)
        out[score] = prune_clusters(model, decls, 0.5, score=score).dropped
    assert out["rms"] == {"narrow": [], "wide": [0, 1, 2, 3]}  # 0.9 < 1.0
    assert out["l2"] == {"narrow": [0, 1, 2, 3], "wide": []}  # sqrt(2) < 0.9 * sqrt(8)
    assert out["param_cost"] == {"narrow": [], "wide": [0, 1, 2, 3]}  # 1/sqrt(2) > 0.9/sqrt(8)


def test_group_lasso_shrinks_and_zeroes_the_floor():
    model = _mlp(f=4, d=3)
    _set_unit_scale(model, [1.0, 2.0, 3.0, 4.0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # G = 3 + 1 + 3 = 7; unit norm = s * sqrt(7); threshold lambda * gamma * sqrt(7) = 1.5 * sqrt(7)
    result = prune_clusters(model, MLP, 0.25, method="group_lasso", reg_lambda=0.75, gamma=2.0)
    # unit 0: norm sqrt(7) < 1.5 sqrt(7) -> zero; floor ceil(0.25 * 4) = 1 -> unit 0 too
    assert result.dropped == {"mlp": [0]}
    expected = [0.0, 2.0 * (1 - 1.5 / 2.0), 3.0 * (1 - 1.5 / 3.0), 4.0 * (1 - 1.5 / 4.0)]
    torch.testing.assert_close(model.up.bias, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(model.down.weight, torch.tensor(expected, dtype=torch.float64).expand(3, 4))
    # a larger floor zeroes unit 1 although its factor is positive
    model.load_state_dict(state)
    result = prune_clusters(model, MLP, 0.5, method="group_lasso", reg_lambda=0.75, gamma=2.0)
    assert result.dropped == {"mlp": [0, 1]}
    torch.testing.assert_close(model.up.bias, torch.tensor([0.0, 0.0, 1.5, 2.5], dtype=torch.float64))
    assert model.up.bias[:2].tolist() == [0.0, 0.0]


def test_group_lasso_zero_lambda_only_applies_the_floor():
    model = _mlp()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hard = prune_clusters(model, MLP, 0.5)
    hard_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    lasso = prune_clusters(model, MLP, 0.5, method="group_lasso", reg_lambda=0.0)
    assert lasso.dropped == hard.dropped
    for k, v in model.state_dict().items():
        assert torch.equal(v, hard_state[k]), k


def test_per_cluster_target_overrides_sparsity():
    model = make_module({"a": torch.randn(10, 2, dtype=torch.float64), "b": torch.randn(10, 2, dtype=torch.float64)})
    result = prune_clusters(
        model, [Cluster(name="a", writers=["a"], target=0.7), Cluster(name="b", writers=["b"])], 0.2
    )
    assert len(result.dropped["a"]) == 7
    assert len(result.dropped["b"]) == 2


def test_target_zero_and_one():
    model = _mlp()
    assert prune_clusters(model, MLP, 0.0).dropped == {"mlp": []}
    assert int((model.up.weight == 0).sum()) == 0
    result = prune_clusters(model, MLP, 1.0)
    assert result.dropped == {"mlp": list(range(6))}
    assert result.zeros == result.numel


def test_tied_parameters_are_scored_and_counted_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4, dtype=torch.float64)
            self.lm_head = nn.Linear(4, 5, bias=False, dtype=torch.float64)
            self.lm_head.weight = self.embed.weight
            self.norm = nn.Parameter(torch.ones(4, dtype=torch.float64))

    torch.manual_seed(0)
    model = Tied()
    with torch.no_grad():
        model.embed.weight.copy_(torch.tensor([1.0, 8.0, 2.0, 4.0], dtype=torch.float64).expand(5, 4))
    decl = Cluster(name="res", writers=["norm"], readers=["embed.weight", "lm_head.weight"])
    [rc] = resolve_clusters(model, decl)
    assert [m.name for m in rc.members] == ["norm", "embed.weight"]
    assert rc.members[1].aliases == ("lm_head.weight",)
    assert rc.unit_numel == 1 + 5
    weights = {"norm": model.norm.detach().clone(), "embed.weight": model.embed.weight.detach().clone()}
    refs = [RefCluster("res", [RefMember("norm", 0, 0, 4), RefMember("embed.weight", 1, 0, 4)], 4)]
    ref = reference_step(weights, refs, 0.5)
    result = prune_clusters(model, decl, 0.5)
    assert result.dropped == ref.dropped == {"res": [0, 2]}
    assert result.zeros == ref.zeros
    assert result.numel == ref.numel == {"norm": 4, "embed.weight": 20}
    assert model.lm_head.weight is model.embed.weight


def test_float64_scores_resolve_differences_below_float32_precision():
    w = torch.ones(2, 3, dtype=torch.float64)
    w[0] *= 1.0 + 1e-12  # unit 0 is a hair larger: in float64 unit 1 is the lowest
    model = make_module({"w": w})
    assert prune_clusters(model, Cluster(name="r", writers=["w"]), 0.5).dropped == {"r": [1]}
    # the same weights in float32 are an exact tie -> the lowest index goes
    model32 = make_module({"w": w.to(torch.float32)})
    assert prune_clusters(model32, Cluster(name="r", writers=["w"]), 0.5).dropped == {"r": [0]}
    assert model.w.dtype == torch.float64


def test_accumulation_dtype_is_float64():
    assert torch.float64 == ACCUMULATION_DTYPE
    # bf16 partial sums do not round to bf16: 257 ones sum to 257 (bf16 would give 256)
    x = torch.ones(2, 257, dtype=torch.bfloat16)
    sums = channel_sq_sums(x, dim=0, acc_dtype=ACCUMULATION_DTYPE)
    assert sums.dtype == torch.float64
    assert sums.tolist() == [257.0, 257.0]
    # float32 partial sums: 2^24 + 1 is not representable in float32 but is in float64
    y = torch.tensor([[4096.0, 1.0]], dtype=torch.float32)
    assert channel_sq_sums(y, dim=0, acc_dtype=ACCUMULATION_DTYPE).item() == 2.0**24 + 1


def test_bfloat16_model_prunes_the_same_units_as_its_float64_copy():
    for seed in range(300, 310):
        case = random_case(seed, dtype=torch.bfloat16, method="hard")
        model16 = make_module({n: t.to(torch.bfloat16) for n, t in case.tensors.items()})
        model64 = make_module({n: t.to(torch.bfloat16).to(torch.float64) for n, t in case.tensors.items()})
        r16 = prune_clusters(model16, case.decls, case.sparsity, **case.kwargs)
        r64 = prune_clusters(model64, case.decls, case.sparsity, **case.kwargs)
        assert r16.dropped == r64.dropped, case.description
        assert r16.zeros == r64.zeros, case.description
        for (n, p16), (_, p64) in zip(model16.named_parameters(), model64.named_parameters(), strict=True):
            assert p16.dtype == torch.bfloat16
            assert torch.equal(p16.to(torch.float64), p64), n


def test_pruner_hold_and_load_dropped():
    model = _mlp()
    [rc] = resolve_clusters(model, MLP)
    pruner = Pruner(model, [rc])
    with torch.no_grad():
        res = pruner.step({"mlp": 0.5}, count=True)
        dropped = res.dropped["mlp"]
        model.up.weight.fill_(1.0)  # "revive" everything, as an optimizer step might
        pruner.hold()
    assert bool((model.up.weight[dropped] == 0).all())
    assert int((model.up.weight == 0).all(dim=1).sum()) == 3
    fresh = Pruner(model, [rc])
    fresh.load_dropped({"mlp": [5, 4]})
    assert fresh.dropped("mlp") == [4, 5]


def test_unit_sparsity_and_param_sparsity():
    model = _mlp(f=4, d=2)
    result = prune_clusters(model, MLP, 0.5)
    assert result.unit_sparsity == 0.5
    assert result.param_sparsity == pytest.approx(sum(result.zeros.values()) / sum(result.numel.values()))
    assert math.isclose(result.param_sparsity, 0.5)
