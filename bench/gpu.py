"""One prepared GPU run: training-step cost of the callback, peak memory, and the shrunk model's speed.

    python bench/gpu.py                 # CUDA: Llama-style ~1.1B params, bf16, about 3-4 minutes on one H200
    python bench/gpu.py --tiny          # CPU (or GPU): a few-M-param model and a few steps, to check the script
    OUT=/some/dir python bench/gpu.py   # also writes $OUT/gpu_bench.json

The model is ``transformers.LlamaForCausalLM`` built from a config with random weights (nothing is downloaded):
hidden 2048, MLP 8192, 16 layers, 32 query / 8 KV heads, vocab 32000 (~1.1B parameters), trained in
``bf16-true`` with AdamW by a Lightning ``Trainer`` on random tokens. Variants, each on a freshly built model:

* ``dense``: no callback.
* ``direct`` / ``latent``, fresh selection every step / every 10 steps (the ramp never ends within the run, so
  every step is a ramp step: a fresh selection when due, the mask held in between; latent mode also swaps and
  commits its copies every step). Clusters: the ``llama`` preset, MLP + heads, target 50%.

Per variant: median step time (forward, backward, optimizer and callback; CUDA synchronised at step boundaries),
time inside the callback's per-step hooks (synchronised before and after each hook, so the share is the GPU work
the callback adds), its share of the step, and peak memory (``torch.cuda.max_memory_allocated``). Then the
dense model and the same model pruned to 50% MLP + heads and physically shrunk (``lightning_pat.shrink``) are
timed in inference: tokens per second of a forward pass. Goal (issue 11): callback share under 1% of the step at
every-10-steps pruning and under 3% at every step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pat import CoupledPruningCallback, prune_clusters, shrink  # noqa: E402
from lightning_pat import presets as P  # noqa: E402

FULL = {"hidden": 2048, "inter": 8192, "layers": 16, "heads": 32, "kv": 8, "vocab": 32000, "batch": 4, "seq": 1024}
TINY = {"hidden": 64, "inter": 256, "layers": 2, "heads": 4, "kv": 2, "vocab": 256, "batch": 2, "seq": 32}


def llama(size: dict, *, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["inter"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"],
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(cfg)
    return model.to(dtype)


class LM(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer(pl.Callback):
    """Step wall times (synchronised) and the time spent in the pruning callback's hooks per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[float] = []
        self.hooks: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(self.device)
        self._t0 = time.perf_counter()
        self.hooks.append(0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync(self.device)
        self.steps.append(time.perf_counter() - self._t0)

    def wrap(self, cb: pl.Callback) -> None:
        for hook in ("on_before_optimizer_step", "on_train_batch_end"):
            inner = getattr(cb, hook)

            def timed(*args, _inner=inner, **kwargs):
                _sync(self.device)
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    _sync(self.device)
                    self.hooks[-1] += time.perf_counter() - t0

            setattr(cb, hook, timed)


def train(variant: str, size: dict, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    model = llama(size, device=device, dtype=dtype)
    module = LM(model)
    timer = StepTimer(device)
    callbacks: list[pl.Callback] = []
    if variant != "dense":
        mode, every = variant.split("/")
        cb = CoupledPruningCallback(
            "llama",
            0.5,
            warmup_steps=0,
            ramp_steps=10**6,
            every_n_steps=int(every),
            mode=mode,
            preset_options={"mlp": True, "heads": True},
            log_metrics=False,
        )
        timer.wrap(cb)
        callbacks.append(cb)
    # the timer's batch-end hook must run after the pruning callback's
    gen = torch.Generator().manual_seed(0)
    steps = args.warmup + args.steps
    data = torch.randint(0, size["vocab"], (steps * size["batch"], size["seq"]), generator=gen)
    loader = torch.utils.data.DataLoader(data, batch_size=size["batch"])
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=device.type,
        devices=1,
        precision="bf16-true" if dtype == torch.bfloat16 else "32-true",
        callbacks=[*callbacks, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    gc.collect()  # the previous variant's Trainer holds reference cycles to its model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, loader)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    step_ms = statistics.median(timer.steps[args.warmup :]) * 1e3
    hook_ms = statistics.median(timer.hooks[args.warmup :]) * 1e3 if callbacks else 0.0
    mean_hook_ms = statistics.fmean(timer.hooks[args.warmup :]) * 1e3 if callbacks else 0.0
    del trainer, module, model
    return {"step_ms": step_ms, "hook_ms": hook_ms, "mean_hook_ms": mean_hook_ms, "peak_bytes": peak}


@torch.no_grad()
def tokens_per_s(model: torch.nn.Module, size: dict, device: torch.device, *, reps: int) -> float:
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    model.eval()
    model(input_ids=batch)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        model(input_ids=batch)
    _sync(device)
    return reps * batch.numel() / (time.perf_counter() - t0)


def shrunk_speed(size: dict, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    model = llama(size, device=device, dtype=dtype)
    dense = tokens_per_s(model, size, device, reps=args.infer_reps)
    params_dense = sum(p.numel() for p in model.parameters())
    result = prune_clusters(model, P.llama(model, mlp=True, heads=True), 0.5)
    small = shrink(model, result)
    shrunk = tokens_per_s(small, size, device, reps=args.infer_reps)
    return {
        "dense_tokens_per_s": dense,
        "shrunk_tokens_per_s": shrunk,
        "speedup": shrunk / dense,
        "params_dense": params_dense,
        "params_shrunk": sum(p.numel() for p in small.parameters()),
    }


VARIANTS = ("dense", "direct/1", "direct/10", "latent/1", "latent/10")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few-M-param model and a few steps (CPU check)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 30; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps per variant (default 5; tiny 1)")
    parser.add_argument("--infer_reps", type=int, default=None, help="timed forward passes (default 20; tiny 1)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_bench.json (default $OUT)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 30)
    args.warmup = args.warmup or (1 if args.tiny else 5)
    args.infer_reps = args.infer_reps or (1 if args.tiny else 20)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = TINY if args.tiny else FULL
    dtype = torch.bfloat16
    t_start = time.perf_counter()
    rows = {v: train(v, size, args, device, dtype) for v in VARIANTS}
    speed = shrunk_speed(size, args, device, dtype)
    n_params = sum(p.numel() for p in llama(size, device=torch.device("meta"), dtype=dtype).parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dense = rows["dense"]
    print(
        f"\nLlamaForCausalLM (random init) {n_params / 1e6:.1f}M params, hidden {size['hidden']}, MLP {size['inter']}, "
        f"{size['layers']} layers, {size['heads']} q / {size['kv']} kv heads, vocab {size['vocab']}, batch "
        f"{size['batch']}x{size['seq']}, bf16-true, AdamW, {device} ({name}), median of {args.steps} steps"
    )
    print(
        "| variant | ms/step | vs dense | callback ms/step (median, mean) | callback share | peak memory | vs dense |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v, r in rows.items():
        share = 100 * r["mean_hook_ms"] / r["step_ms"]
        peak = "n/a (CPU)" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        peak_ratio = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / dense['peak_bytes']:.3f}x"
        hooks = "n/a" if v == "dense" else f"{r['hook_ms']:.2f}, {r['mean_hook_ms']:.2f}"
        print(
            f"| {v} | {r['step_ms']:.1f} | {r['step_ms'] / dense['step_ms']:.3f}x | {hooks} | "
            f"{'n/a' if v == 'dense' else f'{share:.2f}%'} | {peak} | {peak_ratio} |"
        )
    print(
        f"\nInference, batch {size['batch']}x{size['seq']}: dense {speed['dense_tokens_per_s']:.0f} tokens/s, shrunk "
        f"(50% MLP + heads, {speed['params_shrunk'] / 1e6:.1f}M of {speed['params_dense'] / 1e6:.1f}M params) "
        f"{speed['shrunk_tokens_per_s']:.0f} tokens/s = {speed['speedup']:.2f}x"
    )
    total = time.perf_counter() - t_start
    print(f"total {total:.0f} s")
    out = {
        "device": name,
        "params": n_params,
        "size": size,
        "steps": args.steps,
        "variants": rows,
        "inference": speed,
        "seconds": total,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gpu_bench.json").write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
