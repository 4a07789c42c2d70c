"""Expert scores from training forwards on 2 gloo ranks (lightning_pat.scoring.experts.ExpertStats).

Each rank trains on other tokens; at the selection both ranks sum the per-expert score vectors in one collective
and get the same bits, so both drop the same experts: those of one process that saw the tokens of both ranks.
"""

from __future__ import annotations

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
    return _scores_and_drop([rank], kind)


@pytest.mark.parametrize("kind", ["reap_sum", "frequency"])
def test_ranks_select_the_same_experts_as_one_process_on_the_union_of_their_tokens(kind):
    (scores0, dropped0), (scores1, dropped1) = run_distributed(_worker, 2, kind)
    assert scores0 == scores1  # bitwise: the sums are added in rank order on every rank
    assert dropped0 == dropped1
    union, dropped = _scores_and_drop([0, 1], kind)
    assert dropped0 == dropped
    for name, values in union.items():
        torch.testing.assert_close(torch.tensor(scores0[name]), torch.tensor(values), rtol=1e-12, atol=0.0)
    alone, _ = _scores_and_drop([0], kind)  # the other rank's tokens count: rank 0's own scores differ
    assert alone != union
