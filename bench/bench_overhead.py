"""Training-step overhead and extra memory: lightning_pat vs Lightning's ModelPruning vs dense training.

    python bench/bench_overhead.py                 # TinyGPT d=256, ffn=1024, 4 layers, batch 8 x 128 tokens, CPU
    python bench/bench_overhead.py --steps 30      # quicker
    OMP_NUM_THREADS=1 python bench/bench_overhead.py --clock cpu   # on a shared machine: CPU time, one thread
    python bench/bench_overhead.py --activation    # also score="activation" (reader statistics every forward)
    python bench/bench_overhead.py --fsdp2 --steps 30   # data-aware scores under FSDP2 (2 gloo ranks on CPU)

Every variant trains the same model on the same batches with AdamW in one process, one after another; the table
reports the median wall time of a training step (forward, backward, optimizer step and the pruning work) over the
measured steps, its ratio to dense training, and the extra memory the pruning method holds. Both pruning methods
prune the MLP: lightning_pat couples gate/up rows with down columns (one cluster per layer); ModelPruning prunes
rows of each Linear separately (`ln_structured`, dim 0), the closest it offers. ModelPruning applies its mask at
epoch ends and recomputes `weight = weight_orig * weight_mask` in a forward pre-hook on every step after that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelPruning
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pat import CoupledPruningCallback  # noqa: E402
from lightning_pat.demo import preset as demo_preset  # noqa: E402
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig  # noqa: E402

CLOCK = time.perf_counter  # --clock cpu: time.process_time (with one intra-op thread: CPU time of the process)


class LM(pl.LightningModule):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(cfg)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        logits = self.model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.hook_times: list[float] = [0.0]
        self._t0 = 0.0
        self.latent_bytes = 0

    def on_train_end(self, trainer, pl_module):  # before the pruning callback's teardown frees its latents
        for cb in trainer.callbacks:
            if isinstance(cb, CoupledPruningCallback):
                self.latent_bytes = sum(t.numel() * t.element_size() for t in cb.latent_params().values())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = CLOCK()
        self.hook_times.append(0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(CLOCK() - self._t0)


def time_hooks(cb: pl.Callback, sink: list[float]) -> None:
    """Accumulate the wall time spent inside the pruning callback's per-step hooks into ``sink[-1]``."""
    for hook in ("on_before_optimizer_step", "on_train_batch_end"):
        inner = getattr(cb, hook)

        def timed(*args, _inner=inner, **kwargs):
            t0 = CLOCK()
            try:
                return _inner(*args, **kwargs)
            finally:
                sink[-1] += CLOCK() - t0

        setattr(cb, hook, timed)


def mlp_linears(module: LM) -> list[tuple[torch.nn.Module, str]]:
    return [
        (m, "weight")
        for n, m in module.model.named_modules()
        if n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")
    ]


def run(variant: str, cfg: TinyGPTConfig, *, steps: int, skip: int, batches_per_epoch: int, data: DataLoader):
    module = LM(cfg)
    timer = StepTimer()
    callbacks: list[pl.Callback] = []
    extra_bytes = 0
    if variant.startswith("lightning_pat"):
        mode = "direct" if "direct" in variant else "latent"
        healing = "healing" in variant
        cb = CoupledPruningCallback(
            "tiny_gpt",
            0.5,
            warmup_steps=0,
            ramp_steps=1 if healing else 10**6,
            mode=mode,
            score="activation" if "activation" in variant else "rms",
            preset_options={"mlp": True, "heads": False},
        )
        time_hooks(cb, timer.hook_times)
        callbacks.append(cb)
    elif variant.startswith("ModelPruning"):
        cb = ModelPruning(
            "ln_structured",
            parameters_to_prune=mlp_linears(module),
            amount=0.5,
            pruning_dim=0,
            pruning_norm=2,
            use_global_unstructured=False,
            use_lottery_ticket_hypothesis=False,
            make_pruning_permanent=False,
        )
        callbacks.append(cb)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=[*callbacks, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=batches_per_epoch,
        log_every_n_steps=50,
    )
    trainer.fit(module, data)
    if variant.startswith("lightning_pat"):  # latent copies (latent mode, before healing) + index vectors
        extra_bytes = timer.latent_bytes + sum(8 * len(v) for v in cb.dropped.values())
    elif variant.startswith("ModelPruning"):
        for m, _ in mlp_linears(module):  # mask buffer + the recomputed weight (weight_orig is the old parameter)
            extra_bytes += m.weight_mask.numel() * m.weight_mask.element_size() + m.weight.numel() * 4
    times = timer.times[skip:]
    hooks = timer.hook_times[1:][skip:]
    return statistics.median(times) * 1e3, statistics.median(hooks) * 1e3, extra_bytes / 2**20


def activation_cost(cfg: TinyGPTConfig, data: DataLoader, *, reps: int) -> tuple[float, float]:
    """Median forward+backward time without and with ``score="activation"``'s statistics hooks (interleaved)."""
    from lightning_pat import resolve_clusters
    from lightning_pat.scoring.activation import ActivationStats

    module = LM(cfg)
    model = module.model
    clusters = resolve_clusters(model, demo_preset.tiny_gpt(model))
    stats = ActivationStats(model, clusters)
    x = next(iter(data))[0]
    plain, hooked = [], []
    for i in range(2 * reps + 2):
        with_hooks = i % 2 == 1
        if with_hooks:
            stats.attach()
        t0 = CLOCK()
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        dt = CLOCK() - t0
        stats.detach()
        model.zero_grad(set_to_none=True)
        if i >= 2:  # the first pair warms up
            (hooked if with_hooks else plain).append(dt)
    return statistics.median(plain) * 1e3, statistics.median(hooked) * 1e3


FSDP2_SCORES = ("rms", "activation", "taylor")


def _rank_main(fn, rank: int, world: int, store_path: str, clock, args: tuple, out) -> None:  # noqa: ANN001
    """A spawned rank: one intra-op thread, a gloo process group, ``fn(rank, world, *args)`` put on ``out``."""
    import torch.distributed as dist

    global CLOCK
    CLOCK = clock
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    out.put((rank, result))


def launch(fn, *args, world: int = 2, timeout: float = 1800) -> dict:  # noqa: ANN001
    """Run ``fn(rank, world, *args)`` (a module-level function) on ``world`` spawned gloo ranks on CPU.

    Returns:
        Rank -> what ``fn`` returned on that rank.
    """
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, f"{tmp}/store", CLOCK, args, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(60)
    return results


def _fsdp2_rank(rank: int, world: int, cfg: TinyGPTConfig, steps: int, rounds: int) -> dict:
    """One rank: FSDP2 TinyGPT; per score, a fresh selection every step through the controller (interleaved)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_pat.pruning.options import PruningOptions
    from lightning_pat.training.controller import PruningController

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own half of the batch
    batches = [torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=g) for _ in range(steps)]
    best: dict[str, tuple[float, float]] = {}
    for r in range(rounds):
        for score in FSDP2_SCORES[r % 3 :] + FSDP2_SCORES[: r % 3]:  # rotated: no score always runs first
            torch.manual_seed(0)
            model = TinyGPT(cfg)
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            decl = demo_preset.tiny_gpt(model, mlp=True, heads=True, residual=False)
            opts = PruningOptions(decl, target_sparsity=0.5, warmup_steps=0, ramp_steps=10**6, score=score)
            ctl = PruningController(opts, info=lambda _: None)
            ctl.bind(model, optimizers=[opt])
            ctl.start()
            times, work = [], []
            for x in batches:
                t0 = CLOCK()
                logits = model(x[:, :-1])
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
                t1 = CLOCK()
                ctl.after_backward(opt)
                t2 = CLOCK()
                opt.step()
                opt.zero_grad()
                t3 = CLOCK()
                ctl.after_step()
                t4 = CLOCK()
                times.append(t4 - t0)
                work.append((t2 - t1) + (t4 - t3))
            ctl.release()
            ms, work_ms = statistics.median(times[2:]) * 1e3, statistics.median(work[2:]) * 1e3
            prev = best.get(score, (ms, work_ms))
            best[score] = (min(ms, prev[0]), min(work_ms, prev[1]))
    return best


def fsdp2_cost(cfg: TinyGPTConfig, *, steps: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per score under FSDP2 (a fresh selection every step): median step time and median time in the controller's
    per-step calls (scores, selection, masking, latents), each the slower rank's."""
    results = launch(_fsdp2_rank, cfg, steps, rounds)
    return {s: tuple(max(results[r][s][i] for r in results) for i in range(2)) for s in FSDP2_SCORES}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--d_ff", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best median is kept")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time (use with OMP_NUM_THREADS=1 on a shared machine, where wall time mostly waits)",
    )
    parser.add_argument("--activation", action="store_true", help='add score="activation" (latent, every step)')
    parser.add_argument(
        "--fsdp2", action="store_true", help="only: rms vs activation vs taylor under FSDP2 on 2 gloo ranks (CPU)"
    )
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    cfg = TinyGPTConfig(
        vocab_size=256,
        n_layer=args.n_layer,
        n_head=8,
        n_kv_head=4,
        d_model=args.d_model,
        d_ff=args.d_ff,
        max_seq_len=args.seq,
    )
    if args.fsdp2:
        costs = fsdp2_cost(cfg, steps=args.steps, rounds=args.rounds)
        print(
            f"\nFSDP2, 2 gloo ranks on CPU (one thread each), TinyGPT d={args.d_model} ffn={args.d_ff} "
            f"layers={args.n_layer}, batch 4x{args.seq} per rank, MLP + head clusters, latent mode, a fresh selection "
            f"every step; median step (forward, backward, pruning work, AdamW), slower rank, best of {args.rounds} "
            f"interleaved rounds, {args.clock} time"
        )
        print("| score | ms/step | vs score=rms | pruning work (ms/step) | vs score=rms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        base, base_work = costs["rms"]
        for score, (ms, work) in costs.items():
            print(f"| {score} | {ms:.1f} | {ms / base:.3f}x | {work:.1f} | {work / base_work:.2f}x |")
        return
    tokens = torch.randint(0, 256, (args.batch * args.steps, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=args.batch)
    per_epoch = max(args.steps // 4, 2)  # ModelPruning prunes at the end of the first epoch
    skip = per_epoch + 2
    if args.steps <= skip:
        parser.error(f"--steps {args.steps}: the first {skip} steps are not measured; pass at least {skip + 1}")
    variants = [
        "dense",
        "lightning_pat latent, fresh selection every step",
        "lightning_pat direct, fresh selection every step",
        "lightning_pat healing (mask held)",
        "ModelPruning ln_structured (after first prune)",
    ]
    if args.activation:  # before ModelPruning, which stays the last row (the "vs ModelPruning" reference)
        variants.insert(3, "lightning_pat latent, score=activation, fresh selection every step")
    best: dict[str, tuple[float, float, float]] = {}
    for _ in range(args.rounds):  # interleaved, so a noisy neighbour hurts every variant alike
        for v in variants:
            ms, hook_ms, mib = run(v, cfg, steps=args.steps, skip=skip, batches_per_epoch=per_epoch, data=data)
            prev = best.get(v, (ms, hook_ms, mib))
            best[v] = (min(ms, prev[0]), min(hook_ms, prev[1]), mib)
    rows = [(v, *best[v]) for v in variants]
    dense = rows[0][1]
    mp = rows[-1][1]
    mlp_params = 3 * args.d_model * args.d_ff * args.n_layer
    print(
        f"\nTinyGPT d={args.d_model} ffn={args.d_ff} layers={args.n_layer} (MLP params {mlp_params / 1e6:.2f} M), "
        f"batch {args.batch}x{args.seq}, fp32, CPU threads {torch.get_num_threads()}, median of steps "
        f"{skip + 1}..{args.steps}, best of {args.rounds} interleaved rounds, {args.clock} time"
    )
    print("| variant | ms/step | vs dense | vs ModelPruning | in pruning hooks (ms/step) | extra memory (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ms, hook_ms, mib in rows:
        hooks = f"{hook_ms:.2f}" if name.startswith("lightning_pat") else "n/a (forward pre-hooks)"
        print(f"| {name} | {ms:.1f} | {ms / dense:.3f}x | {ms / mp:.3f}x | {hooks} | {mib:.3f} |")
    if args.activation:
        plain, hooked = activation_cost(cfg, data, reps=max(args.steps // 2, 5))
        print(
            f"\nscore='activation' statistics (MLP + head readers, every training forward): forward+backward "
            f"{plain:.1f} ms without, {hooked:.1f} ms with the hooks (+{hooked - plain:.2f} ms, "
            f"{(hooked - plain) / plain:+.1%}), median of interleaved calls, {args.clock} time"
        )


if __name__ == "__main__":
    main()
