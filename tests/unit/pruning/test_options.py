"""Options are checked once, where they enter, by the same checkers (issue 26, review §1d).

The callback's :class:`PruningOptions` and ``prune_clusters``' :class:`StepOptions` word a bad option alike; the
plan and the pruner take a plan's options as they are, and a direct ``Pruner`` call still refuses an unknown method
instead of pruning as ``"hard"``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, presets, resolve_clusters
from lightning_pat.core.checks import check_bool, check_choice, check_number
from lightning_pat.presets.registry import expand
from lightning_pat.pruning.options import (
    SIZE_OPTIONS,
    Distillation,
    PruningOptions,
    SizeTarget,
    StepOptions,
    check_one_size,
)
from lightning_pat.pruning.plan import make_plan
from lightning_pat.pruning.pruner import Pruner

#: name -> (options, message); each is given to both PruningOptions and StepOptions (with a sparsity if no size)
SHARED = {
    "score": (
        {"score": "max"},
        r"`score` must be one of \('auto', 'rms', 'l2', 'param_cost', 'activation', 'taylor'\)",
    ),
    "method": ({"method": "lasso"}, r"`method` must be one of \('hard', 'group_lasso'\), got 'lasso'"),
    "reg_lambda": ({"reg_lambda": -1.0}, r"`reg_lambda` must be a number >= 0.0, got -1.0"),
    "reg_lambda nan": ({"reg_lambda": math.nan}, r"`reg_lambda` must be a finite number >= 0.0"),
    "group_count_ref": ({"group_count_ref": 0}, r"`group_count_ref` must be an int >= 1, got 0"),
    "group_count_ref bool": ({"group_count_ref": True}, r"`group_count_ref` must be an int >= 1, got True"),
    "target_side": ({"target_params": 0.5, "target_side": "near"}, r"`target_side` must be one of .* got 'near'"),
    "target_widths": ({"target_params": 0.5, "target_widths": "mixed"}, r"`target_widths` must be one of"),
    "seq_len alone": ({"target_params": 0.5, "seq_len": 8}, r"give `seq_len` with it"),
    "seq_len zero": ({"target_flops": "1M", "seq_len": 0}, r"`seq_len` .* must be an int >= 1, got 0"),
    "min_kept": ({"target_params": 0.5, "min_kept": 0.5}, r"set target_widths='ranked' too"),
}


SIZED = [case for case, (options, _) in SHARED.items() if set(options) <= set(SIZE_OPTIONS)]


@pytest.mark.parametrize("case", SIZED, ids=SIZED)
def test_the_size_target_group_words_a_bad_size_option_as_the_entry_points_do(case):
    options, match = SHARED[case]
    with pytest.raises(ValueError, match=match):
        SizeTarget(**options)


@pytest.mark.parametrize("case", list(SHARED), ids=list(SHARED))
def test_the_callback_and_prune_clusters_word_a_bad_option_alike(case):
    options, match = SHARED[case]
    sized = "target_params" in options or "target_flops" in options
    with pytest.raises(ValueError, match=match):
        PruningOptions(clusters="linear_chain", **options)
    with pytest.raises(ValueError, match=match):
        StepOptions(**({} if sized else {"sparsity": 0.5}), **options)


def test_step_options_refuse_what_only_one_step_cannot_do():
    with pytest.raises(ValueError, match=r"exactly one of them"):
        StepOptions()
    with pytest.raises(ValueError, match=r"exactly one of them"):
        StepOptions(target_params=0.5, target_flops="1M", seq_len=8)
    with pytest.raises(ValueError, match=r"score='taylor' .* exists only during training"):
        StepOptions(sparsity=0.5, score="taylor")
    with pytest.raises(ValueError, match=r"`gamma` must be a number >= 0.0"):
        StepOptions(sparsity=0.5, gamma=-1.0)
    with pytest.raises(ValueError, match=r"`target_allocation` must be one of"):
        StepOptions(target_params=0.5, target_allocation="greedy")
    assert StepOptions(sparsity=1).sparsity == 1.0


def test_a_size_target_drops_the_sparsity_with_a_warning():
    with pytest.warns(UserWarning, match=r"prune_clusters: `sparsity=0.5` is unused"):
        opts = StepOptions(sparsity=0.5, target_params="1M")
    assert (opts.sparsity, opts.sizing.value) == (None, "1M")


def _mlp() -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    return mlp, resolve_clusters(mlp, Cluster(name="h", writers=["0.weight", "0.bias"], readers=["2.weight"]))


def test_a_pruner_given_resolved_clusters_checks_its_options_and_a_plan_is_taken_as_built():
    mlp, resolved = _mlp()
    with pytest.raises(ValueError, match=r"`group_count_ref` must be an int >= 1, got 0"):
        Pruner(mlp, resolved, group_count_ref=0)
    plan = make_plan(mlp, resolved, score="l2")
    pruner = Pruner(mlp, plan, score="rms")  # the plan's options win; nothing is checked again
    assert pruner.score == "l2"


@pytest.mark.parametrize("verb", ["select", "step"])
def test_an_unknown_method_is_refused_not_pruned_as_hard(verb):
    mlp, resolved = _mlp()
    before = [p.detach().clone() for p in mlp.parameters()]
    pruner = Pruner(mlp, resolved)
    with pytest.raises(ValueError, match=r"`method` must be one of \('hard', 'group_lasso'\), got 'soft'"):
        getattr(pruner, verb)({"h": 0.5}, method="soft")
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.parameters(), strict=True))
    assert pruner.last == {}


def test_preset_options_are_checked_by_the_public_resolve_preset_and_once_by_the_options():
    mlp, _ = _mlp()
    with pytest.raises(ValueError, match=r"`preset_options` must map some of"):
        presets.resolve_preset("linear_chain", mlp, bogus=True)
    with pytest.raises(ValueError, match=r"`preset_options` must map some of"):
        PruningOptions(clusters="linear_chain", preset_options={"bogus": True})
    with pytest.raises(ValueError, match=r"`preset_options` must be a mapping"):
        PruningOptions(clusters="linear_chain", preset_options=[("mlp", True)])  # type: ignore[arg-type]
    assert expand("linear_chain", mlp, {}) == presets.resolve_preset("linear_chain", mlp)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (True, r"`x` must be a number \[0.0, 1.0\], got True"),
        ("0.5", r"`x` must be a number \[0.0, 1.0\], got '0.5'"),
        (math.nan, r"`x` must be a finite number \[0.0, 1.0\], got nan"),
        (math.inf, r"`x` must be a finite number \[0.0, 1.0\], got inf"),
        (1.5, r"`x` must be a number \[0.0, 1.0\], got 1.5"),
    ],
)
def test_check_number(value, match):
    with pytest.raises(ValueError, match=match):
        check_number("x", value, low=0.0, high=1.0)


def test_check_number_integer_choice_and_bool():
    check_number("n", 3, low=1, integer=True)
    check_number("x", 0, low=0.0, high=1.0)
    with pytest.raises(ValueError, match=r"`n` must be an int >= 1, got 2.0"):
        check_number("n", 2.0, low=1, integer=True)
    with pytest.raises(ValueError, match=r"`n` must be an int >= 1, got nan"):
        check_number("n", math.nan, low=1, integer=True)
    check_choice("k", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"`k` must be one of \('a', 'b'\), got 'c'"):
        check_choice("k", "c", ["a", "b"])
    check_bool("b", False)
    with pytest.raises(ValueError, match=r"`b` must be a bool \(True or False\), got 'false'"):
        check_bool("b", "false")


def test_the_groups_hold_the_flat_options_and_the_saved_size_options_keep_their_format():
    flat = {"target_params": "1M", "target_side": "above", "target_widths": "ranked", "min_kept": 0.5}
    opts = PruningOptions(clusters="linear_chain", **flat)
    assert opts.sizing == SizeTarget(**flat)
    assert (opts.sizing.value, opts.sizing.option, opts.size_target) == ("1M", "target_params", "1M")
    # a saved ``allocation`` entry's ``options``: these names, in this order, with the flat values
    assert list(opts.size_options()) == [
        "target_params", "target_flops", "seq_len", "target_side", "target_layers", "target_widths", "min_kept",
        "target_allocation",
    ]  # fmt: skip
    assert opts.size_options() == {name: getattr(opts, name) for name in SIZE_OPTIONS}
    step = StepOptions(target_flops="2M", seq_len=16, target_allocation="fractions")
    assert (step.sizing.value, step.sizing.option, step.sizing.target_allocation) == ("2M", "target_flops", "fractions")
    assert StepOptions(sparsity=0.5).sizing == SizeTarget(target_allocation="importance")


def test_the_distillation_group_holds_the_flat_options_normalised(tmp_path):
    teacher = nn.Linear(2, 2)
    opts = PruningOptions(
        clusters="linear_chain", distill_alpha=1, distill_temperature=2, distill_teacher=teacher,
        distill_module="model", distill_teacher_store="file", distill_teacher_dir=tmp_path,
    )  # fmt: skip
    group = opts.distillation
    assert (group.alpha, group.temperature, group.module, group.teacher_store) == (1.0, 2.0, "model", "file")
    assert isinstance(group.alpha, float)
    assert isinstance(group.temperature, float)
    assert group.teacher is teacher
    assert group.teacher_dir == str(tmp_path) == opts.distill_teacher_dir
    assert (opts.distill_alpha, opts.distill_temperature, opts.distill) == (1.0, 2.0, True)
    assert not PruningOptions(clusters="linear_chain").distillation.on
    for bad, match in (
        ({"alpha": 2.0}, r"`distill_alpha` must be a number \[0.0, 1.0\], got 2.0"),
        ({"temperature": 0}, r"`distill_temperature` must be a number > 0"),
        ({"alpha": 0.5, "teacher_dir": "x"}, r"`distill_teacher_dir='x'` is set but `distill_teacher_store` is"),
    ):
        with pytest.raises(ValueError, match=match):
            Distillation(**bad)
        with pytest.raises(ValueError, match=match):
            PruningOptions(clusters="linear_chain", **{f"distill_{k}": v for k, v in bad.items()})


def test_exactly_one_size_is_worded_per_entry_point():
    with pytest.raises(ValueError) as one_step:
        check_one_size("prune_clusters", sparsity=None, target_params=None, target_flops=None)
    assert str(one_step.value) == (
        "prune_clusters needs `sparsity` (a fraction of each cluster's units), `target_params` (a size such as '350M' "
        "or 0.5 of the model) or `target_flops` (FLOPs per token), exactly one of them; got sparsity=None, "
        "target_params=None, target_flops=None."
    )
    with pytest.raises(ValueError) as sizing:
        check_one_size("size_clusters", target_params=0.5, target_flops="1M")
    assert str(sizing.value) == (
        "size_clusters needs `target_params` or `target_flops`, exactly one of them; got target_params=0.5, "
        "target_flops='1M'."
    )
    check_one_size("size_clusters", target_params=0.5, target_flops=None)
