"""Tensor parallelism from transformers' own plan (``base_model_tp_plan``) for non-Llama families (issue 38).

``shard_causal_lm`` on a 1x2 mesh (FSDP2 over a data-parallel axis of 1, tensor parallel over 2 gloo ranks) of a
tiny Qwen3 (per-head ``q_norm``/``k_norm``: ``replicated_with_grad_allreduce``) and Gemma-3 (the same norms, and a
``(1 + weight)`` RMSNorm, sliding-window layers): the logits equal the one-process model's (the same model built
from the same seed on every rank; rel < 1e-5, the TP matmuls' partial sums round apart) and so does every
parameter's gradient after one backward, the per-head norms' included (their gradient is summed over the axis: a
norm left to each rank's own heads would be off by O(1)). The plan's column-wise and row-wise projections are split
over the axis. What cannot be translated is refused in ``tests/unit/lm/test_sharding.py``.
"""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.distributed.workers.lm_tensor_parallel import logits_and_grads

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_the_models_own_plan_gives_the_one_process_logits_and_gradients(model_type):
    outs = run_distributed(logits_and_grads, 2, model_type, timeout=280)
    for rank, out in enumerate(outs):
        assert out["logits_rel"] < 1e-5, (rank, out)
        assert out["grad_rel"] < 1e-5, (rank, out)
        for layer in (0, 1):  # q/k/v and gate/up column-wise, o and down row-wise, in every decoder layer
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
                assert f"model.layers.{layer}.{proj}.weight" in out["split"], (rank, proj, out["split"])
        assert len(out["replicated_norms"]) == 4, out["replicated_norms"]  # q_norm and k_norm of both layers
