"""Expert scores for a one-shot cut of whole routed experts: REAP vs router frequency vs weight norm vs random.

    python bench/bench_expert_scores.py --seeds 0,1,2,3,4   # 5 seeds, a fresh process each (~7 min of one core's time)
    python bench/bench_expert_scores.py --aux 0 --out bench/results/expert_scores_aux0.jsonl   # no balancing loss
    python bench/bench_expert_scores.py --quick           # seconds: 1 seed, a few steps, a tinier model
    python bench/bench_expert_scores.py --table bench/results/expert_scores.jsonl   # the table of stored rows

No real mixture-of-experts checkpoint installs here, so a small Mixtral (``transformers.MixtralForCausalLM``: hidden
96, 3 layers, 4 heads / 2 KV heads, 8 experts of width 128, top-2, byte vocabulary of 256) is trained from scratch on
the bytes of the Python standard library's top-level ``*.py`` files (AdamW 3e-3, warmup then cosine, batch 16 x 128,
500 steps, Mixtral's load-balancing loss with coefficient 0.01). The files are split by file
(:func:`lightning_pat.lm.data.split_by_file`, twice): held-out (every 10th file), calibration (every 10th of the rest)
and training (the others).

Per seed, in a fresh process: train, save the dense model (``save_pretrained``: safetensors) to a temporary
directory, then for each score reload the dense model from there and cut half of the experts of every layer at once
(whole experts: ``presets.moe(model, mlp=False, heads=False)``, every layer keeps 4 of 8; no healing), ``shrink`` it
(the shrunk logits are compared with the masked model's: rel < 1e-4) and measure the held-out loss (mean token
cross-entropy, nats per byte, over 128 fixed windows of 128 predicted bytes) of the shrunk model. Scores, all ranked
on the same calibration batches (8 batches of 4 x 128 bytes of the calibration files) where they read data:

* ``reap``: REAP's router-weighted expert output norm, the mean over the expert's tokens
  (:func:`lightning_pat.scoring.experts.expert_scores`, ``kind="reap"``), through the front door:
  ``prune_clusters(model, clusters, 0.5, calibration=batches, expert_score="reap")``;
* ``frequency``: how many calibration tokens the router sends to the expert (``expert_score="frequency"``);
* ``reap_sum``: REAP's sum instead of its mean over the expert's tokens, i.e. ``reap * frequency``: the
  router-weighted output norm the expert contributes over all calibration tokens (an expert that many tokens use
  counts for more; ``expert_score="reap_sum"``, the library's default since the 5-seed run; the rows of seeds 0 to 2
  were written when it was a bench-side product ``reap * frequency``, which ranks the same);
* ``weight``: the expert's weight norm (its gate/up and down slices and its router row; ``prune_clusters(...,
  score="l2")``; every expert has the same size, so ``"rms"`` ranks the same);
* ``random``: a seeded random ranking per layer (``Pruner.step(scores=...)``), the floor.

The table gives each score's loss per seed, the mean, the paired difference to REAP (mean, min and max over seeds:
negative is better than REAP) and the ratio to the dense loss. Rows (one per seed and score, and the dense model)
are written to ``bench/results/expert_scores.jsonl`` (``--out``; the quick run writes to a temporary file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCORES = ("reap", "frequency", "reap_sum", "weight", "random")
RESULTS = Path(__file__).resolve().parent / "results" / "expert_scores.jsonl"
#: The options a worker process gets from the driver.
CONFIG = (
    "steps", "hidden", "layers", "width", "experts", "top_k", "aux", "lr", "batch", "seq", "calib_batches",
    "eval_windows", "threads",
)  # fmt: skip
HEADER = "| score | loss per seed | mean | vs REAP: mean (min, max) | / dense |"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 6 steps, a tinier model (seconds; fixes the sizes)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux", type=float, default=0.01, help="coefficient of Mixtral's load-balancing loss")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches of 4 windows")
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help=f"the rows (default {RESULTS}; --quick: a temporary file)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # worker: this seed, rows to --out
    p.add_argument("--table", type=Path, default=None, help="print the table of stored rows and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds if args.seeds != "0,1,2" else "0"
        args.steps, args.hidden, args.layers, args.width = min(args.steps, 6), 32, 2, 32
        args.batch, args.seq, args.calib_batches, args.eval_windows = 4, 32, 2, 8
    return args


# ------------------------------------------------------------------------------------------------------- data
def data(args: argparse.Namespace) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The training bytes, the calibration batches (inputs ``[4, seq]``) and the held-out windows ``[N, seq + 1]``."""
    from lightning_pat.lm.data import Windows, eval_starts, split_by_file, stdlib_files

    rest, held = split_by_file(stdlib_files())
    train, calib = split_by_file(rest)

    def as_bytes(files: list[Path]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"\n".join(p.read_bytes() for p in files)), dtype=torch.uint8).long()

    train_t, calib_t, held_t = as_bytes(train), as_bytes(calib), as_bytes(held)
    n_calib = 4 * args.calib_batches
    calib_w = Windows(calib_t, eval_starts(calib_t, num_windows=n_calib, seq_len=args.seq), args.seq).stacked()
    val = Windows(held_t, eval_starts(held_t, num_windows=args.eval_windows, seq_len=args.seq), args.seq).stacked()
    return train_t, [b[:, :-1].contiguous() for b in calib_w.split(4)], val


# ------------------------------------------------------------------------------------------------------ model
def build(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=args.seq + 8, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=args.aux,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def train(model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace, seed: int) -> list[float]:
    """AdamW, linear warmup then cosine to 10%, random windows drawn with a generator seeded by ``seed``."""
    from lightning_pat.lm.data import random_starts

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    starts = random_starts(tokens, num_windows=args.steps * args.batch, seq_len=args.seq, seed=seed)
    offsets = torch.arange(args.seq + 1)
    losses = []
    model.train()
    for step in range(args.steps):
        w = tokens[starts[step * args.batch : (step + 1) * args.batch, None] + offsets]
        out = model(input_ids=w[:, :-1], labels=w[:, :-1])  # the model shifts the labels (loss + aux * balance)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        if (step + 1) % 100 == 0:
            print(f"    step {step + 1}: loss {sum(losses[-100:]) / 100:.4f}", file=sys.stderr, flush=True)
    return losses


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, val: torch.Tensor, batch: int = 16) -> float:
    """Mean token cross-entropy (nats per byte) over the held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for w in val.split(batch):
        logits = model(input_ids=w[:, :-1]).logits
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    return total / count


# -------------------------------------------------------------------------------------------------------- cut
def cut(model: torch.nn.Module, score: str, calib: list[torch.Tensor], seed: int):
    """Half the experts of every layer, by ``score`` (see the module docs): the ``PruneResult``."""
    import lightning_pat as lp

    decls = lp.presets.moe(model, mlp=False, heads=False)
    if score in ("reap", "reap_sum", "frequency"):  # the library's expert scores, through the front door
        return lp.prune_clusters(model, decls, 0.5, calibration=calib, expert_score=score)
    if score == "weight":
        return lp.prune_clusters(model, decls, 0.5, score="l2")
    clusters = lp.resolve_clusters(model, decls)
    if score == "random":
        gen = torch.Generator().manual_seed(1_000 + seed)
        scores = {rc.name: torch.rand(rc.num_units, generator=gen, dtype=torch.float64) for rc in clusters}
    else:
        raise ValueError(f"--scores: expected one of {SCORES}, got {score!r}.")
    return lp.Pruner(model, clusters, score="l2").step({rc.name: 0.5 for rc in clusters}, scores=scores, count=True)


def router_load(model: torch.nn.Module, calib: list[torch.Tensor]) -> list[list[float]]:
    """Per layer, the share of the calibration tokens' top-k slots that each expert receives."""
    import lightning_pat as lp
    from lightning_pat.scoring.experts import expert_scores

    clusters = lp.resolve_clusters(model, lp.presets.moe(model, mlp=False, heads=False))
    counts = expert_scores(model, clusters, calib, kind="frequency")
    return [(c / c.sum()).tolist() for _, c in sorted(counts.items(), key=lambda kv: int(kv[0].split(".")[1]))]


def one_seed(args: argparse.Namespace, seed: int) -> list[dict]:
    """Train one dense model, save it, and cut a fresh reload of it by every score (this process: one seed)."""
    from transformers.utils import logging as hf_logging

    import lightning_pat as lp
    from lightning_pat.scoring.experts import expert_scores

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    train_t, calib, val = data(args)
    model = build(args, seed)
    t0 = time.perf_counter()
    losses = train(model, train_t, args, seed)
    train_s = time.perf_counter() - t0
    model.config.output_router_logits = False  # the saved model is an inference model
    common = {
        "bench": "expert_scores", "seed": seed, "quick": args.quick, "steps": args.steps, "hidden": args.hidden,
        "layers": args.layers, "width": args.width, "experts": args.experts, "top_k": args.top_k, "aux": args.aux,
        "calib_tokens": sum(b.numel() for b in calib), "eval_tokens": int(val[:, 1:].numel()),
        "params": sum(p.numel() for p in model.parameters()), "train_loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "train_s": round(train_s, 1), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus", "commit": commit(),
    }  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = lp.save_pretrained(model, Path(tmp) / "dense", tokenizer=None)  # safetensors, no pickle
        del model
        dense = reload(saved)
        dense_loss = held_out_loss(dense, val)
        load = router_load(dense, calib)
        reap = expert_scores(dense, lp.resolve_clusters(dense, lp.presets.moe(dense, mlp=False, heads=False)), calib)
        rows.append({**common, "score": "dense", "loss": dense_loss, "router_load": load})
        print(f"  seed {seed}: dense {dense_loss:.4f} (trained {train_s:.0f} s)", file=sys.stderr, flush=True)
        for score in SCORES:
            t0 = time.perf_counter()
            model = reload(saved)  # every score starts from the saved weights
            result = cut(model, score, calib, seed)
            dropped = {name: sorted(int(u) for u in units) for name, units in sorted(result.dropped.items())}
            if score == "reap":  # the front door dropped the lowest REAP scores of every layer
                want = {n: sorted(torch.argsort(s, stable=True)[: len(dropped[n])].tolist()) for n, s in reap.items()}
                assert want == dropped, (want, dropped)
            with torch.no_grad():
                masked = model(input_ids=val[:4, :-1]).logits
            small = lp.shrink(model, result, example_input=calib[0])  # checks itself on a calibration batch too
            with torch.no_grad():
                rel = float((small(input_ids=val[:4, :-1]).logits - masked).norm() / masked.norm())
            assert rel < 1e-4, f"{score}: shrunk logits differ from the masked model's, rel {rel:.2e}"
            kept = small.config.num_local_experts
            assert kept == args.experts - args.experts // 2, kept
            loss = held_out_loss(small, val)
            rows.append({
                **common, "score": score, "loss": loss, "dense_loss": dense_loss, "rel_shrunk": rel,
                "experts_kept": kept, "params_cut": sum(p.numel() for p in small.parameters()), "dropped": dropped,
                "cut_s": round(time.perf_counter() - t0, 2),
            })  # fmt: skip
            print(f"  seed {seed}: {score} {loss:.4f} (rel {rel:.1e})", file=sys.stderr, flush=True)
    return rows


def reload(path: Path) -> torch.nn.Module:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------------------ table
def table(rows: list[dict]) -> list[str]:
    """The side-by-side table (every score, the losers included) and one line on the dense model."""
    seeds = sorted({r["seed"] for r in rows})
    loss = {(r["score"], r["seed"]): r["loss"] for r in rows}
    dense = [loss[("dense", s)] for s in seeds if ("dense", s) in loss]
    lines = [HEADER, "| --- | --- | ---: | --- | ---: |"]
    for score in ("dense", *SCORES):
        per = [loss.get((score, s)) for s in seeds]
        got = [v for v in per if v is not None]
        if not got:
            continue
        mean = sum(got) / len(got)
        cells = " / ".join("-" if v is None else f"{v:.4f}" for v in per)
        diffs = [loss[(score, s)] - loss[("reap", s)] for s in seeds if (score, s) in loss and ("reap", s) in loss]
        vs = "" if score in ("reap", "dense") or not diffs else (
            f"{sum(diffs) / len(diffs):+.4f} ({min(diffs):+.4f}, {max(diffs):+.4f})"
        )  # fmt: skip
        ratio = mean / (sum(dense) / len(dense)) if dense else float("nan")
        lines.append(f"| {score} | {cells} | {mean:.4f} | {vs} | {ratio:.3f} |")
    return lines


def overlap(rows: list[dict]) -> list[str]:
    """How many dropped experts each score shares with REAP's (over all layers and seeds), and the router's load."""
    by = {(r["score"], r["seed"]): r for r in rows}
    out = []
    for score in SCORES[1:]:
        same = total = 0
        for (s, seed), r in by.items():
            if s != score or ("reap", seed) not in by:
                continue
            for name, units in r["dropped"].items():
                same += len(set(units) & set(by[("reap", seed)]["dropped"][name]))
                total += len(units)
        if total:
            out.append(f"{score}: {same}/{total} dropped experts shared with REAP")
    layers = [layer for r in rows if r["score"] == "dense" for layer in r["router_load"]]
    if layers:
        idle = sum(share == 0 for layer in layers for share in layer)
        busiest = [max(layer) for layer in layers]
        out.append(
            f"dense router on the calibration tokens: busiest expert per layer {min(busiest):.1%} to "
            f"{max(busiest):.1%} of the top-k slots (even: {1 / len(layers[0]):.1%}); {idle} of "
            f"{sum(len(layer) for layer in layers)} experts (all layers and seeds) receive no token"
        )
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.table is not None:
        rows = read(args.table)
        print("\n".join(table(rows) + [""] + overlap(rows)))
        return
    if args.one is not None:  # worker
        rows = one_seed(args, args.one)
        with args.out.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        return
    tmp = None
    if args.out is None:
        if args.quick:
            tmp = tempfile.TemporaryDirectory()
            args.out = Path(tmp.name) / "expert_scores.jsonl"
        else:
            args.out = RESULTS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    t0 = time.perf_counter()
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in sorted(vars(args).items()) if k in CONFIG]
    forwarded += ["--quick"] if args.quick else []
    for seed in [int(s) for s in args.seeds.split(",")]:  # a fresh process per seed: no state carries over
        cmd = [sys.executable, __file__, *forwarded, "--one", str(seed), "--out", str(args.out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    rows = read(args.out)
    print(f"{len(rows)} rows in {args.out} ({time.perf_counter() - t0:.0f} s)")
    print("\n".join(table(rows) + [""] + overlap(rows)))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
