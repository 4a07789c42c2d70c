"""The score of a training run (lightning_pat.training.score_choice): ``"auto"`` settled once, what a score needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat import Cluster
from lightning_pat.core.spec import resolve_clusters
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.pruning.plan import make_plan
from lightning_pat.training.errors import ConfigurationError
from lightning_pat.training.score_choice import ScoreChoice, check_scores, resolve_score, scored

LINEAR = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])


class PlainReader(nn.Module):
    """The hidden channels are read by a plain parameter (no nn.Linear reader: no activation statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.ones(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.scale.t()


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def choose(module: nn.Module, clusters: list[Cluster], *, fsdp1: bool = False, saved: str | None = None, **options):
    opts = PruningOptions(clusters, target_sparsity=0.5, **options)
    return resolve_score(opts, module=module, clusters=resolve_clusters(module, clusters), fsdp1=fsdp1, saved=saved)


def test_auto_settles_on_activation_with_linear_readers_and_builds_its_statistics():
    choice = choose(mlp(), [LINEAR])
    assert choice.score == "activation"
    assert choice.act is not None
    assert list(choice.act.modules) == ["2"]
    assert "input statistics" in choice.reason


def test_auto_is_rms_under_fsdp1_and_where_no_linear_reads_the_units():
    assert choose(mlp(), [LINEAR], fsdp1=True) == ScoreChoice(
        "rms", "the activation score does not run under FSDPStrategy (FSDP1)"
    )
    plain = [Cluster("h", writers=["fc.weight", "fc.bias"], readers=["scale"])]
    fallback = choose(PlainReader(), plain)
    assert (fallback.score, fallback.act) == ("rms", None)
    assert fallback.reason.startswith("the activation score cannot score these clusters: ")
    with pytest.raises(ConfigurationError, match=r"^CoupledPruningCallback\(score='activation'\): Cluster 'h'"):
        choose(PlainReader(), plain, score="activation")  # named explicitly: refused, not replaced


@pytest.mark.parametrize(("saved", "fsdp1", "expected"), [("rms", False, "rms"), ("activation", True, "rms")])
def test_auto_continues_the_checkpoints_score_where_it_runs(saved, fsdp1, expected):
    choice = choose(mlp(), [LINEAR], fsdp1=fsdp1, saved=saved)
    assert choice.score == expected
    if not fsdp1:
        assert choice.reason == "the checkpoint's score"
    assert choose(mlp(), [LINEAR], saved="rms", score="activation").score == "activation"  # explicit: kept


def test_scored_builds_the_pruner_with_the_choice_and_only_the_collectors_it_needs():
    net = mlp()
    plan = make_plan(net, [LINEAR], score="rms")
    params = dict(net.named_parameters())
    pruner, collectors = scored(plan, params, ScoreChoice("taylor"), module=net, layer_score="cosine")
    assert pruner.plan.score == "taylor"
    assert collectors.taylor is not None
    assert (collectors.act, collectors.layers) == (None, None)
    choice = choose(net, [LINEAR])
    pruner, collectors = scored(plan, params, choice, module=net, layer_score="cosine")
    assert pruner.plan.score == "activation"
    assert (collectors.act, collectors.taylor) == (choice.act, None)
    for p in params.values():
        p.requires_grad_(False)
    with pytest.raises(
        ConfigurationError, match=r"^CoupledPruningCallback\(score='taylor'\): cluster 'h' has no member"
    ):
        scored(plan, params, ScoreChoice("taylor"), module=net, layer_score="cosine")


def test_check_scores_refuses_at_bind_what_no_checkpoint_changes_and_hooks_nothing():
    net = mlp()
    plan = make_plan(net, [LINEAR], score="rms")
    params = dict(net.named_parameters())
    for score in ("auto", "activation", "taylor", "rms"):
        opts = PruningOptions([LINEAR], target_sparsity=0.5, score=score)
        check_scores(opts, module=net, plan=plan, params=params, fsdp1=False)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())  # the dry run hooks nothing
    for p in params.values():
        p.requires_grad_(False)
    opts = PruningOptions([LINEAR], target_sparsity=0.5, score="taylor")
    with pytest.raises(ConfigurationError, match=r"^CoupledPruningCallback\(score='taylor'\): cluster 'h' has no"):
        check_scores(opts, module=net, plan=plan, params=params, fsdp1=False)
    plain = [Cluster("h", writers=["fc.weight", "fc.bias"], readers=["scale"])]
    reader = PlainReader()
    opts = PruningOptions(plain, target_sparsity=0.5, score="activation")
    with pytest.raises(ConfigurationError, match=r"score='activation'\): Cluster 'h'"):
        check_scores(opts, module=reader, plan=make_plan(reader, plain), params={}, fsdp1=False)
    check_scores(
        PruningOptions(plain, target_sparsity=0.5), module=reader, plan=make_plan(reader, plain), params={}, fsdp1=False
    )
