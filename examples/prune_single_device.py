"""The smallest complete setup: one device, a preset, a Trainer. Prints what was pruned and the held-out loss.

python examples/prune_single_device.py
python examples/prune_single_device.py --preset_options '{"residual": true}'   # also prune residual channels
python examples/prune_single_device.py --max_steps=8 --warmup_steps=2 --ramp_steps=3
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl

from lightning_pat import CoupledPruningCallback
from lightning_pat.cli import StepProgressBar
from lightning_pat.demo import StdlibText, TinyGPTModule
from lightning_pat.demo.threads import use_cpu_threads


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--warmup_steps", type=int, default=50)
    parser.add_argument("--ramp_steps", type=int, default=100)
    parser.add_argument("--target_sparsity", type=float, default=0.5)
    parser.add_argument("--preset_options", type=json.loads, default={"mlp": True, "heads": True})
    parser.add_argument("--max_bytes", type=int, default=None, help="cap the data (tests)")
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)

    pl.seed_everything(0)
    pruning = CoupledPruningCallback(
        "tiny_gpt",  # a preset: the MLP channels and the GQA query groups of every layer
        args.target_sparsity,
        warmup_steps=args.warmup_steps,
        ramp_steps=args.ramp_steps,
        every_n_steps=5,
        preset_options=args.preset_options,
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="auto",
        devices=1,
        callbacks=[pruning, StepProgressBar()],
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=4,
        num_sanity_val_steps=0,
    )
    module = TinyGPTModule()
    data = StdlibText(max_bytes=args.max_bytes)
    trainer.fit(module, datamodule=data)
    (val,) = trainer.validate(module, datamodule=data, verbose=False)

    print(f"\nsteps: {pruning.step}   held-out val_loss: {val['val_loss']:.3f}")
    print(f"unit sparsity: {pruning.sparsity()['pruning/unit_sparsity']:.3f}")
    for name, idx in pruning.dropped.items():
        print(f"  {name:<8} dropped {len(idx):>3} units: {idx[:6]}{' ...' if len(idx) > 6 else ''}")
    return {"val_loss": val["val_loss"], **pruning.sparsity()}


if __name__ == "__main__":
    main()
