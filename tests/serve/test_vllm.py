"""End to end: a tiny model with per-layer MLP widths, exported as DeciLM, loads and generates in vLLM's CPU build.

Runs in the serving venv (``tools/serve_venv.sh``, built once in the user cache) through ``make test-serve``;
``make test`` deselects it (marker ``serve``). Reference: Hugging Face ``generate`` on the same export, loaded by
``lightning_pat.load_pretrained`` (greedy, fp32): the tokens must be equal.
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
pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore")]


def serve_python() -> Path:
    """The serving venv's python (``tools/serve_venv.sh`` prints the venv; it builds it first if it is missing)."""
    proc = subprocess.run(
        [str(ROOT / "tools" / "serve_venv.sh")], capture_output=True, text=True, timeout=1800, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def test_vllm_serves_a_decilm_export_with_per_layer_widths_as_hf_generates(tmp_path):
    tok = serve_models.tokenizer()
    model = serve_models.llama(layers=3)
    policy = presets.llama(model, heads=False)
    small = shrink(model, prune_clusters(model, policy, target_params=0.8, target_widths="ranked"))
    widths = [layer.mlp.down_proj.in_features for layer in small.model.layers]
    assert len(set(widths)) > 1, widths
    save_pretrained(small, tmp_path / "deci", format="decilm", tokenizer=tok)
    prompts = [tok(p)["input_ids"] for p in serve_models.PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    expected = serve_models.greedy(load_pretrained(tmp_path / "deci"), prompts, 8)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)  # the serving venv imports nothing of this repository
    cmd = [
        str(serve_python()), str(ROOT / "bench" / "serve_engines.py"), "--engine=vllm", f"--model={tmp_path / 'deci'}",
        f"--prompts={tmp_path / 'prompts.json'}", "--max_tokens=8", "--max_model_len=128", "--trust_remote_code",
        f"--out={tmp_path / 'vllm.json'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result] = json.loads((tmp_path / "vllm.json").read_text())
    assert result["engine"] == "vllm"
    assert result["tokens"] == expected
    assert "profile" not in result

    # --profile: the same engine in this process, and one generation of every prompt under torch.profiler
    proc = subprocess.run([*cmd, "--profile"], env=env, capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [profiled] = json.loads((tmp_path / "vllm.json").read_text())
    assert profiled["tokens"] == expected
    calls = {op["op"]: op["calls"] for op in profiled["profile"]}
    steps, layers = 8, len(widths)  # one batch: a prefill step and 7 decode steps, each through every layer
    assert calls["vllm::unified_attention_with_output"] == steps * layers
    # per layer 4 matmuls (q/k/v fused, o, gate/up fused, down), and the LM head once per step
    assert calls["_C::onednn_mm"] == steps * (4 * layers + 1)
