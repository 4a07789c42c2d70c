"""lightning_pat.lm.sharding: what FSDP2/TP sharding of a Hugging Face causal LM refuses before anything is sharded.

The sharding itself runs under ModelParallelStrategy in ``tests/integration/test_shrink_on_freeze_sharded.py``
(gloo, 2 ranks).
"""

from __future__ import annotations

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_pat.lm.sharding import (
    activation_checkpointing,
    check_tensor_parallel,
    decoder_layers,
    layer_plan,
    tensor_parallel_plan,
)


def llama(heads: int = 4, kv: int = 2, ff: int = 32) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=16, intermediate_size=ff, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=4, vocab_size=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_the_decoder_layers_are_the_models_no_split_modules():
    model = llama()
    assert decoder_layers(model) == list(model.model.layers)


def test_tensor_parallel_splits_whole_heads_and_kv_groups_or_leaves_that_part_replicated():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = tensor_parallel_plan(llama(), 2)  # 4 heads, 2 KV heads, 32 channels: whole units on each of 2 ranks
    assert {p: type(s) for p, s in plan.items()} == {
        **dict.fromkeys(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ColwiseParallel),
        **dict.fromkeys(["mlp.gate_proj", "mlp.up_proj"], ColwiseParallel),
        **dict.fromkeys(["self_attn.o_proj", "mlp.down_proj"], RowwiseParallel),
    }
    with pytest.warns(UserWarning, match=r"leaves \['self_attn'\] .*'num_key_value_heads': 2\}\} do not divide by 4"):
        plan = tensor_parallel_plan(llama(heads=4, kv=2), 4)  # the attention replicated, the MLP split
    assert sorted(plan) == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
    with pytest.warns(UserWarning, match=r"leaves \['mlp'\] .*'mlp.gate_proj.out_features': 30"):
        plan = tensor_parallel_plan(llama(heads=4, kv=4, ff=30), 4)
    assert sorted(plan) == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    with pytest.raises(ValueError, match=r"in every part of LlamaDecoderLayer some do not divide by 4"):
        check_tensor_parallel(llama(heads=4, kv=2, ff=30), 4)


def test_the_plan_is_the_configs_own_and_what_cannot_be_translated_is_refused():
    from transformers import AutoModelForCausalLM

    from tests.common import lm_zoo

    qwen3 = AutoModelForCausalLM.from_config(lm_zoo.tiny_config("qwen3"))
    assert layer_plan(qwen3)["self_attn.q_norm"] == "replicated_with_grad_allreduce"  # transformers' plan
    assert sorted(tensor_parallel_plan(qwen3, 2)) == sorted(layer_plan(qwen3))
    phi3 = AutoModelForCausalLM.from_config(lm_zoo.tiny_config("phi3"))  # a fused qkv_proj, gathered outputs
    with pytest.raises(ValueError, match=r"gives 'self_attn.qkv_proj' the style 'colwise_gather_output'"):
        check_tensor_parallel(phi3, 2)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))  # no plan, Conv1D layers
    with pytest.raises(ValueError, match="config has no base_model_tp_plan and its GPT2Block is not Llama-shaped"):
        check_tensor_parallel(model, 2)


def test_activation_checkpointing_on_one_device_recomputes_the_same_gradients(tmp_path):
    import torch

    from lightning_pat.lm import CausalLM
    from tests.common.tiny_lm import tiny_lm_dir

    source = tiny_lm_dir(tmp_path)
    plain, checkpointed = CausalLM(str(source)), CausalLM(str(source), activation_checkpointing=True)
    for module in (plain, checkpointed):
        module.configure_model()  # no device mesh: one device
        module.model.train()
    assert activation_checkpointing(checkpointed.model)
    assert not activation_checkpointing(plain.model)
    x = torch.randint(0, plain.model.config.vocab_size, (2, 12))
    for module in (plain, checkpointed):
        module(x).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
