"""The pretrained front door on many devices (issue 38): ``lightning-pat fit`` of one YAML, on one process, under FSDP2
at world 2 with the model built on meta (``empty_init``) and under tensor parallelism at world 2 (gloo, CPU), each
ending in an export on global rank 0 (the masked path: no ``shrink_on_freeze``). FSDP2 at world 2 with a model built
whole is ``test_shrink_on_freeze_sharded.py``'s front door (through the freeze). Both on a 2x2
mesh at world 4 is the front door of ``test_smollm2_sharded.py`` (the real SmolLM2's weights through the freeze, the
same checks), and the masked path on a 2x2 mesh ``tests/distributed/test_model_parallel.py``'s: one world of 4 in the
suite's budget, not two.

The reference is the single-process run of the same config: with a learning rate of 1e-6 the weights move by at most
a few 1e-6 in the few steps, so the ``rms`` scores and thus the selection of every run are the single process's,
and the exports (cut to the kept units) must have the same shapes and, within 1e-4, the same weights. A selection
that differed between ranks or from the single process would cut other rows and columns: weights apart by O(1).
Each export loads with stock ``AutoModelForCausalLM.from_pretrained`` and generates. ``empty_init``: the model built
with its parameters on meta, each rank reading only its shards after ``fully_shard``, trains to the same export.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.common.tiny_lm import fit_layouts, tiny_lm_dir

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

CONFIG = """seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 4
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_pat.CoupledPruningCallback
      init_args: {{clusters: llama, target_params: 0.7, score: rms, warmup_steps: 1, ramp_steps: 2}}
model:
  class_path: lightning_pat.lm.CausalLM
  init_args: {{pretrained: {model}, lr: 1.0e-6, export: {export}}}
data:
  class_path: lightning_pat.lm.TextFiles
  init_args: {{files: {files}, holdout_every: 2, batch_size: 2, seq_len: 16, val_windows: 2, train_windows: 32,
    english: false}}
"""
LAYOUTS = {
    "one-process": [],
    "tp-x2": ["--trainer.devices=2", "--trainer.strategy=ModelParallelStrategy",
              "--trainer.strategy.data_parallel_size=1", "--trainer.strategy.tensor_parallel_size=2"],
    "fsdp2-x2-empty-init": ["--trainer.devices=2", "--trainer.strategy=ModelParallelStrategy",
                            "--trainer.strategy.data_parallel_size=2", "--trainer.strategy.tensor_parallel_size=1",
                            "--model.init_args.empty_init=true"],
}  # fmt: skip


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded_front_door")
    out = {}
    for name, done in fit_layouts(root, CONFIG, LAYOUTS, timeout=400).items():
        assert done.returncode == 0, f"{name}: {done.stderr[-4000:]}"
        out[name] = root / name
    return out


def test_the_sharded_fits_select_what_one_process_selects_and_export_the_same_model(exports):
    from safetensors.torch import load_file

    reference = load_file(exports["one-process"] / "model.safetensors")
    full = load_file(tiny_lm_dir(exports["one-process"].parent) / "model.safetensors")
    assert sum(t.numel() for t in reference.values()) < 0.8 * sum(t.numel() for t in full.values())  # really cut
    for name in ("tp-x2", "fsdp2-x2-empty-init"):
        weights = load_file(exports[name] / "model.safetensors")
        assert sorted(weights) == sorted(reference), name
        for key, tensor in reference.items():
            assert weights[key].shape == tensor.shape, (name, key)
            torch.testing.assert_close(weights[key], tensor, atol=1e-4, rtol=0, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_export_loads_with_stock_transformers_and_generates(exports, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exports[name], trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(exports[name], trust_remote_code=False)
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
