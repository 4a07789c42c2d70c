"""Expert scores from training forwards on 2 gloo ranks (lightning_pat.scoring.experts.ExpertStats).

Each rank trains on other tokens; at the selection both ranks sum the per-expert score vectors in one collective
and get the same bits, so both drop the same experts: those of one process that saw the tokens of both ranks.
With layer units too (LayerStats), the controller's selection sums both statistics in one collective (counted on the
real gloo group) and gets the bits and the mask of a collective each, as selections did before.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.common.dist import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(180)]


def _model():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=64, attn_implementation="eager",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).train()


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def _scores_and_drop(ranks_seen: list[int], kind: str) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    import lightning_pat as lp
    from lightning_pat.scoring.experts import ExpertStats

    model = _model()
    clusters = lp.resolve_clusters(model, lp.presets.moe(model, mlp=False, heads=False))
    stats = ExpertStats(model, clusters, kind=kind)
    stats.attach()
    for rank in ranks_seen:  # one training batch per rank's tokens, each a real optimizer step
        stats.begin_batch()
        model(input_ids=_tokens(rank)).logits.sum().backward()
        stats.end_batch(stepped=True)
    scores = stats.summed_scores()
    assert scores is not None
    result = lp.Pruner(model, clusters, score="l2").step({rc.name: 0.5 for rc in clusters}, scores=scores)
    return {n: s.tolist() for n, s in scores.items()}, result.dropped


def _worker(rank: int, world_size: int, kind: str) -> object:
    if kind != "reap_sum":  # one kind suffices for the selection: the packing does not depend on it
        return _scores_and_drop([rank], kind), None, None
    return _scores_and_drop([rank], kind), _select(rank, packed=True), _select(rank, packed=False)


#: The torch.distributed collectives a selection may issue (each counted, then run on the real gloo group).
COLLECTIVES = (
    "all_gather_into_tensor", "all_gather_single", "all_gather", "all_gather_object", "all_reduce", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
)  # fmt: skip


@contextlib.contextmanager
def _counted(calls: list[tuple[str, int]]):
    """Record ``(collective, elements sent)`` for every collective issued inside; each still runs on its group."""
    import torch.distributed as dist

    def wrap(name, real):
        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            calls.append((name, tensors[-1].numel() if tensors else -1))  # what it sends: a gather's last tensor
            return real(*args, **kwargs)

        return counted

    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in real.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _one_at_a_time(*stats):
    """What a selection did before: each collector's sums summed over the ranks in a collective of its own."""
    import torch.distributed as dist

    from lightning_pat.parallel.comm import reduce

    return [None if s is None else reduce.sum_over_ranks(s.stacked(), group=dist.group.WORLD) for s in stats]


def _select(rank: int, *, packed: bool) -> dict:
    """The controller's first selection (``expert_score="reap_sum"``) with layer units, after a batch of this rank's."""
    import lightning_pat as lp
    from lightning_pat.pruning.options import PruningOptions
    from lightning_pat.training import per_step
    from lightning_pat.training.controller import PruningController

    model = _model()
    clusters = lp.presets.moe(model, mlp=False, heads=False, layers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the ranks' weights stay equal: only their tokens differ
    ctl = PruningController(PruningOptions(clusters, target_sparsity=0.5, warmup_steps=0, ramp_steps=2, mode="direct"))
    ctl.bind(model, optimizers=[opt])
    ctl.start()
    ctl.before_batch(first_of_epoch=True)

    def closure():
        opt.zero_grad()
        loss = model(input_ids=_tokens(rank)).logits.sum()
        loss.backward()
        ctl.after_backward(opt)
        return loss

    opt.step(closure)
    layers, experts = ctl.scorers.layers, ctl.scorers.experts
    assert layers is not None
    assert experts is not None
    width = layers.stacked().numel() + experts.stacked().numel()
    calls: list[tuple[str, int]] = []
    original = per_step.summed_over_ranks
    per_step.summed_over_ranks = original if packed else _one_at_a_time
    try:
        with _counted(calls):
            result = ctl.after_step(count=False)
    finally:
        per_step.summed_over_ranks = original
    assert result is not None
    return {
        "layers": layers.last, "experts": {k: v.tolist() for k, v in experts.last.items()}, "dropped": result.dropped,
        "calls": calls, "width": width,
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["reap_sum", "frequency"])
def test_ranks_select_the_same_experts_as_one_process_on_the_union_of_their_tokens(kind):
    ((scores0, dropped0), *selected0), ((scores1, dropped1), *selected1) = run_distributed(_worker, 2, kind)
    assert scores0 == scores1  # bitwise: the sums are added in rank order on every rank
    assert dropped0 == dropped1
    union, dropped = _scores_and_drop([0, 1], kind)
    assert dropped0 == dropped
    for name, values in union.items():
        torch.testing.assert_close(torch.tensor(scores0[name]), torch.tensor(values), rtol=1e-12, atol=0.0)
    alone, _ = _scores_and_drop([0], kind)  # the other rank's tokens count: rank 0's own scores differ
    assert alone != union
    # the controller's selection with layer units too: both statistics in one collective of their joint width, with
    # the statistics and the mask of one collective each (what a selection did before), bitwise, on both ranks
    (packed0, one_each0), (packed1, one_each1) = selected0, selected1
    if packed0 is None:
        return
    for packed, one_each in ((packed0, one_each0), (packed1, one_each1)):
        assert [n for _, n in packed["calls"]] == [packed["width"]]
        assert sorted(n for _, n in one_each["calls"]) == [4, 16]  # [2 L] cosine sums and counts, [2 sum(E)] experts
        for part in ("layers", "experts", "dropped"):
            assert packed[part] == one_each[part], part
    assert packed0 == packed1
    assert packed0["dropped"]["layer.0"] + packed0["dropped"]["layer.1"]  # the layer scores decide something
    assert packed0["dropped"]["experts.0"]
