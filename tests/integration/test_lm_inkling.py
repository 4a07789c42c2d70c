"""The Inkling family (Inkling 1, 2, 2-loop) through ``clusters="auto"``: exact shrink, stock reload, generate.

Its causes, one tiny model each (``tests/common/lm_zoo.py``): shared experts held as 3-D ``gate_proj``/``up_proj``/
``down_proj`` whose width the config ties to the routed experts' (``moe_intermediate_size``), so their channels join
the experts' channel cluster; a router that scores the shared experts in its last rows (whole routed experts lose
only their own rows, its per-expert selection bias covers the routed experts only); heads whose keys and values go
through a depthwise causal ``conv1d`` (transformers' ``causal_conv1d_fn``: the weight squeezed and unsqueezed) and
whose relative-position bias is a ``gather`` of per-head rows, masked (discovery reads all three); sliding-window
layers sized by the config's ``swa_*`` fields; Inkling 2's per-head query and relative-state scales (a module
holding only a ``scale``), its attention sinks and its relative-position module's own head count. Each case checks
the shrunk logits and the stock reload's against the masked model's (fp32, rel < 1e-4), the config's new sizes and
the share of non-embedding parameters cut.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_pat as lp
from tests.common import lm_zoo

transformers = pytest.importorskip("transformers")


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def stock(model: nn.Module, folder) -> nn.Module:
    lp.save_pretrained(model, folder, overwrite=True, tokenizer=None)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    """Inkling 1 pruned by "auto" at 0.5: (masked logits, its result, the shrunk model, its stock reload, the ids)."""
    model = lm_zoo.build("inkling_text")
    with torch.no_grad():  # a selection bias that would pick a dropped expert, were it not routed around
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    dense = lm_zoo.non_embedding_params(model)
    result = lp.prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    ids = lm_zoo.token_ids()
    masked = logits(model, ids)
    small = lp.shrink(model, result, example_input=None)
    reload = stock(small, tmp_path_factory.mktemp("inkling"))
    return masked, result, small, reload, ids, dense


def test_inkling_shared_experts_and_whole_experts_are_cut_exactly_and_reload_stock(inkling):
    masked, result, small, reload, ids, dense = inkling
    assert rel(logits(small, ids), masked) < lm_zoo.EXACT
    assert rel(logits(reload, ids), masked) < lm_zoo.EXACT
    assert len(result.dropped["mlp.0"]) == 16
    assert len(result.dropped["experts.0"]) == 2
    block = reload.model.layers[0].mlp
    config = reload.config
    assert (config.n_routed_experts, config.moe_intermediate_size) == (2, 16)
    assert tuple(block.shared_experts.gate_proj.shape) == (2, 16, 64)  # the shared experts' channels went with them
    assert tuple(block.gate.weight.shape) == (2 + 2, 64)  # the shared experts' router rows stay
    kept = sorted(set(range(4)) - set(result.dropped["experts.0"]))
    assert block.gate.e_score_correction_bias.tolist() == [3.0 - k for k in kept]
    assert 1 - lm_zoo.non_embedding_params(small) / dense >= 0.2
    assert reload.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_inkling_heads_through_the_key_value_conv1d_and_the_relative_position_gather(inkling):
    _, result, small, reload, _, _ = inkling
    heads = {k: v for k, v in result.dropped.items() if k.endswith("self_attn.q_proj")}
    assert set(heads) == {f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)}
    assert all(len(v) == 1 for v in heads.values())  # one of two query groups (KV heads) in each layer
    attn = small.model.layers[0].self_attn  # a sliding-window layer: the config's swa_* fields
    assert (attn.num_heads, attn.num_key_value_heads) == (2, 1)
    assert tuple(attn.k_sconv.conv1d.weight.shape) == (16, 1, 4)  # the depthwise conv keeps the KV head's channels
    assert tuple(attn.r_proj.weight.shape) == (2 * 8, 64)  # the relative states of the heads kept
    config = reload.config
    assert (config.swa_num_attention_heads, config.swa_num_key_value_heads) == (2, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)


def test_inkling2_sliding_heads_with_their_scales_and_experts_are_cut_by_auto(tmp_path):
    model = lm_zoo.build("inkling2_text")  # layer 0 slides (static KV convolutions), layer 1 is full attention
    dense = lm_zoo.non_embedding_params(model)
    result = lp.prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    assert len(result.dropped["model.layers.0.self_attn.q_proj.norm"]) == 1  # one of two query groups
    assert not any(k.startswith("model.layers.1.self_attn") for k in result.dropped)  # its dynamic convolutions
    assert (len(result.dropped["experts.0"]), len(result.dropped["mlp.0"])) == (2, 16)
    ids = lm_zoo.token_ids()
    masked = logits(model, ids)
    small = lp.shrink(model, result, example_input=None)
    assert rel(logits(small, ids), masked) < lm_zoo.EXACT
    attn = small.model.layers[0].self_attn
    assert tuple(attn.q_proj.norm.scale.shape) == (2, 16)  # each head's query scale goes with it
    assert tuple(attn.relative_position_bias.norm.scale.shape) == (2, 8)
    assert attn.relative_position_bias.num_heads == 2
    assert tuple(attn.sink_proj.weight.shape) == (2, 64)
    reload = stock(small, tmp_path)
    assert rel(logits(reload, ids), masked) < lm_zoo.EXACT
    config = reload.config
    assert (config.swa_num_attention_heads, config.swa_num_key_value_heads) == (2, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert 1 - lm_zoo.non_embedding_params(small) / dense >= 0.4
    assert reload.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_inkling_callback_prunes_while_training_then_shrinks_exactly(tmp_path):

    from lightning_pat import CoupledPruningCallback, shrink
    from tests.common.lit_models import ZooStep, quiet_trainer

    module = ZooStep("inkling_text")
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    dropped = {k: len(v) for k, v in cb.dropped.items()}
    assert (dropped["mlp.1"], dropped["experts.1"]) == (16, 2)
    assert dropped["model.model.layers.1.self_attn.q_proj"] == 1
    model, ids = module.model.eval(), lm_zoo.token_ids()
    masked = logits(model, ids)
    shrink(model, cb, example_input=None)
    assert rel(logits(model, ids), masked) < lm_zoo.EXACT
    assert rel(logits(stock(model, tmp_path), ids), masked) < lm_zoo.EXACT
