"""Healing small under FSDP2: the training step before the freeze, after ``shrink_sharded``, and the masked full size.

    python bench/bench_sharded_heal.py                  # SmolLM2-135M's shape (30 layers), world 2, CPU gloo
    python bench/bench_sharded_heal.py --layers 8       # quicker
    python bench/bench_sharded_heal.py --whole-run --layers 4   # a whole `lightning-pat fit`, with and without

A Llama with SmolLM2-135M's shapes (hidden 576, MLP 1536, 9 query heads in 3 GQA groups of head_dim 64, vocabulary
49152, tied embedding; random weights: only the costs are measured) is sharded as ``CausalLM`` shards it (FSDP2 on
every decoder layer, then the root) over ``--world`` gloo ranks and trained with AdamW on random tokens. The mask
keeps about 50% of the parameters: 2 of 3 query groups and 640 of 1536 MLP channels in every layer, 480 of 576
residual channels (the dropped units are zero in the weights, as the callback leaves them at the freeze).

Two copies of the model live in every rank, trained on the same tokens (the table shows the worst rank):

* **before the freeze**: the step at full size (the second copy, before its shrink);
* **shrink_sharded**: one call of :func:`lightning_pat.training.sharded_shrink.shrink_sharded` on the second copy
  (the cut, packed all-gathers per ``fully_shard`` group, the optimizer state sliced);
* **healing at full size (masked)**: the first copy's step, the mask in its weights: what healing costs without
  ``shrink_on_freeze`` (the callback's zeroing of the dropped gradients comes on top);
* **healing small**: the second copy's step after its shrink. The two healing steps are interleaved, one of each in
  turn, so that both see the same load on the machine.

Step time: median of ``--steps`` steps after one warm-up, slowest rank. Memory: the bytes this rank holds for the
parameters, their gradients and the AdamW state (local shards, exact), and the rise of the resident set's
high-water mark over a step (``VmHWM``, reset through ``/proc/self/clear_refs``; glibc's mmap threshold at 64 KiB so
that freed tensors return to the OS): activations and the gathered groups.

``--whole-run``: the whole recipe through the front door instead, twice in one invocation, one after the other:
``lightning-pat fit`` of a ``CausalLM`` (SmolLM2-135M-Instruct's real weights and tokenizer, its first ``--layers``
decoder layers: ``CausalLM(num_layers=...)``) under ``ModelParallelStrategy`` (FSDP2 over ``--world`` ranks), the
callback at ``target_params: 0.5`` with ``--warmup``/``--ramp`` steps and ``--heal`` healing steps after the freeze,
once with ``shrink_on_freeze: false`` (the masked full-size model heals) and once with ``true``. Printed: each fit's
process wall time (start to exit: imports, load, sharding, the steps), its training loop, the median step before the
freeze and during healing (global rank 0's clock; every step synchronizes the ranks), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sharded import reset_peak, rss_kib  # noqa: E402  (bench/bench_sharded.py: the same memory probes)

SHAPE = {"hidden": 576, "mlp": 1536, "heads": 9, "kv": 3, "head_dim": 64, "vocab": 49152}
TINY = {"hidden": 96, "mlp": 128, "heads": 6, "kv": 3, "head_dim": 16, "vocab": 256}  # --tiny: the smoke test's
KEEP = {"groups": 2 / 3, "mlp": 640 / 1536, "residual": 480 / 576}  # kept fractions of each cluster's units


def _spread(total: int, keep: int) -> list[int]:
    """``total - keep`` dropped indices spread evenly over ``range(total)``."""
    kept = {round(i * (total - 1) / max(keep - 1, 1)) for i in range(keep)}
    return [i for i in range(total) if i not in kept]


def _model(layers: int, shape: dict[str, int]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
        num_hidden_layers=layers, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"], tie_word_embeddings=True, max_position_embeddings=2048,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size() * (2 if p.grad is not None else 1)
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                v = value.to_local() if hasattr(value, "to_local") else value
                total += v.numel() * v.element_size()
    return total


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> tuple[float, int]:
    """One training step: its wall time and the rise of the resident set's high-water mark over the step."""
    dist.barrier()
    reset_peak()
    before = rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients stay allocated between steps
    return time.perf_counter() - start, rss_kib("VmHWM") * 1024 - before


def _median(samples: list[tuple[float, int]]) -> tuple[float, int]:
    return statistics.median(t for t, _ in samples), max(m for _, m in samples)


def worker(rank: int, world: int, store_path: str, layers: int, steps: int, seq: int, tiny: bool, queue) -> None:  # noqa: ANN001
    import copy

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_pat import presets, resolve_clusters
    from lightning_pat.lm.sharding import shard_causal_lm
    from lightning_pat.shrink.plan import build_plan
    from lightning_pat.training.sharded_shrink import shrink_sharded

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    shape = TINY if tiny else SHAPE
    masked = _model(layers, shape)
    clusters = resolve_clusters(masked, presets.llama(masked, residual=True, query_heads=False))
    dropped = {}
    for rc in clusters:
        kind = "groups" if rc.name.startswith("heads") else "mlp" if rc.name.startswith("mlp") else "residual"
        dropped[rc.name] = _spread(rc.num_units, round(KEEP[kind] * rc.num_units))
    plan = build_plan(clusters, dropped)
    with torch.no_grad():  # the mask in the weights, as the callback leaves them at the freeze
        params = dict(masked.named_parameters())
        for name, dims in plan.keep.items():
            for dim, kept in dims.items():
                mask = torch.ones(params[name].shape[dim], dtype=torch.bool)
                mask[kept] = False
                params[name].index_fill_(dim, mask.nonzero().squeeze(1), 0.0)
    numel_full = sum(p.numel() for p in masked.parameters())
    healed = copy.deepcopy(masked)  # the run with shrink_on_freeze; `masked` heals at full size
    for model in (masked, healed):
        shard_causal_lm(model, mesh)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (masked, healed)}
    ids = torch.randint(0, shape["vocab"], (1, seq), generator=torch.Generator().manual_seed(0))
    for model in (masked, healed):  # warm-up: FSDP2's lazy init, AdamW's state
        _step(model, opts[id(model)], ids)
    before = _median([_step(healed, opts[id(healed)], ids) for _ in range(steps)])
    opts[id(healed)].zero_grad(set_to_none=True)  # the freeze comes after a real step; shrink_sharded drops them
    rss_before = rss_kib("VmRSS") * 1024
    dist.barrier()
    reset_peak()
    start = time.perf_counter()
    shrink_sharded(healed, clusters, dropped, optimizers=[opts[id(healed)]])
    reshard = (time.perf_counter() - start, rss_kib("VmHWM") * 1024 - rss_before)
    _step(healed, opts[id(healed)], ids)  # warm-up of the new FSDP2 state
    full, small = [], []
    for _ in range(steps):  # interleaved, so that both see the same load on the machine
        full.append(_step(masked, opts[id(masked)], ids))
        small.append(_step(healed, opts[id(healed)], ids))
    rows = {
        "before the freeze": (*before, _held_bytes(masked, opts[id(masked)])),
        "healing at full size (masked)": (*_median(full), _held_bytes(masked, opts[id(masked)])),
        "healing small (after shrink_sharded)": (*_median(small), _held_bytes(healed, opts[id(healed)])),
    }
    numel_small = sum(p.numel() for p in healed.parameters())
    queue.put((rank, rows, reshard, numel_full, numel_small))
    dist.destroy_process_group()


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def table(results: list, world: int, layers: int, seq: int) -> str:
    keys = list(results[0][1])
    worst = {k: [max(r[1][k][i] for r in results) for i in range(3)] for k in keys}
    numel_full, numel_small = results[0][3], results[0][4]
    lines = [
        f"world {world} (gloo, 1 thread per rank), {layers} layers, 1 x {seq} tokens, AdamW; parameters "
        f"{numel_full / 1e6:.1f}M -> {numel_small / 1e6:.1f}M ({numel_small / numel_full:.0%})",
        "",
        "| | step time (median, slowest rank) | params + grads + AdamW held per rank | peak rise during a step |",
        "|---|---|---|---|",
    ]
    for k in keys:
        time_s, rise, held = worst[k]
        lines.append(f"| {k} | {time_s:.2f} s | {_mb(held)} | {_mb(rise)} |")
    full, small = worst[keys[1]], worst[keys[2]]
    lines.append(
        f"| ratio masked / small | {full[0] / small[0]:.2f}x | {full[2] / small[2]:.2f}x | {full[1] / small[1]:.2f}x |"
    )
    reshard = max(r[2][0] for r in results)
    rise = max(r[2][1] for r in results)
    lines += ["", f"shrink_sharded itself (slowest rank): {reshard:.2f} s, resident set rose by at most {_mb(rise)}"]
    return "\n".join(lines)


class StepClock(pl.Callback):
    """Times every training step on global rank 0; writes ``{"steps": [...], "train_s": ...}`` to ``path`` at the end
    of training (``--whole-run``: a callback of the fitted config)."""

    def __init__(self, path: str) -> None:
        self.path, self.steps = path, []
        self.start = self.train_start = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # noqa: D102
        self.train_start = time.perf_counter()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:  # noqa: D102
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:  # noqa: D102
        self.steps.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # noqa: D102
        if trainer.is_global_zero:
            train_s = time.perf_counter() - self.train_start
            Path(self.path).write_text(json.dumps({"steps": self.steps, "train_s": train_s}))


RUN_CONFIG = """seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: {steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_pat.CoupledPruningCallback
      init_args: {{clusters: llama, preset_options: {{residual: true}}, target_params: 0.5, warmup_steps: {warmup},
        ramp_steps: {ramp}, shrink_on_freeze: {shrink}}}
    - class_path: bench_sharded_heal.StepClock
      init_args: {{path: {clock}}}
model:
  class_path: lightning_pat.lm.CausalLM
  init_args: {{pretrained: smollm2, num_layers: {layers}, lr: 1.0e-4}}
data:
  class_path: lightning_pat.lm.TextFiles
  init_args: {{batch_size: 2, seq_len: {seq}, english: false, val_windows: 2}}
"""


def whole_runs(args: argparse.Namespace) -> str:
    """The recipe fitted without and with ``shrink_on_freeze`` (``--whole-run``); the table."""
    import subprocess

    bench = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([bench, os.environ.get("PYTHONPATH", "")]),
    }
    script = Path(sys.executable).parent / "lightning-pat"
    flags = [
        f"--trainer.devices={args.world}", "--trainer.strategy=ModelParallelStrategy",
        f"--trainer.strategy.data_parallel_size={args.world}", "--trainer.strategy.tensor_parallel_size=1",
    ]  # fmt: skip
    steps = args.warmup + args.ramp + args.heal
    freeze = args.warmup + args.ramp
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, shrink in enumerate(args.order):
            clock = Path(tmp) / f"clock-{i}.json"
            config = Path(tmp) / f"run-{i}.yaml"
            config.write_text(RUN_CONFIG.format(steps=steps, warmup=args.warmup, ramp=args.ramp, layers=args.layers,
                                                seq=args.seq, shrink=str(shrink).lower(), clock=clock))  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run([str(script), "fit", "--config", str(config), *flags], env=env, cwd=tmp,
                                  capture_output=True, text=True, check=False)  # fmt: skip
            wall = time.perf_counter() - start
            if done.returncode != 0:
                raise SystemExit(f"lightning-pat fit (shrink_on_freeze={shrink}) failed:\n{done.stderr[-4000:]}")
            record = json.loads(clock.read_text())
            before, healing = record["steps"][:freeze], record["steps"][freeze:]
            rows.setdefault(shrink, []).append(
                (
                    wall,
                    record["train_s"],
                    statistics.median(before),
                    statistics.median(healing),
                    sum(healing),
                )
            )
    lines = [
        f"lightning-pat fit, FSDP2 world {args.world} (gloo, CPU), SmolLM2-135M-Instruct's first {args.layers} layers, "
        f"llama preset with residual, target_params 0.5, {args.warmup} warmup + {args.ramp} ramp + {args.heal} "
        f"healing steps of 2 x {args.seq} "
        "tokens",
        "",
        "| shrink_on_freeze | whole fit (process) | training loop | step before the freeze (median) | "
        "healing step (median) | healing steps (sum) |",
        "|---|---|---|---|---|---|",
    ]
    means = {}
    for shrink, runs in rows.items():
        means[shrink] = [statistics.mean(column) for column in zip(*runs, strict=True)]
        for wall, train, before, heal, heal_sum in runs:
            lines.append(f"| {str(shrink).lower()} | {wall:.1f} s | {train:.1f} s | {before:.2f} s | {heal:.2f} s | "
                         f"{heal_sum:.1f} s |")  # fmt: skip
    off, on = means[False], means[True]
    lines.append(
        "| ratio false / true (means) | " + " | ".join(f"{a / b:.2f}x" for a, b in zip(off, on, strict=True)) + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (the smoke test)")
    parser.add_argument("--whole-run", action="store_true", help="two whole `lightning-pat fit` runs (see above)")
    parser.add_argument("--warmup", type=int, default=2, help="--whole-run: the callback's warmup_steps")
    parser.add_argument("--ramp", type=int, default=4, help="--whole-run: the callback's ramp_steps")
    parser.add_argument("--heal", type=int, default=14, help="--whole-run: steps after the freeze")
    parser.add_argument(
        "--order", type=lambda text: [v.strip() == "true" for v in text.split(",")], default=[False, True],
        help="--whole-run: the runs' shrink_on_freeze in order (default false,true; false,true,false brackets a "
        "load that drifts)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.whole_run:
        sys.stdout.write(whole_runs(args) + "\n")
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the workers: freed tensors return to the OS
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=worker, args=(r, args.world, store, args.layers, args.steps, args.seq, args.tiny, queue))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        results = []
        while len(results) < args.world:
            try:
                results.append(queue.get(timeout=5))
            except Exception:  # noqa: BLE001 - queue.Empty: check the workers are alive
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    raise SystemExit("a benchmark worker failed (see its traceback above)") from None
        for p in procs:
            p.join(60)
    sys.stdout.write(table(sorted(results, key=lambda r: r[0]), args.world, args.layers, args.seq) + "\n")


if __name__ == "__main__":
    main()
