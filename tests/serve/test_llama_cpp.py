"""End to end: per-layer GGUF files (llama.cpp's ``deci`` architecture) load and generate in llama.cpp.

llama-cpp-python builds llama.cpp from source (48 min here on two shared cores), so this runs only with
``make test-serve-llama-cpp`` (marker ``llama_cpp``), not in ``.ci/run``. References: Hugging Face ``generate`` on
the same export loaded by ``lightning_pat.load_pretrained`` (greedy, fp32, tokens equal), and the Hugging Face
tokenizer (the GGUF's embedded tokenizer must split text into the same ids).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lightning_pat import presets, prune_clusters, shrink
from lightning_pat.export.pretrained import load_pretrained, save_pretrained
from tests.common import serve_models

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.serve,
    pytest.mark.llama_cpp,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore"),
]
TEXTS = [*serve_models.TEXT, "digits 0123456789 and ünïcode", "<|im_start|>user\nhi<|im_end|>"]


def serve_python() -> Path:
    env = {**os.environ, "LLAMA_CPP": "1"}
    proc = subprocess.run(
        [str(ROOT / "tools" / "serve_venv.sh")], env=env, capture_output=True, text=True, timeout=7200, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def per_layer_heads():
    """Ranked MLP widths and GQA groups: the query heads differ per layer (what only GGUF's deci expresses)."""
    model = serve_models.llama(layers=3, heads=8, kv=4, hidden=256)
    small = shrink(model, prune_clusters(model, "llama", target_params=0.7, target_widths="ranked"))
    assert len({layer.self_attn.q_proj.out_features for layer in small.model.layers}) > 1
    return small


def narrow_residual():
    """Ranked MLP widths and a residual width (91) that is not a multiple of anything."""
    model = serve_models.llama(layers=3)
    policy = presets.llama(model, heads=False, residual=True)
    return shrink(model, prune_clusters(model, policy, target_params=0.6, target_widths="ranked"))


@pytest.mark.parametrize("build", [per_layer_heads, narrow_residual], ids=["per-layer-heads", "narrow-residual"])
def test_llama_cpp_serves_a_per_layer_gguf_as_hf_generates(tmp_path, build):
    tok = serve_models.tokenizer()
    small = build()
    save_pretrained(small, tmp_path / "m", format="gguf", tokenizer=tok)
    prompts = [tok(p)["input_ids"] for p in serve_models.PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    expected = serve_models.greedy(load_pretrained(tmp_path / "m"), prompts, 8)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [
        str(serve_python()), str(ROOT / "bench" / "serve_engines.py"), "--engine=llama_cpp",
        f"--model={tmp_path / 'm' / 'model.gguf'}", f"--prompts={tmp_path / 'prompts.json'}", "--max_tokens=8",
        "--max_model_len=128", "--threads=1", f"--texts={tmp_path / 'texts.json'}", f"--out={tmp_path / 'out.json'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result] = json.loads((tmp_path / "out.json").read_text())
    assert result["tokens"] == expected
    assert result["tokenized"] == [tok(t)["input_ids"] for t in TEXTS]
    assert result["add_bos"] is False
