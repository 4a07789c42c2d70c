"""Depth or width at one parameter count: what each choice buys in speed and in quality (CPU).

    python bench/bench_shrink.py --size --reps 5 --threads 1   # the run in BENCHMARKS.md (same as this script)
    python bench/bench_size.py --quick                         # a tiny model, for a smoke test

The size: a model with half its decoder layers' parameters (``total - L/2 * per_layer``), asked for with
``target_params``; three ways to reach it:

* ``width``: ``presets.llama(mlp, heads)``: every layer keeps the same MLP width and head count;
* ``depth``: ``preset_options={"layers": True}`` only: whole layers go (the lowest weight score of their output
  projections);
* ``mixed``: MLP, heads and layers, with ``target_layers`` = 3/4 of the layers: the widths make up the rest.

Each variant is pruned with ``prune_clusters(target_params=...)``, shrunk, checked against the masked model (relative
error < 1e-5) and its parameter count against the solver's achieved count (equal), then timed.

Speed model: the Llama-style ``LlamaForCausalLM`` of ``llama_bench_model.py`` (d=384, ffn=1024, 6 layers, 6 heads of 64,
vocabulary 6144, untied; about 15M parameters). ``torch.inference_mode``, fp32, ``--threads`` threads, variants
interleaved, median over ``--reps``: forward tokens/s at batch 32 x ``--seq``; forward latency at batch 1 x ``--seq``;
greedy decoding at batch 1 with the KV cache (``generate``, ``--new-tokens`` tokens after an 8-token prompt),
tokens/s. Timings on a shared CPU are noisy (a few percent between runs).

Quality: the setup of ``bench_quality.py`` (bytes of the standard library, AdamW, batch 16, seq 64, lr 3e-3 decayed to
3e-4 while pruning) with a deeper TinyGPT (d=64, ``--quality-layers`` layers, 4 heads of 16, SwiGLU 256) so that
depth has layers to drop: a dense model trains ``--dense-steps`` steps; from that one checkpoint each variant trains
``--heal-steps`` steps with ``CoupledPruningCallback(target_params=..., ramp_steps=heal/3)`` and is shrunk; the
metric is the validation loss (nats per byte) after the last step. One seed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers as T
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_quality as Q  # noqa: E402
from llama_bench_model import build, config  # noqa: E402

from lightning_pat import CoupledPruningCallback, presets, prune_clusters, shrink  # noqa: E402
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig  # noqa: E402

VARIANTS: dict[str, dict[str, bool]] = {
    "width": {"mlp": True, "heads": True, "layers": False},
    "depth": {"mlp": False, "heads": False, "layers": True},
    "mixed": {"mlp": True, "heads": True, "layers": True},  # with target_layers = 3/4 of the layers
}


def keep_layers(name: str, num_layers: int) -> int | None:
    """``target_layers`` of a variant: the mixed one keeps 3/4 of the layers, the widths make up the rest."""
    return num_layers - num_layers // 4 if name == "mixed" else None


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def half_layers(model: nn.Module, layers: nn.ModuleList) -> int:
    """The size of ``model`` with half of its decoder layers' parameters."""
    return count(model) - len(layers) // 2 * count(layers[0])


def shape_of(model: nn.Module, layers: nn.ModuleList) -> str:
    first = layers[0]
    mlp = first.mlp.down_proj.in_features
    attn = getattr(first, "self_attn", None) or first.attn
    heads = attn.q_proj.out_features // attn.head_dim
    return f"{len(layers)} layers, ffn {mlp}, heads {heads}"


def speed(args: argparse.Namespace) -> tuple[dict[str, nn.Module], dict[str, str], dict[str, int], int]:
    cfg = config(args.quick)
    dense = build(cfg)
    target = half_layers(dense, dense.model.layers)
    variants: dict[str, nn.Module] = {"dense": dense}
    shapes = {"dense": shape_of(dense, dense.model.layers)}
    achieved = {"dense": count(dense)}
    probe = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    for name, opts in VARIANTS.items():
        pruned = copy.deepcopy(dense)
        result = prune_clusters(
            pruned, presets.llama(pruned, **opts), target_params=target,
            target_layers=keep_layers(name, cfg.num_hidden_layers),
            target_allocation="fractions",  # the same kept fraction of every kind (as recorded in BENCHMARKS.md)
        )  # fmt: skip
        assert result.size is not None
        small = shrink(copy.deepcopy(pruned), result)
        with torch.inference_mode():
            ref = pruned(probe).logits
            err = float((small(probe).logits - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (name, err)
        assert count(small) == result.size.achieved, (name, count(small), result.size.achieved)
        variants[name], shapes[name], achieved[name] = small, shape_of(small, small.model.layers), count(small)
    return variants, shapes, achieved, target


def time_variants(variants: dict[str, nn.Module], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    vocab = next(iter(variants.values())).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (32, args.seq), generator=gen)
    single, prompt = batch[:1], batch[:1, :8]
    samples: dict[str, dict[str, list[float]]] = {k: {"tput": [], "lat": [], "dec": []} for k in variants}

    def decode(m: nn.Module) -> None:
        m.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    with torch.inference_mode():
        for model in variants.values():  # warm-up
            model(single)
            model(batch)
            decode(model)
        for _ in range(args.reps):
            for name, model in variants.items():
                start = time.perf_counter()
                model(batch)
                samples[name]["tput"].append(batch.numel() / (time.perf_counter() - start))
                start = time.perf_counter()
                for _ in range(args.latency_calls):
                    model(single)
                samples[name]["lat"].append(1000 * (time.perf_counter() - start) / args.latency_calls)
                start = time.perf_counter()
                decode(model)
                samples[name]["dec"].append(args.new_tokens / (time.perf_counter() - start))
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def quality(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str], dict[str, int], int]:
    train, val_data = Q.corpus(max_bytes=300_000 if args.quick else 3_000_000)
    val = Q.val_windows(val_data, 64 if args.quick else 256)
    cfg = TinyGPTConfig(vocab_size=256, n_layer=args.quality_layers, n_head=4, n_kv_head=4, d_model=64, d_ff=256,
                        max_seq_len=Q.SEQ)  # fmt: skip
    torch.manual_seed(0)
    dense = TinyGPT(copy.deepcopy(cfg))  # a shrink rewrites its model's config object
    module = Q.LM(dense, args.dense_steps, warmup=Q.WARMUP, decay=False)
    Q.fit(module, Q.batches(train, args.dense_steps, seed=0))
    weights = copy.deepcopy(dense.state_dict())
    opt_state = copy.deepcopy(module.trainer.optimizers[0].state_dict())
    target = half_layers(dense, dense.layers)
    losses = {"dense": Q.evaluate(dense, val)}
    shapes = {"dense": shape_of(dense, dense.layers)}
    achieved = {"dense": count(dense)}
    for name in [*VARIANTS, "depth-weight"]:  # depth-weight: the layers ranked by weight RMS, not by 1 - cos
        opts = VARIANTS[name.split("-")[0]]
        torch.manual_seed(0)
        model = TinyGPT(copy.deepcopy(cfg))
        model.load_state_dict(weights)
        lm = Q.LM(model, args.heal_steps, warmup=0, decay=True, opt_state=opt_state)
        cb = CoupledPruningCallback("tiny_gpt", target_params=target, preset_options=opts, warmup_steps=0,
                                    ramp_steps=max(args.heal_steps // 3, 1),
                                    target_layers=keep_layers(name, cfg.n_layer),
                                    layer_score="weight" if name == "depth-weight" else "cosine",
                                    target_allocation="fractions")  # as recorded in BENCHMARKS.md  # fmt: skip
        Q.fit(lm, Q.batches(train, args.heal_steps, seed=10_000), callbacks=[cb])
        small = shrink(lm, cb).model
        assert cb.size is not None
        assert count(small) == cb.size.achieved, (name, count(small), cb.size.achieved)
        losses[name], shapes[name], achieved[name] = Q.evaluate(small, val), shape_of(small, small.layers), count(small)
    return losses, shapes, achieved, target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--latency-calls", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quality-layers", type=int, default=6)
    parser.add_argument("--dense-steps", type=int, default=600)
    parser.add_argument("--heal-steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--no-speed", action="store_true", help="only the quality table")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.latency_calls, args.new_tokens = 1, 1, 4
        args.quality_layers, args.dense_steps, args.heal_steps = 4, 4, 3
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    T.logging.set_verbosity_error()

    if not args.no_speed:
        speed_table(args)
    if args.no_quality:
        return
    losses, qshapes, qachieved, qtarget = quality(args)
    print(
        f"\nquality: TinyGPT, {args.dense_steps} dense steps, then {args.heal_steps} steps pruning to "
        f"target_params {qtarget:,} and healing; validation loss (nats/byte) of the shrunk model, one seed"
    )
    print("| variant | shape | params | val loss | vs width |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, loss in losses.items():
        vs = "" if name == "dense" else f"{loss - losses['width']:+.3f}"
        print(f"| {name} | {qshapes[name]} | {qachieved[name]:,} | {loss:.3f} | {vs} |")


def speed_table(args: argparse.Namespace) -> None:
    """Time the width, depth and mixed variants against the dense model and print the table."""
    variants, shapes, achieved, target = speed(args)
    times = time_variants(variants, args)
    print(
        f"date {datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}, transformers "
        f"{T.__version__}, threads {args.threads}, fp32, seq {args.seq}, median of {args.reps} interleaved reps; "
        f"target_params {target:,} (half of the decoder layers' parameters)"
    )
    print("| variant | shape | params | tokens/s (batch 32) | vs dense | latency ms (batch 1) | vs dense "
          "| decode tokens/s (batch 1, KV cache) | vs dense |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = times["dense"]
    for name, t in times.items():
        print(
            f"| {name} | {shapes[name]} | {achieved[name]:,} | {t['tput']:,.0f} | {t['tput'] / base['tput']:.2f}x | "
            f"{t['lat']:.2f} | {base['lat'] / t['lat']:.2f}x | {t['dec']:,.1f} | {t['dec'] / base['dec']:.2f}x |"
        )


if __name__ == "__main__":
    main()
