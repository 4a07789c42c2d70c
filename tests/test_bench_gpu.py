"""bench/gpu.py runs end to end with --tiny on CPU, so the prepared GPU run is known to work before a GPU is lent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.common.lit_models import ends_mid_ramp

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_tiny_on_cpu(tmp_path, capsys):
    bench = _load()
    with ends_mid_ramp():  # the tiny run stops inside the ramp, and says so
        out = bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    assert set(out["variants"]) == set(bench.VARIANTS)
    for name, row in out["variants"].items():
        assert row["step_ms"] > 0
        assert (row["hook_ms"] > 0) == (name != "dense")
    assert out["inference"]["params_shrunk"] < out["inference"]["params_dense"]
    assert out["inference"]["shrunk_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert saved["variants"].keys() == out["variants"].keys()
    assert "| variant | ms/step |" in capsys.readouterr().out
