"""Every script in bench/ runs in its quickest mode and prints its table (a refactor that breaks one fails here).

Each script runs as ``python bench/<script> ...`` runs it (as BENCHMARKS.md does) with tiny sizes and one
round, and must exit 0 and print its table header. No number is checked: timings belong in BENCHMARKS.md, not in
tests. The scripts that start rank processes run in their own processes; all the others run one after another in
ONE process (``tests/common/run_scripts.py``, each under ``__name__ == "__main__"`` with its own ``sys.argv``), so
torch and Lightning are imported once, not once per script (most of a tiny run's time).
``bench/gpu.py`` only parses ``--help`` here; tests/test_bench_gpu.py runs its ``--tiny`` mode in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # starts bench scripts and rank processes

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d_model", "32", "--d_ff", "64", "--n_layer", "1", "--batch", "2", "--seq", "8"]
HEADS = ["--n_head", "4", "--n_kv_head", "2"]

#: name -> (script and its quickest arguments, a line of the table header it must print)
SCRIPTS: dict[str, tuple[list[str], str]] = {  # the slowest first: the pool's tail stays short
    "distill-fsdp2": (
        ["bench_distill.py", "--fsdp2", *TINY, "--batch", "4", "--steps", "3", "--rounds", "1"],
        "| variant | ms/step | vs no distillation | teacher forward (ms/step) | teacher collectives/step |",
    ),
    "quality": (  # two variants: the table is what is checked, and each variant is a fit
        ["bench_quality.py", "--quick", "--variants", "dense,default"],
        "| variant | seeds | val loss mean ± std |",
    ),
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
    "sharded-heal": (
        ["bench_sharded_heal.py", "--tiny", "--layers", "2", "--steps", "1", "--seq", "8"],
        "| | step time (median, slowest rank) | params + grads + AdamW held per rank | peak rise during a step |",
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
    "lmzoo": (["bench_lmzoo.py", "--only", "llama", "phi", "--timeout", "0"], "| class | resolves | exact (rel) |"),
    "lmzoo_tp": (
        ["bench_lmzoo.py", "--only", "qwen3", "--timeout", "0", "--tp", "--no-torch-pruning"],
        "Query heads: 1 of 1 GQA classes; target_params: 1 of 1",
    ),
    "shrink": (
        ["bench_shrink.py", "--quick", "--reps", "1", "--latency-calls", "1", "--no-torch-pruning"],
        "| variant | widths | params (M) | tokens/s (batch 32) |",
    ),
    "accumulation": (["bench_accumulation.py", "--repeats", "1"], "| weight dtype | shape | channel dim |"),
    "serve": (["bench_serve.py", "--quick"], "| variant | params | engine | tokens/s | vs dense | paired vs dense |"),
    "oneshot-units": (
        ["bench_oneshot_units.py", "--quick", "--sizes", "0.75", "--scores", "activation"],
        "| units | size | score | allocation | params | held-out loss | vs dense | widths |",
    ),
    "expert-scores": (
        ["bench_expert_scores.py", "--quick"],
        "| score | loss per seed | mean | vs REAP: mean (min, max) | / dense |",
    ),
    "gpu-help": (["gpu.py", "--help"], "usage: gpu.py"),
    "teacher-store": (
        ["bench_teacher_store.py", *TINY, "--steps", "4", "--skip-fsdp2"],
        "| setting | store | last checkpoint (MiB) | all checkpoints + teacher files (MiB) | teacher files (MiB) |",
    ),
}
TIMEOUT_S = 240  # per script, generous for a loaded machine (each takes seconds on an idle one)
#: Scripts that start rank processes by pickling functions of their ``__main__`` (spawn), or that start processes
#: of themselves: each in its own process. Every other script runs in ONE process, one after another
#: (tests/common/run_scripts.py): torch and Lightning imported once, not once per script.
OWN_PROCESS = {"distill-fsdp2", "sharded", "sharded-heal", "gpu-pretrained", "expert-scores"}
#: Run last in the shared process: they put torchvision on the path (tests/common/torchvision_zoo.py).
LAST = ("discover", "zoo")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(name: str) -> subprocess.CompletedProcess[str]:
    script, *args = SCRIPTS[name][0]
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip


def _run_together(names: list[str]) -> dict[str, subprocess.CompletedProcess[str]]:
    """The scripts ``names`` in one process, in order: name -> its result (the process's output if it has none)."""
    from tests.common.run_scripts import PREFIX

    jobs = [[str(ROOT / "bench" / SCRIPTS[n][0][0]), *SCRIPTS[n][0][1:]] for n in names]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "common" / "run_scripts.py"), json.dumps(jobs)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S * len(names), check=False,
    )  # fmt: skip
    records = [json.loads(line[len(PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    out = {}
    for i, (name, job) in enumerate(zip(names, jobs, strict=True)):  # one record per script, in order
        if i >= len(records):  # the shared process died before (or while) running it
            out[name] = subprocess.CompletedProcess(job, proc.returncode or -1, proc.stdout, proc.stderr)
        else:
            assert records[i]["script"] == job[0], (records[i]["script"], job)
            out[name] = subprocess.CompletedProcess(job, records[i]["returncode"], records[i]["stdout"],
                                                    records[i]["stderr"])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The selected scripts, started at the first request: the shared process and the own-process scripts side by
    side on two threads (so the file's wall time is about the longer of the two)."""
    here = request.node.path
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.path == here and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    together = sorted((n for n in selected if n not in OWN_PROCESS), key=lambda n: n in LAST)
    pool = ThreadPoolExecutor(max_workers=2)
    batch = pool.submit(_run_together, together) if together else None
    futures = {name: pool.submit(_run, name) for name in selected if name in OWN_PROCESS}
    for name in together:
        futures[name] = pool.submit(lambda n=name: batch.result()[n])
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_bench_script_runs_and_prints_its_table(name, runs):
    proc = runs[name].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench {name} exited {proc.returncode}:\n{output[-3000:]}"
    assert SCRIPTS[name][1] in proc.stdout, f"bench {name} printed no table header:\n{output[-3000:]}"
