"""The lightning_pat demo: prune half of a byte-level GPT while it learns Python, then cut the zeros out.

A TinyGPT (4 layers, d=128, GQA 4 query / 2 KV heads, SwiGLU 512) learns next-byte prediction on the Python
standard library's own source files (held-out validation files; nothing is downloaded). It trains dense, then
`CoupledPruningCallback` ramps to 50% of the MLP channels and 50% of the KV groups (each a KV head with its query
heads) of every layer, the mask freezes and the model heals. `lightning_pat.shrink` then removes the dropped units.
The same number of steps is also trained without pruning, for an honest dense-vs-pruned comparison. Ends with a
table (sizes, validation loss, speedup, kept units per layer) and a PNG of loss and sparsity over steps.

    python examples/demo.py         # 64 s on an idle 2-core CPU (2026-12-01); longer where others hold the cores
    python examples/demo.py --max_steps=12 --warmup_steps=2 --ramp_steps=4 --val_every=4 --max_bytes=200000
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pat import CoupledPruningCallback, load_pretrained, save_pretrained, shrink
from lightning_pat.cli import StepProgressBar
from lightning_pat.demo import StdlibText, TinyGPTModule
from lightning_pat.demo.threads import use_cpu_threads


class History(pl.Callback):
    """Records training loss and unit sparsity after every step, and validation loss after every validation."""

    def __init__(self, pruning: CoupledPruningCallback | None = None) -> None:
        self.pruning = pruning
        self.steps: list[int] = []
        self.train_loss: list[float] = []
        self.sparsity: list[float] = []
        self.val: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)
        self.train_loss.append(float(outputs["loss"]))
        if self.pruning is not None:
            units = sum(rc.num_units for rc in self.pruning.resolved)
            self.sparsity.append(sum(len(v) for v in self.pruning.dropped.values()) / units)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


@torch.inference_mode()
def evaluate(model: torch.nn.Module, loader) -> float:
    """Mean next-byte cross-entropy (nats per byte) of ``model`` over ``loader``."""
    model.eval()
    losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in loader]
    return float(torch.stack(losses).mean())


@torch.inference_mode()
def forward_ms(models: dict[str, torch.nn.Module], x: torch.Tensor, reps: int) -> dict[str, float]:
    """Median forward time per model in milliseconds, measured interleaved (one call of each model per round)."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():
        model.eval()
        model(x)  # warm up
    for _ in range(reps):
        for name, model in models.items():
            start = time.perf_counter()
            model(x)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def train(args, pruning: CoupledPruningCallback | None, label: str) -> tuple[TinyGPTModule, History, StdlibText]:
    pl.seed_everything(args.seed, verbose=False)
    module = TinyGPTModule(n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=512, lr=args.lr, seed=args.seed)
    data = StdlibText(seq_len=64, batch_size=args.batch_size, val_windows=args.val_windows, max_bytes=args.max_bytes)
    history = History(pruning)
    callbacks: list[Any] = [history] + ([pruning] if pruning is not None else [])
    if args.progress_bar:
        callbacks.append(StepProgressBar(refresh_rate=10))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress_bar,
        val_check_interval=args.val_every,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
    )
    print(f"\n== {label}: {args.max_steps} steps ==")
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    print(f"   trained in {time.perf_counter() - start:.0f} s")
    return module, history, data


def plot(path: Path, pruned: History, dense: History | None, pruning: CoupledPruningCallback) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_sp) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    k = 10  # moving average of the per-step training loss

    def smooth(values: list[float]) -> list[float]:
        return [statistics.fmean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]

    if dense is not None:
        ax_loss.plot(dense.steps, smooth(dense.train_loss), color="0.6", lw=1, label="dense: train")
        ax_loss.plot(*zip(*dense.val, strict=True), "o--", color="0.4", ms=3, label="dense: validation")
    ax_loss.plot(pruned.steps, smooth(pruned.train_loss), color="C0", lw=1, label="pruned: train")
    ax_loss.plot(*zip(*pruned.val, strict=True), "o-", color="C3", ms=3, label="pruned: validation")
    ax_loss.set_ylabel("loss (nats / byte)")
    ax_loss.set_ylim(top=min(4.0, max(pruned.train_loss)))
    ax_loss.legend()
    sched = pruning.schedule
    for ax in (ax_loss, ax_sp):
        ax.axvspan(0, sched.warmup_steps, color="0.93")
        ax.axvspan(sched.final_step, pruned.steps[-1], color="#e8f4e8")
    target = [pruning.target_sparsity * sched.fraction(s) for s in pruned.steps]
    ax_sp.plot(pruned.steps, target, "--", color="0.3", label="schedule target")
    ax_sp.plot(pruned.steps, pruned.sparsity, color="C2", label="dropped units")
    ax_sp.set_ylabel("unit sparsity")
    ax_sp.set_xlabel("optimizer step   (grey: dense warmup, green: healing with a frozen mask)")
    ax_sp.legend(loc="upper left")
    fig.suptitle("TinyGPT on the Python standard library: 50% of MLP channels and KV groups pruned")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--warmup_steps", type=int, default=75)
    parser.add_argument("--ramp_steps", type=int, default=125)
    parser.add_argument("--every_n_steps", type=int, default=10)
    parser.add_argument("--target_sparsity", type=float, default=0.5)
    parser.add_argument("--val_every", type=int, default=50, help="validate every N steps")
    parser.add_argument("--val_windows", type=int, default=256, help="held-out windows of 64 bytes")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_bytes", type=int, default=None, help="cap the data (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed_reps", type=int, default=30, help="timed forward calls per model")
    parser.add_argument("--no_dense_run", action="store_true", help="skip the dense comparison run")
    parser.add_argument("--no_progress_bar", dest="progress_bar", action="store_false")
    parser.add_argument("--output_dir", default="demo_output")
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pat"):
        logging.getLogger(name).setLevel(logging.WARNING)  # keep the demo's output to what it shows
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    pruning = CoupledPruningCallback(
        "tiny_gpt",
        args.target_sparsity,
        warmup_steps=args.warmup_steps,
        ramp_steps=args.ramp_steps,
        every_n_steps=args.every_n_steps,
        preset_options={"mlp": True, "heads": True},
    )
    module, history, data = train(args, pruning, "pruning-aware training (dense warmup, ramp, heal)")
    dense_history = None
    if not args.no_dense_run:
        dense_module, dense_history, _ = train(args, None, "the same run without pruning (for comparison)")
    val_loader = data.val_dataloader()

    masked = copy.deepcopy(module.model)  # the pruned model as trained: full size, dropped units exactly zero
    n_rep = masked.layers[0].attn.n_rep
    r: dict[str, Any] = {"val_loss_pruned": evaluate(masked, val_loader)}
    if dense_history is not None:
        r["val_loss_dense"] = evaluate(dense_module.model, val_loader)
    units = {rc.name: rc.num_units for rc in pruning.resolved}
    r["kept"] = {name: c - len(pruning.dropped[name]) for name, c in units.items()}

    shrink(module, pruning)  # in place: module.model is now the small dense model
    small = module.model
    x = next(iter(val_loader))[0]
    with torch.inference_mode():
        r["max_abs_diff"] = float((small(x) - masked(x)).abs().max())
    r["val_loss_shrunk"] = evaluate(small, val_loader)
    dense_dir, small_dir = (
        save_pretrained(masked, out / "dense", overwrite=True),
        save_pretrained(small, out / "shrunk", overwrite=True),
    )
    with torch.inference_mode():
        r["reload_max_abs_diff"] = float((load_pretrained(small_dir)(x) - small(x)).abs().max())
    ms = forward_ms({"dense": masked, "shrunk": small}, x, reps=args.speed_reps)
    r.update(
        params_dense=sum(p.numel() for p in masked.parameters()),
        params_shrunk=sum(p.numel() for p in small.parameters()),
        bytes_dense=dir_bytes(dense_dir),
        bytes_shrunk=dir_bytes(small_dir),
        ms_dense=ms["dense"],
        ms_shrunk=ms["shrunk"],
        speedup=ms["dense"] / ms["shrunk"],
        export=str(small_dir),
    )
    png = out / "demo_training.png"
    plot(png, history, dense_history, pruning)
    report(r, args, x, units, n_rep=n_rep, windows=len(val_loader.dataset))
    print(f"plot: {png.resolve()}")
    r["plot"] = str(png)
    return r


def report(r: dict[str, Any], args, x: torch.Tensor, units: dict[str, int], n_rep: int, windows: int) -> None:
    print(f"\n{'':<30}{'dense':>12}{'shrunk':>12}{'ratio':>9}")
    print(
        f"{'parameters':<30}{r['params_dense']:>12,}{r['params_shrunk']:>12,}"
        f"{r['params_dense'] / r['params_shrunk']:>8.2f}x"
    )
    kib_d, kib_s = r["bytes_dense"] / 1024, r["bytes_shrunk"] / 1024
    print(f"{'saved size (KiB)':<30}{kib_d:>12,.0f}{kib_s:>12,.0f}{kib_d / kib_s:>8.2f}x")
    label = f"forward ms, batch {tuple(x.shape)}"
    print(f"{label:<30}{r['ms_dense']:>12.2f}{r['ms_shrunk']:>12.2f}{r['speedup']:>8.2f}x")
    print(f"\nvalidation loss (nats/byte, {windows} held-out windows of {x.shape[1]} bytes):")
    if "val_loss_dense" in r:
        print(f"  {f'dense, {args.max_steps} steps without pruning':<44}{r['val_loss_dense']:.3f}")
    print(f"  {'pruned, same steps (dropped units zero)':<44}{r['val_loss_pruned']:.3f}")
    print(f"  {'shrunk (the pruned model, zeros cut out)':<44}{r['val_loss_shrunk']:.3f}")
    print(
        f"  shrunk vs pruned logits: max |diff| {r['max_abs_diff']:.1e}; export reloaded {r['reload_max_abs_diff']:.1e}"
    )
    print("\nkept units per layer:")
    kept = r["kept"]
    for layer in sorted({int(name.split(".")[1]) for name in kept}):
        mlp, heads = f"mlp.{layer}", f"heads.{layer}"
        print(
            f"  layer {layer}: MLP channels {kept[mlp]:>4}/{units[mlp]:<5}"
            f"KV groups {kept[heads]}/{units[heads]}  (query heads {kept[heads] * n_rep}/{units[heads] * n_rep})"
        )
    print(f"\nshrunk model saved to {r['export']} (lightning_pat.load_pretrained loads it)")


if __name__ == "__main__":
    main()
