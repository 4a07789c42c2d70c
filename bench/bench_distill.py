"""Cost of distillation (``distill_alpha``): one teacher forward per training step, and the teacher's memory.

    python bench/bench_distill.py                   # TinyGPT d=256, ffn=1024, 4 layers, batch 8 x 128 tokens, CPU
    OMP_NUM_THREADS=1 python bench/bench_distill.py --clock cpu   # on a shared machine: CPU time, one thread

Every variant trains the same model on the same batches with AdamW in one process, interleaved over rounds (the
best median of each is kept): dense training, lightning_pat healing (the mask held, pruned at step 1) without and
with distillation from the frozen dense copy (alpha 0.5, T 2). The table reports the median wall (or CPU) time of
a training step, its ratio to the run without distillation, and the teacher's parameters and buffers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead  # noqa: E402
from bench_overhead import LM, StepTimer  # noqa: E402

from lightning_pat import CoupledPruningCallback  # noqa: E402
from lightning_pat.demo.model import TinyGPTConfig  # noqa: E402

VARIANTS = ("dense", "lightning_pat healing, no distillation", "lightning_pat healing + distillation")


def run(variant: str, cfg: TinyGPTConfig, *, steps: int, skip: int, data: DataLoader) -> tuple[float, float]:
    module = LM(cfg)
    timer = StepTimer()
    callbacks: list[pl.Callback] = []
    cb = None
    if variant != "dense":
        distill = "distillation" in variant and "no distillation" not in variant
        cb = CoupledPruningCallback(
            "tiny_gpt", 0.5, warmup_steps=0, ramp_steps=1, mode="direct", preset_options={"mlp": True, "heads": False},
            distill_alpha=0.5 if distill else 0.0, distill_temperature=2.0, distill_module="model",
        )  # fmt: skip
        callbacks.append(cb)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[*callbacks, timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
    )  # fmt: skip
    trainer.fit(module, data)
    teacher_bytes = 0 if cb is None else int(cb.controller.teacher_bytes())  # pruning/teacher_bytes
    return statistics.median(timer.times[skip:]) * 1e3, teacher_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--d_ff", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best median is kept")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    bench_overhead.CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = TinyGPTConfig(
        vocab_size=256, n_layer=args.n_layer, n_head=8, n_kv_head=4, d_model=args.d_model, d_ff=args.d_ff,
        max_seq_len=args.seq,
    )  # fmt: skip
    tokens = torch.randint(0, 256, (args.batch * args.steps, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=args.batch)
    skip = min(5, args.steps // 2)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for v in VARIANTS:
            ms, mib = run(v, cfg, steps=args.steps, skip=skip, data=data)
            best[v] = (min(ms, best.get(v, (ms, mib))[0]), mib)
    base = best[VARIANTS[1]][0]
    print(
        f"\nTinyGPT d={args.d_model} ffn={args.d_ff} layers={args.n_layer}, batch {args.batch}x{args.seq}, fp32, CPU "
        f"threads {torch.get_num_threads()}, median of steps {skip + 1}..{args.steps}, best of {args.rounds} "
        f"interleaved rounds, {args.clock} time"
    )
    print("| variant | ms/step | vs no distillation | teacher memory (MiB) |")
    print("| --- | ---: | ---: | ---: |")
    for v in VARIANTS:
        ms, mib = best[v]
        print(f"| {v} | {ms:.1f} | {ms / base:.3f}x | {mib:.2f} |")


if __name__ == "__main__":
    main()
