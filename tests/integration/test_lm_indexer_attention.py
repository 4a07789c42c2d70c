"""A data-dependent selection inside the model (a sparse-attention indexer) no longer stops discovery (issue 37).

Qwen4-exp's QSA indexer picks each query's key blocks with ``nonzero`` and a guard on its size, which
``torch.export`` cannot trace; only the experts were cut (5%). The indexer returns a boolean token mask: discovery now
traces such a module as an opaque selection (its output carries no channels, its parameters and what it reads are
left whole), so the attention's heads (a gated ``q_proj``: a query and a gate per head), the shared experts and the
hyper-connections' rank (one ``hc_lowrank`` for all of them) are cut too. The toy model checks the rule on its own,
against a hand-computed cluster; the tiny Qwen4-exp model checks the whole chain: shrunk logits equal to the masked
model's, stock ``from_pretrained`` of the export equal to them, the sizes its config now holds, ``generate()``.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from lightning_pat import discover
from tests.common import lm_zoo


class _Selector(nn.Module):
    """Keeps the tokens scored above their sequence's mean: a data-dependent selection (a bool mask)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.score = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.score(x).squeeze(-1)
        keep = torch.zeros(s.shape, dtype=torch.bool, device=x.device)
        for b in range(s.shape[0]):
            idx = torch.nonzero(s[b] > s[b].mean()).flatten()
            if idx.numel() > 0:  # a guard on a data-dependent size: torch.export stops here
                keep[b, idx] = True
        return keep


class _Weights(_Selector):
    """The same loop, a float output: not a selection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


class _Net(nn.Module):
    def __init__(self, select: nn.Module) -> None:
        super().__init__()
        self.up, self.down, self.select = nn.Linear(8, 16), nn.Linear(16, 8), select

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * self.select(x).unsqueeze(-1).to(x.dtype)


def test_a_data_dependent_selection_is_traced_as_an_opaque_op_its_weights_left_whole():
    torch.manual_seed(0)
    net = _Net(_Selector(8)).eval()
    with pytest.raises(Exception, match="(?i)data-dependent|guard"):  # what stopped discovery before
        torch.export.export(net, (torch.randn(2, 5, 8),), strict=False)
    found = discover(net, torch.randn(2, 5, 8))
    # the MLP's hidden channels: up's rows and bias, down's columns (the reference, by hand)
    assert [(c.writers, c.readers, c.num_units) for c in found.clusters] == [
        (["up.weight", "up.bias"], ["down.weight"], 16)
    ]
    left = {lo.name: lo for lo in found.left_out}
    assert left["select"].members == ("select.score.weight", "select.score.bias")
    assert "data-dependent selection" in left["select"].reasons[0]
    assert "forward" not in vars(net.select)  # the model is untouched (only its meta copy was stood in for)


def test_a_data_dependent_module_that_returns_floats_still_stops_the_trace():
    net = _Net(_Weights(8)).eval()
    with pytest.raises(ValueError, match="boolean or integer tensor"):
        discover(net, torch.randn(2, 5, 8))


@pytest.fixture(scope="module")
def qwen4() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """(dense copy, shrunk model, token ids, masked logits) of a one-layer Qwen4-exp (indexed attention, experts)."""
    pytest.importorskip("transformers")
    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build("qwen4_exp_text", layer_types=["indexed_attention"], num_hidden_layers=1)
    dense = lm_zoo.build("qwen4_exp_text", layer_types=["indexed_attention"], num_hidden_layers=1)
    ids = lm_zoo.token_ids()
    result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=2)],
                            preset_options={"query_heads": True})  # fmt: skip
    with torch.no_grad():
        masked = model(ids).logits.float()
    return dense, shrink(model, result, example_input=None), ids, masked


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_qwen4_heads_experts_and_hyper_connections_are_cut_exactly(qwen4):
    dense, small, ids, masked = qwen4
    with torch.no_grad():
        assert _rel(small(ids).logits.float(), masked) < lm_zoo.EXACT
    cut = 1 - lm_zoo.non_embedding_params(small) / lm_zoo.non_embedding_params(dense)
    assert cut >= 0.4, cut
    config, attn = small.config, small.model.layers[0].self_attn
    # query heads inside their KV groups (2 of 4, 1 per group): the gated q_proj keeps a query and a gate per head
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 2)
    assert (attn.q_proj.out_features, attn.o_proj.in_features, attn.k_proj.out_features) == (2 * 2 * 16, 32, 32)
    # the indexer (its own heads, reading the attention's input, which no cut changes) is whole
    before = dict(dense.model.layers[0].self_attn.indexer.named_parameters())
    assert {n: p.shape for n, p in attn.indexer.named_parameters()} == {n: p.shape for n, p in before.items()}
    # one rank for every hyper-connection, as the stock config holds it
    blocks = [m for n, m in small.named_modules() if "hyper_connection" in n and hasattr(m, "input_mix_weight_down")]
    assert len(blocks) == 3  # the attention's, the MLP's, the final mixer
    assert {m.input_mix_weight_down.out_features for m in blocks} == {config.hc_lowrank}
    assert config.hc_lowrank < dense.config.hc_lowrank
    assert config.moe_intermediate_size < dense.config.moe_intermediate_size
    assert config.shared_expert_intermediate_size < dense.config.shared_expert_intermediate_size


def test_qwen4_reloads_with_stock_from_pretrained_and_generates(qwen4):
    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained

    _, small, ids, masked = qwen4
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(small, tmp, overwrite=True, tokenizer=None)
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    assert type(stock) is type(small)
    with torch.no_grad():
        assert _rel(stock(ids).logits.float(), masked) < lm_zoo.EXACT
        out = stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
