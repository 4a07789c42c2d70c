"""``lightning-pat shrink --format decilm gguf`` through the installed console script, after a real fit.

The LightningModule keeps its tokenizer as ``self.tokenizer`` (the contract of ``lightning_pat.lm.CausalLM``): the
export carries it, the GGUF file embeds it. References: the export loaded back against the module shrunk in this
process from the same checkpoint (logits), the tokenizer files against the module's tokenizer (token ids).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_pat import CoupledPruningCallback, load_pretrained, shrink
from tests.common.serve_models import TinyLlamaLM

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "lightning-pat"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore"),
]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(SCRIPT), "shrink", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_shrink_writes_decilm_gguf_and_the_modules_tokenizer(tmp_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    module = TinyLlamaLM()
    options = {"target_widths": "ranked", "preset_options": {"heads": False}, "warmup_steps": 0, "ramp_steps": 2}
    cb = CoupledPruningCallback("llama", target_params=0.8, **options)
    trainer = pl.Trainer(
        max_steps=3, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    common = [f"--ckpt_path={ckpt}", "--model_class=tests.common.serve_models.TinyLlamaLM"]
    proc = run(tmp_path, *common, f"--output={tmp_path / 'small'}", "--format", "decilm", "gguf", "--gguf_dtype=f16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = set(os.listdir(tmp_path / "small"))
    assert {"config.json", "configuration_decilm.py", "model.safetensors", "model.gguf", "tokenizer.json"} <= files
    text = "def main():\n    return 1234"
    assert AutoTokenizer.from_pretrained(tmp_path / "small")(text)["input_ids"] == module.tokenizer(text)["input_ids"]
    reader = GGUFReader(tmp_path / "small" / "model.gguf")
    assert reader.fields["general.architecture"].contents() == "deci"
    small = load_pretrained(tmp_path / "small")
    expected = shrink(module.model, cb)  # the same checkpoint's state, shrunk here
    ids = torch.tensor([module.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(small(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)
