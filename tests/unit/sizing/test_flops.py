"""``target_flops``: FLOPs per token as the size the solver meets.

References: a FLOP count written out by hand for a tiny Llama, and ``torch.utils.flop_counter.FlopCounterMode`` on a
forward of the shrunk model (its rotary-embedding matmul, a per-sequence constant outside the cost model, removed).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_pat import presets, prune_clusters, shrink
from lightning_pat.sizing.flops import count_flops
from lightning_pat.sizing.problem import parse_size
from tests.common import tiny_families as fam

S = 8


def measured(model: torch.nn.Module) -> float:
    """FLOPs per token of one forward on ``(1, S)`` tokens, as FlopCounterMode counts them (rotary excluded)."""
    ids = torch.randint(0, fam.VOCAB, (1, S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    rotary = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb"))
    return (counter.get_total_flops() - rotary) / S


def test_hand_count_of_a_tiny_llama():
    case = fam.llama_like("llama", n_head=4, n_kv=2, tied=True, n_layer=3)
    model = case.fresh()
    d, ff, hd, layers, vocab = case.d, case.ff, case.head_dim, case.n_layer, fam.VOCAB
    q, kv = case.n_head * hd, case.n_kv * hd
    per_layer = 2 * (d * q + 2 * d * kv + q * d) + 2 * 3 * d * ff + 4 * S * q  # projections, MLP, scores + values
    by_hand = layers * per_layer + 2 * vocab * d  # the tied lm_head once; the embedding lookup costs nothing
    assert count_flops(model, seq_len=S) == by_hand == measured(model)


@pytest.mark.parametrize(
    ("options", "extra"),
    [({}, {}), ({"residual": True}, {}), ({"layers": True}, {}), ({}, {"target_widths": "ranked"})],
    ids=["widths", "residual", "layers", "ranked"],
)
@pytest.mark.usefixtures("single_thread")
def test_target_flops_is_met_exactly_after_shrink(options, extra):
    case = fam.llama_like("llama", n_head=4, n_kv=2, tied=True, n_layer=3)
    model = case.fresh()
    full = count_flops(model, seq_len=S)
    res = prune_clusters(model, presets.llama(model, **options), target_flops=0.6, seq_len=S, **extra)
    size = res.size
    assert size is not None
    assert (size.total, size.target, size.unit) == (full, parse_size(0.6, total=full), "FLOPs per token")
    assert size.achieved <= size.target
    assert size.above is None or size.above > size.target
    shrink(model, res)
    assert count_flops(model, seq_len=S) == size.achieved == measured(model)


@pytest.mark.usefixtures("single_thread")
def test_target_flops_on_gpt2():
    """Conv1D weights and the packed c_attn: the query third of its columns carries the attention FLOPs."""
    case = fam.gpt2(n_head=4)
    model = case.fresh()
    res = prune_clusters(model, presets.get(case.preset)(model), target_flops=0.7, seq_len=S)
    shrink(model, res)
    assert count_flops(model, seq_len=S) == res.size.achieved == measured(model)


def test_target_flops_refusals():
    model = fam.llama_like("llama", n_head=4, n_kv=2, n_layer=2).fresh()
    with pytest.raises(ValueError, match="give `seq_len` with it"):
        prune_clusters(model, "llama", target_flops=0.5)
    with pytest.raises(ValueError, match=r"`seq_len` .* must be an int >= 1, got 0"):
        prune_clusters(model, "llama", target_flops=0.5, seq_len=0)
    with pytest.raises(ValueError, match="exactly one of them"):
        prune_clusters(model, "llama", target_params=0.5, target_flops=0.5, seq_len=S)
    with pytest.raises(ValueError, match=r"`target_flops` \(10\) is below the smallest size"):
        prune_clusters(model, "llama", target_flops=10, seq_len=S)
    assert all(bool(p.ne(0).any()) for p in model.parameters())
