"""Checkpoint bytes with distillation: the teacher in every checkpoint (``distill_teacher_store="checkpoint"``, the
default) vs written once as a file (``"file"``), on one device and under FSDP2 (2 gloo ranks, distributed checkpoints).

    python bench/bench_teacher_store.py                 # TinyGPT d=256, ffn=1024, 4 layers (4.0M parameters), CPU
    python bench/bench_teacher_store.py --skip-fsdp2    # one device only

Each run trains the demo's ``TinyGPTModule`` with AdamW for ``--steps`` steps (warmup 2, ramp 4, distillation from
the frozen dense copy) and a ``ModelCheckpoint`` after every step, so every checkpoint after the warmup is written
while distilling. The table reports, per store: the bytes of the last checkpoint (a ``.ckpt`` file, or the
distributed checkpoint's directory), of the whole checkpoint directory (every checkpoint plus the teacher files), and
of the teacher files alone; and the ratio file / checkpoint. Sizes are deterministic: one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_pat import CoupledPruningCallback  # noqa: E402
from lightning_pat.demo import TinyGPTModule  # noqa: E402

STORES = ("checkpoint", "file")
WARMUP, RAMP = 2, 4


def size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fit(store: str, out: Path, args: argparse.Namespace, *, fsdp2: bool) -> None:
    """One run; its checkpoints go to ``out``."""
    module = TinyGPTModule(
        n_layer=args.n_layer, n_head=8, n_kv_head=4, d_model=args.d_model, d_ff=args.d_ff, max_seq_len=args.seq
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch * args.steps, args.seq + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    cb = CoupledPruningCallback(
        "tiny_gpt", 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, mode="direct", distill_alpha=0.5,
        distill_module="model", distill_teacher_store=store,
    )  # fmt: skip
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    strategy: object = "auto"
    if fsdp2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=2 if fsdp2 else 1, strategy=strategy, callbacks=[cb, ckpt],
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, data)


def measure(out: Path, steps: int) -> dict[str, int]:
    teacher = sum(size(p) for p in out.glob("pat-teacher-*.safetensors"))
    return {"last": size(out / f"step={steps}.ckpt"), "all": size(out), "teacher": teacher}


def fsdp2_run(store: str, out: Path, args: argparse.Namespace) -> None:
    """Two ranks of this script (``--rank-worker``), launched with the rank environment Lightning reads."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        argv = [sys.executable, __file__, "--rank-worker", store, str(out), f"--steps={args.steps}"]
        argv += [f"--d_model={args.d_model}", f"--d_ff={args.d_ff}", f"--n_layer={args.n_layer}"]
        argv += [f"--batch={args.batch}", f"--seq={args.seq}"]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"FSDP2 rank failed:\n{err[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--d_ff", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--skip-fsdp2", action="store_true")
    parser.add_argument("--rank-worker", nargs=2, metavar=("STORE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        fit(args.rank_worker[0], Path(args.rank_worker[1]), args, fsdp2=True)
        return
    shape = {"n_layer": args.n_layer, "d_model": args.d_model, "d_ff": args.d_ff, "max_seq_len": args.seq}
    params = sum(p.numel() for p in TinyGPTModule(n_head=8, n_kv_head=4, **shape).parameters())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("one device", "FSDP2, 2 ranks, distributed checkpoint")[: 1 if args.skip_fsdp2 else 2]:
            got = {}
            for store in STORES:
                out = Path(tmp) / f"{setting[:4]}-{store}"
                if setting == "one device":
                    fit(store, out, args, fsdp2=False)
                else:
                    fsdp2_run(store, out, args)
                got[store] = measure(out, args.steps)
            rows.append((setting, got))
    mib = 2**20
    print(
        f"\nTinyGPT d={args.d_model} ffn={args.d_ff} layers={args.n_layer} ({params / 1e6:.2f}M parameters, fp32), "
        f"AdamW, {args.steps} steps (warmup {WARMUP}, ramp {RAMP}), a checkpoint after every step "
        f"({args.steps - WARMUP} while distilling)"
    )
    print("| setting | store | last checkpoint (MiB) | all checkpoints + teacher files (MiB) | teacher files (MiB) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for setting, got in rows:
        for store in STORES:
            m = got[store]
            print(f"| {setting} | {store} | {m['last'] / mib:.2f} | {m['all'] / mib:.2f} | {m['teacher'] / mib:.2f} |")
        base, ours = got["checkpoint"], got["file"]
        print(
            f"| {setting} | ratio file / checkpoint | {ours['last'] / base['last']:.3f}x | "
            f"{ours['all'] / base['all']:.3f}x | |"
        )
    print("\nJSON " + json.dumps(dict(rows)))


if __name__ == "__main__":
    main()
