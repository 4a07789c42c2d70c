"""Per-channel scales (Dory) and encoders a text calibration never reaches, through ``clusters="auto"`` (issue 37).

Dory (nGPT-style) multiplies its MLP and attention activations by learned vectors (``suv_gate``, ``suv_up``,
``sqk``, ``s_gate``) and projects onto the unit sphere with L2 norms over the MLP width and over all heads: the
vectors are cut with their channels, the sums over zeroed channels stay exact. The reference is the masked model's
logits (shrunk, and stock ``from_pretrained`` of the export); the sizes the stock config was told are checked
against the tiny config's. Phi-4-multimodal's encoders, found by tracing them on their own inputs, are checked in
``test_lm_more_families.py`` (one pass of that model); here, the scoring of clusters no calibration batch reaches.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from tests.common import lm_zoo

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dory() -> dict[str, Any]:
    """Dory's tiny model pruned by half with "auto", shrunk, exported and reloaded with stock transformers."""
    from transformers import AutoModelForCausalLM

    from lightning_pat import prune_clusters, save_pretrained, shrink

    model = lm_zoo.build("dory")
    dense = lm_zoo.non_embedding_params(model)
    c = model.config
    config = {"ff": c.intermediate_size, "heads": c.num_attention_heads, "kv": c.num_key_value_heads, "d": c.head_dim}
    ids = lm_zoo.token_ids()
    result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=s) for s in (2, 3)])
    with torch.no_grad():
        masked = model(ids).logits.float()
    small = shrink(model, result, example_input=None)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(small, tmp, overwrite=True, tokenizer=None)
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    return {"config": config, "dense": dense, "ids": ids, "masked": masked, "small": small, "stock": stock}


def _rel(model: nn.Module, ids: torch.Tensor, masked: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits.float() - masked).norm() / masked.norm())


def test_dory_scales_are_cut_with_their_channels_exactly(dory):
    small, config = dory["small"], dory["config"]
    assert _rel(small, dory["ids"], dory["masked"]) < lm_zoo.EXACT
    cut = 1 - lm_zoo.non_embedding_params(small) / dory["dense"]
    assert cut >= 0.45, cut  # MLPs and whole query groups, every layer (was: no cluster found)
    for layer in small.model.layers:
        assert layer.mlp.suv_gate.shape == layer.mlp.suv_up.shape == (config["ff"] // 2,)
        assert layer.self_attn.sqk.shape == layer.self_attn.s_gate.shape == (config["heads"] // 2 * config["d"],)


def test_dory_reloads_with_stock_transformers_and_generates(dory):
    stock, config = dory["stock"], dory["config"]
    assert type(stock).__name__ == "DoryForCausalLM"
    assert _rel(stock, dory["ids"], dory["masked"]) < lm_zoo.EXACT
    assert stock.config.intermediate_size == config["ff"] // 2
    assert (stock.config.num_attention_heads, stock.config.num_key_value_heads) == (
        config["heads"] // 2,
        config["kv"] // 2,
    )
    with torch.no_grad():
        out = stock.generate(dory["ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


class _TwoBranches(nn.Module):
    """A text MLP the batches run and an encoder MLP they never reach (a multimodal LM calibrated on text)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.enc_up, self.enc_down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, image=None):
        y = self.down(torch.relu(self.up(x)))
        return y if image is None else y + self.enc_down(torch.relu(self.enc_up(image))).mean(1, keepdim=True)


def test_clusters_no_calibration_batch_reaches_are_ranked_by_weights_the_others_by_activations(caplog):
    from lightning_pat import Cluster, prune_clusters

    text = Cluster("text", writers=["up.weight", "up.bias"], readers=["down.weight"])
    enc = Cluster("enc", writers=["enc_up.weight", "enc_up.bias"], readers=["enc_down.weight"])
    torch.manual_seed(0)
    model = _TwoBranches()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(4, 8) * torch.linspace(0.1, 3.0, 8) for _ in range(3)]
    with caplog.at_level("WARNING"):
        both = prune_clusters(model, [text, enc], 0.5, calibration=batches)
    assert "no calibration batch reaches 1 of the 2 clusters (enc)" in caplog.text
    # independent references: each cluster pruned alone, by the activation score and by the weights
    model.load_state_dict(state)
    by_activation = prune_clusters(model, [text], 0.5, score="activation", calibration=batches)
    model.load_state_dict(state)
    by_weights = prune_clusters(model, [enc], 0.5, score="rms")
    assert both.dropped["text"] == by_activation.dropped["text"]
    assert both.dropped["enc"] == by_weights.dropped["enc"]
