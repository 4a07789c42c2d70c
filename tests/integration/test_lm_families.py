"""Hugging Face decoder families through ``clusters="auto"`` end to end, as a new user runs them (issue 37).

Each case is a tiny random model (``tests/common/lm_zoo.py``: hidden 64, 2 layers, 4 heads of 16, 2 KV heads where
the family has GQA, every parameter jittered), built offline from its config, then ``prune_clusters(model, "auto",
0.5, calibration=...)``, ``shrink``, the shrunk logits against the masked model's (fp32, relative error < 1e-4),
``save_pretrained``, stock ``AutoModelForCausalLM.from_pretrained`` (the same logits) and ``generate()``, with at least
20% of the non-embedding parameters cut. One family per cause of the issue runs by default; the rest are ``slow``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.common import lm_zoo

pytest.importorskip("transformers")

#: One family per cause of issue 37 (a few seconds each).
BY_CAUSE = {
    "phi": "1: q_proj but a `dense` output and fc1/fc2: once taken for Llama, now discovered",
    "gpt_bigcode": "1: GPT-2's names with nn.Linear, not Conv1D: once taken for GPT-2, now discovered",
    "gptj": "2: n_inner told the new MLP width",
    "glm4": "2: a fused gate_up_proj, intermediate_size told",
    "gpt_neox": "2: head size from hidden // heads: heads left out, said before pruning",
    "gpt2": "4: Conv1D readers: the activation score falls back to the weights",
    "olmo2": "5: q_norm/k_norm over all heads: heads left out",
    "falcon": "3: `x @ self.weight.T` (FalconLinear): discovery reads matmul with a transposed weight",
    "llama": "the preset route, unchanged",
}
#: The other families that pass the whole chain (slow: the full list).
OTHERS = (
    "apertus", "apertus1p5_text", "arcee", "beam", "biogpt", "codegen", "cohere", "cohere2", "ctrl", "cwm",
    "diffllama", "doge", "exaone", "exaone4", "exaone_moe", "flint", "gemma", "gemma2", "gemma3_text", "glm",
    "glm4_moe", "gpt-sw3", "granite", "granite_swa", "helium", "hy_v3", "hyperclovax", "internlm3", "iquestcoder",
    "jais2", "lfm3", "ministral3", "mistral", "nanochat", "olmo", "olmo3", "olmo_hybrid", "opt", "param2moe",
    "persimmon", "phi3", "qwen2", "qwen3", "sarvam_moe", "seed_oss", "smollm3", "stablelm", "starcoder2",
    "vaultgemma", "xglm",
    # mixture of experts by structure (tests/integration/test_moe.py checks their units)
    "cohere2_moe", "deepseek_v2", "deepseek_v3", "flex_olmo", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "minimax_m2", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
)  # fmt: skip


def _check(model_type: str) -> lm_zoo.Outcome:
    out = lm_zoo.chain(lm_zoo.build(model_type))
    assert out.error == "", f"{model_type} failed at {out.stage}: {out.error}"
    assert out.ok, out  # exact shrink and stock reload (rel < 1e-4), >= 20% cut, generate()
    return out


@pytest.mark.parametrize("model_type", list(BY_CAUSE))
def test_one_family_per_cause_prunes_shrinks_exactly_and_reloads_stock(model_type):
    _check(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", OTHERS)
def test_every_family_that_works_prunes_shrinks_exactly_and_reloads_stock(model_type):
    _check(model_type)


def test_a_wrong_family_guess_falls_back_to_discovery_and_says_so(caplog):
    from lightning_pat import presets

    model = lm_zoo.build("phi")
    with pytest.raises(ValueError, match=r"not llama: model\.layers\.0\.self_attn\.dense"):
        presets.detect(model)
    with caplog.at_level(logging.INFO):
        out = lm_zoo.chain(model)
    assert out.ok, out
    assert any("discovered by tracing" in r.getMessage() for r in caplog.records)


def test_heads_the_stock_config_cannot_express_are_left_out_before_pruning(caplog):
    from lightning_pat import prune_clusters

    model = lm_zoo.build("gpt_neox")
    with caplog.at_level(logging.WARNING):
        result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids()])
    assert [n for n in result.dropped if "query_key_value" in n] == []
    assert any("stock config cannot express" in r.getMessage() for r in caplog.records)


def test_gpt2_one_shot_calibration_falls_back_to_the_weight_score_loudly(caplog):
    from lightning_pat import presets, prune_clusters

    model = lm_zoo.build("gpt2")
    with caplog.at_level(logging.WARNING, logger="lightning_pat.pruning.api"):
        auto = prune_clusters(model, "gpt2", 0.5, calibration=[lm_zoo.token_ids()])
    assert any("falls back to the weights" in r.getMessage() for r in caplog.records)
    rms = prune_clusters(lm_zoo.build("gpt2"), presets.gpt2(model), 0.5, score="rms")
    assert auto.dropped == rms.dropped
    with pytest.raises(ValueError, match="nn.Linear"):  # asked for explicitly: still refused
        prune_clusters(lm_zoo.build("gpt2"), "gpt2", 0.5, score="activation", calibration=[lm_zoo.token_ids()])


def test_gpt_neox_with_heads_cut_exports_in_our_format_and_load_pretrained_reads_it(tmp_path):
    """Issue 37 cause 2: GPT-NeoX's head size is hidden // heads, so a head cut needs our own format; its tensors keep
    the module names (``embed_out``), which ``load_pretrained`` reads back exactly."""
    import transformers

    import lightning_pat as lp

    config = transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    found = lp.discover(model, x)
    assert any(c.name.endswith("attention.query_key_value") for c in found.clusters)
    res = lp.prune_clusters(model, found, 0.5, score="rms")
    with torch.no_grad():
        masked = model(x).logits
    small = lp.shrink(model, res)
    lp.save_pretrained(small, tmp_path / "out")
    again = lp.load_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, masked, atol=1e-5, rtol=1e-4)
    assert again.gpt_neox.layers[0].attention.dense.in_features == 32


class _TransposedLinear(torch.nn.Linear):
    """A linear layer computing ``x @ self.weight.T`` (FalconLinear's forward, no bias)."""

    def forward(self, x):
        return x @ self.weight.T


class _TransposedLinears(torch.nn.Module):
    """Two such layers, a ReLU between; ``reuse`` also reads fc1's transposed weight elsewhere (then it is used
    directly and its cluster is left out)."""

    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = _TransposedLinear(8, 12, bias=False)
        self.fc2 = _TransposedLinear(12, 8, bias=False)
        self.reuse = reuse

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        return h + self.fc1.weight.T.sum() if self.reuse else h


@pytest.mark.parametrize("reuse", [False, True])
def test_discovery_reads_matmul_with_a_transposed_parameter_as_a_linear_layer(reuse):
    import lightning_pat as lp

    model = _TransposedLinears(reuse)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    found = lp.discover(model, x)
    if reuse:
        assert found.clusters == []
        assert any("used directly" in why for lo in found.left_out for why in lo.reasons)
        return
    [cluster] = lp.resolve_clusters(model, found)
    assert [(m.name, m.dim) for m in cluster.members] == [("fc1.weight", 0), ("fc2.weight", 1)]
    res = lp.prune_clusters(model, found, 0.5, score="rms")
    with torch.no_grad():
        masked = model(x)
    small = lp.shrink(model, res)
    assert small.fc1.weight.shape == (6, 8)
    with torch.no_grad():
        torch.testing.assert_close(small(x), masked)
