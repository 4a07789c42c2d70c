"""bench/gpu.py runs end to end with --tiny on CPU, so the prepared GPU run is known to work before a GPU is lent."""

from __future__ import annotations

import json

import pytest

from tests.common.bench_modules import load_bench
from tests.common.lit_models import ends_mid_ramp

pytest.importorskip("transformers")


def test_gpu_bench_tiny_on_cpu(tmp_path, capsys):
    bench = load_bench("gpu")
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


def test_gpu_pretrained_runs_option():
    bench = load_bench("gpu_pretrained")
    assert bench._runs("dense_heal:1,ramp:0.75") == [("dense_heal", 1.0), ("ramp", 0.75)]
    assert bench._runs(None) == list(bench.RUNS)
    with pytest.raises(SystemExit, match=r"--runs: 'rampp:0.5' is not ARM:SIZE"):
        bench._runs("rampp:0.5")
    with pytest.raises(SystemExit, match=r"--runs: 'ramp' is not ARM:SIZE"):
        bench._runs("ramp")


def test_gpu_pretrained_deadline_stops_runs_and_says_so(tmp_path, capsys):
    """A run still going at --deadline is killed and reported as stopped, not as a failure (and not as a result)."""
    bench = load_bench("gpu_pretrained")
    records = bench.main(["--tiny", "--parallel", "2", "--deadline", "1.5", "--out", str(tmp_path)])
    assert records == []
    log = (tmp_path / "pretrained_gpu_table.md").read_text()
    assert log.count("stopped at the deadline (not finished; no record)") == 2, log
    assert "FAILED" not in log
