"""Prune a tiny GPT while training it with FSDP2 (`fully_shard`) under Lightning's ModelParallelStrategy.

`TinyGPTModule.configure_model` shards every block and the root with `fully_shard` over the data-parallel mesh.

Every weight is a DTensor sharded `Shard(0)` across ranks; the callback takes its sharded path: each pruning step
moves one packed vector of per-unit partial scores between ranks and never gathers a weight.

    python examples/fsdp2_prune.py                           # 2 CPU processes (gloo), launched by Lightning
    python examples/fsdp2_prune.py --accelerator=gpu --devices=8
    torchrun --nproc_per_node=8 examples/fsdp2_prune.py --accelerator=gpu --devices=8   # or launched by torchrun
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_pat import CoupledPruningCallback
from lightning_pat.demo import StdlibText, TinyGPTModule
from lightning_pat.demo.threads import use_cpu_threads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--max_bytes", type=int, default=None, help="cap the data (tests)")
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--ramp_steps", type=int, default=50)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    line = use_cpu_threads(processes=args.devices if args.accelerator == "cpu" else 1)  # the ranks share the CPUs
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line)

    pruning = CoupledPruningCallback(
        "tiny_gpt", 0.5, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps, executor="sharded"
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        callbacks=[pruning],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        log_every_n_steps=10,
    )
    data = StdlibText(seq_len=64, batch_size=16, max_bytes=args.max_bytes)
    trainer.fit(TinyGPTModule(), datamodule=data)
    if trainer.is_global_zero:
        routes = {name: kind for name, (kind, _) in pruning.pruner.routes.items()}
        print(f"\nranks: {trainer.world_size}   steps: {pruning.step}   routes: {routes}")
        print(
            f"unit sparsity: {float(trainer.callback_metrics['pruning/unit_sparsity']):.3f}   "
            f"clustered-parameter sparsity: {float(trainer.callback_metrics['pruning/param_sparsity']):.3f}"
        )
        for name, idx in pruning.dropped.items():
            print(f"  {name:<8} dropped {len(idx):>3} units: {idx[:8]}{' ...' if len(idx) > 8 else ''}")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
