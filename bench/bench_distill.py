"""Cost of distillation (``distill_alpha``): one teacher forward per training step, and the teacher's memory.

    python bench/bench_distill.py                   # TinyGPT d=256, ffn=1024, 4 layers, batch 8 x 128 tokens, CPU
    OMP_NUM_THREADS=1 python bench/bench_distill.py --clock cpu   # on a shared machine: CPU time, one thread
    python bench/bench_distill.py --fsdp2 --clock cpu   # under FSDP2: 2 gloo ranks on CPU, the sharded teacher

Every variant trains the same model on the same batches with AdamW in one process, interleaved over rounds (the
best median of each is kept): dense training, lightning_pat healing (the mask held, pruned at step 1) without and
with distillation from the frozen dense copy (alpha 0.5, T 2). The table reports the median wall (or CPU) time of
a training step, its ratio to the run without distillation, and the teacher's parameters and buffers.

``--fsdp2``: the same model sharded by ``fully_shard`` (every block, then the root) on 2 gloo ranks (CPU, one thread
each), trained through the ``PruningController`` (healing, as above) without and with distillation, interleaved
over rounds. The teacher is the frozen copy sharded like the student (``lightning_pat.parallel.teacher``); its
forward gathers each FSDP2-managed module's parameters. The table adds the teacher's forward time, the
collectives it issues per step (counted by ``CommDebugMode``), and its bytes per rank against the full model's.
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


FSDP2_VARIANTS = ("no distillation", "distillation")


class ForwardTimer:
    """Time the forward of a module (the teacher, once it exists) into ``times[-1]``, one entry per step."""

    def __init__(self, clock) -> None:  # noqa: ANN001
        self.clock, self.times, self._start, self._module = clock, [0.0], 0.0, None

    def watch(self, module: torch.nn.Module | None) -> None:
        if module is not None and module is not self._module:
            self._module = module
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _pre(self, *_: object) -> None:
        self._start = self.clock()

    def _post(self, *_: object) -> None:
        self.times[-1] += self.clock() - self._start


def _fsdp2_rank(rank: int, world: int, cfg: TinyGPTConfig, steps: int, rounds: int, batch: int) -> dict:
    """One rank: FSDP2 TinyGPT healing through the controller, without and with distillation (interleaved)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_pat.demo import preset as demo_preset
    from lightning_pat.demo.model import TinyGPT
    from lightning_pat.pruning.options import PruningOptions
    from lightning_pat.training.controller import PruningController

    clock = bench_overhead.CLOCK
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own share of the batch
    batches = [torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g) for _ in range(steps)]
    best: dict[str, dict] = {}
    for r in range(rounds):
        for v in FSDP2_VARIANTS[r % 2 :] + FSDP2_VARIANTS[: r % 2]:  # rotated: neither always runs first
            torch.manual_seed(0)
            model = TinyGPT(cfg)
            full_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            decl = demo_preset.tiny_gpt(model, mlp=True, heads=False, residual=False)
            opts = PruningOptions(
                decl, target_sparsity=0.5, warmup_steps=0, ramp_steps=1, mode="direct",
                distill_alpha=0.5 if v == "distillation" else 0.0, distill_temperature=2.0, distill_module="",
            )  # fmt: skip
            ctl = PruningController(opts, info=lambda _: None)
            ctl.bind(model, optimizers=[opt])
            ctl.start()
            times: list[float] = []
            teacher = ForwardTimer(clock)
            for i, x in enumerate(batches):
                t0 = clock()
                ctl.before_batch(first_of_epoch=i == 0)
                teacher.watch(ctl.teacher)
                logits = model(x[:, :-1])
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
                ctl.after_backward(opt)
                opt.step()
                opt.zero_grad()
                ctl.after_step()
                times.append(clock() - t0)
                teacher.times.append(0.0)
            comms = 0
            if ctl.teacher is not None:  # one more teacher forward, untimed: its collectives
                with CommDebugMode() as mode, torch.no_grad():
                    ctl.teacher(batches[0][:, :-1])
                comms = mode.get_total_counts()
            ctl.release()
            skip = min(2, steps // 2)
            row = {
                "ms": statistics.median(times[skip:]) * 1e3,
                "teacher_ms": statistics.median(teacher.times[skip:steps]) * 1e3,
                "comms": comms,
                "teacher_bytes": int(ctl.teacher_bytes()),
                "full_bytes": full_bytes,
            }
            prev = best.get(v, row)
            best[v] = {**row, **{k: min(row[k], prev[k]) for k in ("ms", "teacher_ms")}}
    return best


def fsdp2_table(cfg: TinyGPTConfig, args: argparse.Namespace) -> None:
    """Print the ``--fsdp2`` table (each number the slower rank's; bytes per rank)."""
    results = bench_overhead.launch(_fsdp2_rank, cfg, args.steps, args.rounds, args.batch // 2)
    rows = {v: {k: max(results[r][v][k] for r in results) for k in results[0][v]} for v in FSDP2_VARIANTS}
    base = rows["no distillation"]["ms"]
    print(
        f"\nFSDP2, 2 gloo ranks on CPU (one thread each), TinyGPT d={args.d_model} ffn={args.d_ff} "
        f"layers={args.n_layer}, batch {args.batch // 2}x{args.seq} per rank, fp32, healing (MLP pruned at step 1), "
        f"median of steps 3..{args.steps}, slower rank, best of {args.rounds} interleaved rounds, {args.clock} time"
    )
    print(
        "| variant | ms/step | vs no distillation | teacher forward (ms/step) | teacher collectives/step "
        "| teacher MiB/rank | full model MiB | teacher / full |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v, row in rows.items():
        full = row["full_bytes"] / 2**20
        mib = row["teacher_bytes"] / 2**20
        print(
            f"| {v} | {row['ms']:.1f} | {row['ms'] / base:.3f}x | {row['teacher_ms']:.1f} | {row['comms']} "
            f"| {mib:.2f} | {full:.2f} | {mib / full:.3f} |"
        )


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
    parser.add_argument("--fsdp2", action="store_true", help="only: the sharded teacher under FSDP2 (2 gloo ranks)")
    args = parser.parse_args()
    bench_overhead.CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = TinyGPTConfig(
        vocab_size=256, n_layer=args.n_layer, n_head=8, n_kv_head=4, d_model=args.d_model, d_ff=args.d_ff,
        max_seq_len=args.seq,
    )  # fmt: skip
    if args.fsdp2:
        fsdp2_table(cfg, args)
        return
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
