"""Every script in bench/ runs in its quickest mode and prints its table (a refactor that breaks one fails here).

Each script runs as a subprocess (``python bench/<script> ...``, as BENCHMARKS.md runs it) with tiny sizes and one
round, and must exit 0 and print its table header. No number is checked: timings belong in BENCHMARKS.md, not in
tests. The selected scripts start together on a pool of two workers when the first test asks for its result, so the
file's wall time is about half the scripts' summed time on a 2-core machine (most of it is importing torch).
``bench/gpu.py`` only parses ``--help`` here; tests/test_bench_gpu.py runs its ``--tiny`` mode in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d_model", "32", "--d_ff", "64", "--n_layer", "1", "--batch", "2", "--seq", "8"]
HEADS = ["--n_head", "4", "--n_kv_head", "2"]

#: name -> (script and its quickest arguments, a line of the table header it must print)
SCRIPTS: dict[str, tuple[list[str], str]] = {  # the slowest first: the pool's tail stays short
    "distill-fsdp2": (
        ["bench_distill.py", "--fsdp2", *TINY, "--batch", "4", "--steps", "3", "--rounds", "1"],
        "| variant | ms/step | vs no distillation | teacher forward (ms/step) | teacher collectives/step |",
    ),
    "quality": (["bench_quality.py", "--quick"], "| variant | seeds | val loss mean ± std |"),
    "pretrained": (["bench_pretrained.py", "--quick", "--no-samples"], "| size | arm | heal tokens | seeds |"),
    "pretrained-overhead": (
        ["bench_pretrained.py", "--quick", "--overhead", "--rounds", "1"],
        "| component | ms (CPU) | % of a training step |",
    ),
    "gpu-pretrained": (["gpu_pretrained.py", "--tiny", "--parallel", "2"], "| size | arm | heal tokens | seeds |"),
    "sharded": (
        ["bench_sharded.py", "--world", "2", "--sizes", "S", "--steps", "1"],
        "| size (d/ffn/layers, params) | clusters | executor | collectives |",
    ),
    "size": (["bench_size.py", "--quick"], "| variant | shape | params | tokens/s (batch 32) |"),
    "distill": (
        ["bench_distill.py", *TINY, "--steps", "3", "--rounds", "1"],
        "| variant | ms/step | vs no distillation | teacher memory (MiB) |",
    ),
    "overhead": (
        ["bench_overhead.py", *TINY, "--steps", "8", "--rounds", "1"],
        "| variant | ms/step | vs dense | vs ModelPruning |",
    ),
    "components": (
        ["bench_components.py", *TINY, *HEADS, "--vocab", "64", "--rounds", "1", "--warmup", "0"],
        "| component | ms | % of forward+backward |",
    ),
    "discover": (["bench_discover.py", "--quick", "--models", "resnet"], "| model | ours: clusters / left out |"),
    "zoo": (["bench_zoo.py", "--quick", "--models", "resnet18"], "| model | params | ours: clusters | ours: exact |"),
    "shrink": (
        ["bench_shrink.py", "--quick", "--reps", "1", "--latency-calls", "1", "--no-torch-pruning"],
        "| variant | widths | params (M) | tokens/s (batch 32) |",
    ),
    "accumulation": (["bench_accumulation.py", "--repeats", "1"], "| weight dtype | shape | channel dim |"),
    "serve": (["bench_serve.py", "--quick"], "| variant | params | engine | tokens/s | vs dense | TTFT ms |"),
    "oneshot-units": (
        ["bench_oneshot_units.py", "--quick", "--sizes", "0.75", "--scores", "activation"],
        "| units | size | score | allocation | params | held-out loss | vs dense | widths |",
    ),
    "gpu-help": (["gpu.py", "--help"], "usage: gpu.py"),
}
TIMEOUT_S = 240  # per script, generous for a loaded machine (each takes seconds on an idle one)


def _run(name: str) -> subprocess.CompletedProcess[str]:
    script, *args = SCRIPTS[name][0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The selected scripts, started together on two workers (in collection order) at the first request."""
    here = request.node.path
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.path == here and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(_run, name) for name in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_bench_script_runs_and_prints_its_table(name, runs):
    proc = runs[name].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench {name} exited {proc.returncode}:\n{output[-3000:]}"
    assert SCRIPTS[name][1] in proc.stdout, f"bench {name} printed no table header:\n{output[-3000:]}"
