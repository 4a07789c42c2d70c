"""Cost of accumulating unit scores in float64 (every path, every dtype) vs the former float32 accumulation.

    python bench/bench_accumulation.py            # CPU, one thread, shapes of a 1024/4096 Llama-style layer
    python bench/bench_accumulation.py --threads 2

Times the per-channel sum of squares of one (local) weight, the only part of scoring whose cost grows with the
weight: ``float32`` is the former ``torch.linalg.vector_norm(w, dim, dtype=float32).square()``; ``float64`` is
:func:`lightning_pat.core.norms.channel_sq_sums` as shipped (each element converted to float64, squared and summed, in
chunks of at most 2^22 elements). Variants interleaved, median of ``--repeats`` calls, best of 3 rounds. Also prints
the extra temporary memory (the float64 chunk) and the whole-model ratio for the sharded pruning step's scoring.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pat.core.norms import _CHUNK_ELEMS, channel_sq_sums  # noqa: E402

SHAPES = [((4096, 1024), 0), ((1024, 4096), 1), ((4096, 1024), 1), ((1024, 1024), 0)]  # (shape, channel dim)


def old(w: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.linalg.vector_norm(w, dim=1 - dim, dtype=torch.float32).square()


def new(w: torch.Tensor, dim: int) -> torch.Tensor:
    return channel_sq_sums(w, dim=dim, acc_dtype=torch.float64)


def timed(fn, w: torch.Tensor, dim: int, repeats: int) -> float:  # noqa: ANN001
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(w, dim)
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape, dim in SHAPES:
            w = torch.randn(shape, generator=gen).to(dtype)
            best = {"float32": float("inf"), "float64": float("inf")}
            for _ in range(3):
                best["float32"] = min(best["float32"], timed(old, w, dim, args.repeats))
                best["float64"] = min(best["float64"], timed(new, w, dim, args.repeats))
            temp = min(w.numel(), max(1, _CHUNK_ELEMS // w.shape[1 - dim]) * w.shape[1 - dim]) * 8
            rows.append((str(dtype).split(".")[1], shape, dim, best["float32"], best["float64"], temp))
    sys.stdout.write(
        f"Per-channel sums of squares of one weight, CPU, {args.threads} thread(s), median of {args.repeats} calls,"
        " best of 3 interleaved rounds\n"
        "| weight dtype | shape | channel dim | float32 accumulation (ms) | float64 accumulation (ms) | ratio | "
        "float64 temporary |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |\n"
    )
    for dtype, shape, dim, t32, t64, temp in rows:
        sys.stdout.write(
            f"| {dtype} | {shape[0]}x{shape[1]} | {dim} | {t32 * 1e3:.2f} | {t64 * 1e3:.2f} | {t64 / t32:.2f}x | "
            f"{temp / 2**20:.0f} MiB |\n"
        )
    total32 = sum(r[3] for r in rows)
    total64 = sum(r[4] for r in rows)
    sys.stdout.write(
        f"\nAll shapes together: {total32 * 1e3:.1f} ms -> {total64 * 1e3:.1f} ms ({total64 / total32:.2f}x)\n"
    )


if __name__ == "__main__":
    main()
