"""Mixture-of-experts layouts other than fused 3-D experts, and hybrids, from the zoo bench (issue 37).

Each case is a tiny random model of ``tests/common/lm_zoo.py``, pruned, shrunk and reloaded with stock
``AutoModelForCausalLM.from_pretrained``; the independent reference is the masked model (the unshrunk model with the
dropped units zeroed and, for whole experts, routed around), whose logits the shrunk and the reloaded model must
give (fp32, rel < 1e-4).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.common import lm_zoo

pytest.importorskip("transformers")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _stock(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, overwrite=True, tokenizer=None)
        return AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()


def test_dbrx_stacked_experts_lose_channels_with_auto_though_it_does_not_trace():
    # DBRX stacks its experts as 2-D w1/v1/w2 of E * F rows, and its expert loop's `nonzero` stops torch.export:
    # "auto" finds the experts by structure and cuts each expert's channels (every expert keeping as many)
    model = lm_zoo.build("dbrx")
    out = lm_zoo.chain(model)  # shrunk in place
    assert out.error == "", f"failed at {out.stage}: {out.error}"
    assert out.ok, out
    mlp = model.transformer.blocks[0].ffn.experts.mlp
    assert mlp.w1.shape == (4 * 64, lm_zoo.HIDDEN)
    assert model.config.ffn_config.ffn_hidden_size == 64 == mlp.ffn_hidden_size
    assert model.config.ffn_config.moe_num_experts == 4


def test_dbrx_whole_stacked_experts_go_with_their_router_rows():
    from lightning_pat import presets, prune_clusters, shrink

    model = lm_zoo.build("dbrx").eval()
    ids = lm_zoo.token_ids()
    dense = _logits(model, ids)
    clusters = presets.moe(model, mlp=False)
    assert [c.name for c in clusters] == ["experts.0", "experts.1"]
    result = prune_clusters(model, clusters, 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    masked = _logits(model, ids)
    assert lm_zoo._rel(masked, dense) > 1e-3  # two of four experts dropped and routed around
    shrink(model, result, example_input=None)
    assert lm_zoo._rel(_logits(model, ids), masked) < lm_zoo.EXACT
    assert model.transformer.blocks[1].ffn.router.layer.weight.shape == (2, lm_zoo.HIDDEN)
    ffn = model.config.ffn_config
    assert (ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size) == (2, 2, lm_zoo.FF)
    stock = _stock(model)
    assert lm_zoo._rel(_logits(stock, ids), masked) < lm_zoo.EXACT
    assert stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_jetmoe_parallel_experts_lose_channels_and_whole_experts_with_auto():
    # JetMoE holds each projection of its experts as a 3-D weight (JetMoeParallelExperts) and routes with a top-k
    # gating that does not trace; its attention is a mixture of attention experts built from the same
    # num_local_experts: "auto" cuts the MLP experts' channels, whole MLP experts and whole attention experts
    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build("jetmoe").eval()
    ids = lm_zoo.token_ids()
    dense = _logits(model, ids)
    result = prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    assert {n.split(".")[0] for n in result.dropped} == {"mlp", "experts", "attn_experts"}
    masked = _logits(model, ids)
    assert lm_zoo._rel(masked, dense) > 1e-3
    before = lm_zoo.non_embedding_params(model)
    shrink(model, result, example_input=None)
    assert lm_zoo._rel(_logits(model, ids), masked) < lm_zoo.EXACT
    assert 1 - lm_zoo.non_embedding_params(model) / before > 0.4
    layer = model.model.layers[1]
    assert layer.mlp.input_linear.weight.shape == (2, 2 * 64, lm_zoo.HIDDEN)
    assert layer.mlp.router.layer.weight.shape[0] == 2 == layer.self_attention.experts.router.num_experts
    assert (model.config.num_local_experts, model.config.intermediate_size) == (2, 64)
    stock = _stock(model)
    assert lm_zoo._rel(_logits(stock, ids), masked) < lm_zoo.EXACT
    assert stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_jetmoe_callback_prunes_its_experts_while_training_then_shrinks_exactly():

    from lightning_pat import CoupledPruningCallback, shrink
    from tests.common.lit_models import ZooStep, quiet_trainer

    module = ZooStep("jetmoe")
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    assert {k: len(v) for k, v in cb.dropped.items() if k.endswith(".1")} == {
        "mlp.1": 64, "experts.1": 2, "attn_experts.1": 2,
    }  # fmt: skip
    model, ids = module.model.eval(), lm_zoo.token_ids()
    masked = _logits(model, ids)
    shrink(model, cb, example_input=None)
    assert lm_zoo._rel(_logits(model, ids), masked) < lm_zoo.EXACT
    assert lm_zoo._rel(_logits(_stock(model), ids), masked) < lm_zoo.EXACT


def test_dbrx_a_cut_that_leaves_experts_of_different_widths_is_refused_before_any_change():
    from lightning_pat import Cluster, shrink
    from lightning_pat.core.spec import resolve_clusters

    model = lm_zoo.build("dbrx").eval()
    mlp = "transformer.blocks.0.ffn.experts.mlp"
    resolved = resolve_clusters(model, [Cluster("rows", [f"{mlp}.{w}" for w in ("w1", "v1", "w2")])])
    with torch.no_grad():  # the masked model's weights: the dropped rows zero
        for w in ("w1", "v1", "w2"):
            model.get_parameter(f"{mlp}.{w}")[:10] = 0
    before = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"\[118, 128, 128, 128\] rows per expert"):  # 10 rows of expert 0 only
        shrink(model, {"clusters": resolved, "dropped": {"rows": list(range(10))}}, example_input=None)
    assert {n: p.shape for n, p in model.named_parameters()} == before
