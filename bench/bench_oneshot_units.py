"""One-shot pruning of SmolLM2-135M: which units, which score, which size allocation (the evidence for the defaults).

    python bench/bench_oneshot_units.py                        # SmolLM2, sizes 75% and 50%, every arm (~30-60 min)
    python bench/bench_oneshot_units.py --sizes 0.75 --units qh --scores activation
    python bench/bench_oneshot_units.py --quick                # seconds: a tiny random Llama, byte tokens

Every arm cuts the same dense model once (no healing) with ``prune_clusters(..., target_params=size)`` on the llama
preset (MLP channels and attention) and ``shrink``s it; the table gives the held-out loss (64 fixed windows of 128
predicted tokens of the held-out standard-library files, split by file as :class:`lightning_pat.lm.TextFiles` does;
dense ~2.35 nats/token), the parameters and the widths the size solver chose. Arms:

* units: ``kv`` whole KV groups (``query_heads=False``), ``qh`` query heads inside the KV groups (``query_heads=True``);
* scores: ``rms`` (weights), ``activation`` (``calibrate`` on 8 batches of 4 x 128 training tokens);
* allocation: ``fractions`` (the kind with the highest kept fraction loses a granule first) or ``importance`` (unit
  costs per parameter removed, see lightning_pat.sizing).

One process, one model load; every arm starts from a fresh copy of the dense weights.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pat import presets, prune_clusters, shrink  # noqa: E402
from lightning_pat.lm.data import (  # noqa: E402
    Windows,
    eval_starts,
    random_starts,
    split_by_file,
    stdlib_files,
    tokenize,
)
from lightning_pat.scoring.activation import calibrate  # noqa: E402

SEQ = 128


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny random Llama on byte tokens (seconds)")
    p.add_argument("--sizes", default="0.75,0.5", help="fractions of the dense parameter count")
    p.add_argument("--units", default="kv,qh")
    p.add_argument("--scores", default="rms,activation")
    p.add_argument("--allocations", default="fractions,importance")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def setup(quick: bool, eval_windows: int):
    """The dense model, the held-out windows and the calibration batches."""
    train_files, held_files = split_by_file(stdlib_files())
    texts = [[p.read_text(encoding="utf-8", errors="replace") for p in files] for files in (train_files, held_files)]
    if quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=48,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=6,
                num_key_value_heads=2,
                max_position_embeddings=SEQ + 8,
                tie_word_embeddings=True,
            )  # fmt: skip
        )

        def enc(t: list[str], limit: int) -> torch.Tensor:
            data = "\n".join(t).encode()[:limit]
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

        train, held = enc(texts[0], 100_000), enc(texts[1], 50_000)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lightning_pat.lm import smollm2_dir

        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
        train = tokenize(texts[0], tokenizer, max_chars=3_000_000)
        held = tokenize(texts[1], tokenizer, max_chars=600_000)
    val = Windows(held, eval_starts(held, num_windows=eval_windows, seq_len=SEQ), SEQ).stacked()
    calib_windows = Windows(train, random_starts(train, num_windows=32, seq_len=SEQ, seed=10_000), SEQ).stacked()
    batches = [b[:, :-1] for b in calib_windows.split(4)]
    if quick:
        batches, val = batches[:2], val[:4]
    return model.eval(), val, batches


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, val: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for w in val.split(batch):
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + w[:, 1:].numel()
    return total / count


def widths(model: torch.nn.Module) -> str:
    cfg = model.config
    return f"mlp {cfg.intermediate_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} kv"


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    dense, val, batches = setup(args.quick, args.eval_windows)
    total = sum(p.numel() for p in dense.parameters())
    t0 = time.perf_counter()
    base = held_out_loss(dense, val, args.eval_batch)
    print(f"dense: {total:,} parameters, held-out loss {base:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    stats = {}
    rows = []
    for units, size, score, allocation in itertools.product(
        args.units.split(","), [float(s) for s in args.sizes.split(",")], args.scores.split(","),
        args.allocations.split(","),
    ):  # fmt: skip
        model = copy.deepcopy(dense)
        decls = presets.llama(model, query_heads=units == "qh")
        t0 = time.perf_counter()
        activations = None
        if score == "activation":
            if units not in stats:  # calibrated once per unit kind, on a copy that stays dense
                probe = copy.deepcopy(dense)
                stats[units] = calibrate(probe, presets.llama(probe, query_heads=units == "qh"), batches)
            activations = stats[units]
        result = prune_clusters(
            model, decls, target_params=size, score=score, activations=activations, target_allocation=allocation
        )
        small = shrink(model, result)
        loss = held_out_loss(small, val, args.eval_batch)
        params = sum(p.numel() for p in small.parameters())
        rows.append((units, size, score, allocation, params, loss, widths(small), time.perf_counter() - t0))
        print(f"  {rows[-1]}", flush=True)
    print()
    print("| units | size | score | allocation | params | held-out loss | vs dense | widths |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | --- |")
    print(f"| dense | 1.00 | | | {total:,} | {base:.4f} | +0.000 | {widths(dense)} |")
    for units, size, score, allocation, params, loss, shape, _ in rows:
        print(
            f"| {units} | {size:.2f} | {score} | {allocation} | {params:,} | {loss:.4f} | {loss - base:+.3f} "
            f"| {shape} |"
        )


if __name__ == "__main__":
    main()
