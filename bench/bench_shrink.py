"""Forward speed of a shrunk model vs the dense model, the ideal model of the same widths and Torch-Pruning (CPU).

    make bench-shrink                                   # installs torch-pruning==1.6.1 (--no-deps), then runs this
    python bench/bench_shrink.py --reps 5 --threads 1   # the run in BENCHMARKS.md
    python bench/bench_shrink.py --quick                # a tiny model, for a smoke test
    python bench/bench_shrink.py --layernorm            # how far a GPT-2 (LayerNorm) residual shrink moves the logits
    python bench/bench_shrink.py --healing              # healing-phase wall time with and without shrink_on_freeze
    python bench/bench_shrink.py --size                 # depth vs width at one parameter count (bench_size.py)

Model: a Llama-style ``LlamaForCausalLM`` (transformers) of about 15M parameters: d=384, ffn=1024, 6 layers, 6 heads
of 64 (MHA, so that Torch-Pruning's dependency graph can follow the MLP; see below), vocabulary 6144, untied
lm_head. For each fraction f in 25/50/75%, ``prune_clusters`` zeroes f of every layer's MLP channels and f of its
heads (``presets.llama(mlp=True, heads=True)``), then variants are built:

* ``dense``: the unpruned model;
* ``lightning_pat``: ``lightning_pat.shrink(model, result)``;
* ``ideal``: ``LlamaForCausalLM`` built from scratch with the same widths (``intermediate_size``, head counts,
  explicit ``head_dim``), random weights; the speed a shrink should reach;
* ``lightning_pat (mlp only)`` and ``torch-pruning (mlp only)``: the same dropped MLP channels removed by
  ``lightning_pat.shrink`` and by Torch-Pruning's ``DependencyGraph`` (``prune_linear_in_channels`` on ``down_proj``
  with our indices, which it propagates to gate/up). Torch-Pruning 1.6.1 does not finish building the pruning group
  of an attention output projection of transformers 5.24's ``LlamaAttention`` (no result after 300 s on a 2-layer
  toy), so it prunes no heads here; the mlp-only pair compares the two on the units both can remove.

Timing: ``torch.inference_mode``, fp32, one process, ``torch.set_num_threads(--threads)``. Throughput: batch 32 x
``--seq`` tokens; latency: batch 1 x ``--seq`` tokens. Variants are interleaved: each repetition times every variant
once (a few warm-up calls first), and the table reports the median over repetitions. Ratios: speed / ideal's speed of
the same fraction, and speed / Torch-Pruning's for the mlp-only pair. Before timing, the script checks that each
shrunk model matches its ideal model exactly in parameter shapes, strides and dtypes and carries no hooks, and that
shrunk and Torch-Pruning outputs equal the masked model's (relative error < 1e-5).
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
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as T
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_bench_model import build, config  # noqa: E402

from lightning_pat import presets, prune_clusters, shrink  # noqa: E402


def torch_pruning_mlp(model: nn.Module, dropped: dict[str, list[int]], ids: torch.Tensor) -> nn.Module:
    import torch_pruning as tp

    graph = tp.DependencyGraph().build_dependency(model, example_inputs=ids, output_transform=lambda out: out.logits)
    for i, layer in enumerate(model.model.layers):
        group = graph.get_pruning_group(layer.mlp.down_proj, tp.prune_linear_in_channels, idxs=dropped[f"mlp.{i}"])
        group.prune()
        layer.mlp.intermediate_size = layer.mlp.down_proj.in_features
    return model


def structure(model: nn.Module) -> dict[str, tuple]:
    """Parameter shapes, strides and dtypes; checked equal between the shrunk and the ideal model."""
    return {n: (tuple(p.shape), p.stride(), p.dtype) for n, p in model.named_parameters()}


def has_hooks(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def timed(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def layernorm_error() -> None:
    """Relative change of the logits when the residual of a LayerNorm model (GPT-2) is shrunk (not exact)."""
    from tests.common.tiny_families import gpt2, logits, token_ids

    print("| model | residual pruned | relative logit change (Frobenius), shrunk vs masked |")
    print("| --- | ---: | ---: |")
    for case in (gpt2(n_head=4), gpt2(n_head=2, tied=False, n_layer=3)):
        for frac in (0.25, 0.5, 0.75):
            model = case.fresh()
            result = prune_clusters(model, presets.gpt2(model, mlp=False, heads=False, residual=True), frac)
            ids = token_ids(batch=8)
            masked = logits(model, ids)
            small = logits(shrink(model, result), ids)
            rel = float((small - masked).norm() / masked.norm())
            print(f"| {case.id} (d={case.d}, {case.n_layer} layers) | {round(frac * 100)}% | {rel:.1%} |")


def healing_time(*, steps: int, rounds: int) -> None:
    """Wall time of the healing phase of the demo model (TinyGPT as in examples/demo.py, 50% of MLP + heads)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_pat import CoupledPruningCallback
    from lightning_pat.demo.model import TinyGPT, TinyGPTConfig

    warmup, ramp = 5, 10

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(TinyGPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=256))

        def training_step(self, batch, batch_idx):
            ids = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(self.global_step))
            logits = self.model(ids[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self):
            return DataLoader(list(range(10_000)), batch_size=1)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.healing = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > warmup + ramp:  # this step ran after the final ramp step
                self.healing += time.perf_counter() - self.start

    results: dict[bool, list[float]] = {False: [], True: []}
    params: dict[bool, int] = {}
    for _ in range(rounds):
        for shrink_on_freeze in (False, True):
            module, timer = LM(), Timer()
            cb = CoupledPruningCallback(
                "tiny_gpt", 0.5, warmup_steps=warmup, ramp_steps=ramp, shrink_on_freeze=shrink_on_freeze
            )
            trainer = pl.Trainer(
                max_steps=warmup + ramp + steps,
                callbacks=[cb, timer],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                accelerator="cpu",
            )
            trainer.fit(module)
            results[shrink_on_freeze].append(timer.healing)
            params[shrink_on_freeze] = sum(p.numel() for p in module.parameters())
    print(f"TinyGPT d=64 ffn=256 2 layers 4 heads (2 KV), 50% MLP + heads, batch 16x32, AdamW, {steps} healing steps")
    print("| variant | params during healing | healing wall time (s, median) | ms/step | speed-up vs masked |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(results[False])
    for flag, label in ((False, "masked (shrink_on_freeze=False)"), (True, "shrunk (shrink_on_freeze=True)")):
        t = statistics.median(results[flag])
        print(f"| {label} | {params[flag]:,} | {t:.2f} | {1000 * t / steps:.2f} | {base / t:.2f}x |")


def main() -> None:
    if "--size" in sys.argv:  # depth vs width at one size: its own options (bench_size.py --help)
        import bench_size

        bench_size.main([a for a in sys.argv[1:] if a != "--size"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--latency-calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-torch-pruning", action="store_true")
    parser.add_argument("--layernorm", action="store_true")
    parser.add_argument("--healing", action="store_true")
    parser.add_argument("--healing-steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    T.logging.set_verbosity_error()
    if args.layernorm:
        layernorm_error()
        return
    if args.healing:
        healing_time(steps=args.healing_steps, rounds=args.reps)
        return

    cfg = config(args.quick)
    dense = build(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (32, args.seq), generator=gen)
    single = batch[:1]
    variants: dict[str, nn.Module] = {"dense": dense}
    widths: dict[str, str] = {"dense": f"ffn {cfg.intermediate_size}, heads {cfg.num_attention_heads}"}
    for frac in (0.25, 0.5, 0.75):
        pct = f"{round(frac * 100)}%"
        pruned = copy.deepcopy(dense)
        result = prune_clusters(pruned, presets.llama(pruned, mlp=True, heads=True), frac)
        ffn = cfg.intermediate_size - len(result.dropped["mlp.0"])
        heads = cfg.num_attention_heads - len(result.dropped["heads.0"])
        small = shrink(copy.deepcopy(pruned), result)
        with torch.inference_mode():
            err = float((small(single).logits - pruned(single).logits).abs().max() / pruned(single).logits.abs().max())
        assert err < 1e-5, err
        variants[f"{pct} lightning_pat"] = small
        variants[f"{pct} ideal"] = build(config(args.quick, intermediate_size=ffn, num_attention_heads=heads))
        assert structure(small) == structure(variants[f"{pct} ideal"]), "shrunk and ideal models differ in layout"
        assert not has_hooks(small)
        for name in (f"{pct} lightning_pat", f"{pct} ideal"):
            widths[name] = f"ffn {ffn}, heads {heads}"
        mlp_only = copy.deepcopy(dense)
        mlp_result = prune_clusters(mlp_only, presets.llama(mlp_only, heads=False), frac)
        variants[f"{pct} lightning_pat (mlp only)"] = shrink(copy.deepcopy(mlp_only), mlp_result)
        widths[f"{pct} lightning_pat (mlp only)"] = f"ffn {ffn}, heads {cfg.num_attention_heads}"
        if not args.no_torch_pruning:
            tp_model = torch_pruning_mlp(copy.deepcopy(mlp_only), mlp_result.dropped, single)
            with torch.inference_mode():
                ref = variants[f"{pct} lightning_pat (mlp only)"](single).logits
                err = float((tp_model(single).logits - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, err
            assert structure(tp_model) == structure(variants[f"{pct} lightning_pat (mlp only)"])
            variants[f"{pct} torch-pruning (mlp only)"] = tp_model
            widths[f"{pct} torch-pruning (mlp only)"] = widths[f"{pct} lightning_pat (mlp only)"]

    throughput: dict[str, list[float]] = {k: [] for k in variants}
    latency: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for model in variants.values():  # warm-up
            model(single)
            model(batch)
        for _ in range(args.reps):
            for name, model in variants.items():
                throughput[name].append(batch.numel() / timed(lambda m=model: m(batch), 1))
                latency[name].append(1000 * timed(lambda m=model: m(single), args.latency_calls))

    def params(m: nn.Module) -> float:
        return sum(p.numel() for p in m.parameters()) / 1e6

    print(
        f"date {datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}, transformers "
        f"{T.__version__}, threads {args.threads}, fp32, seq {args.seq}, median of {args.reps} interleaved reps"
    )
    print("| variant | widths | params (M) | tokens/s (batch 32) | vs ideal | vs torch-pruning | latency ms (batch 1) "
          "| vs ideal | vs torch-pruning |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, model in variants.items():
        tput, lat = statistics.median(throughput[name]), statistics.median(latency[name])
        pct = name.split(" ")[0]
        ideal = f"{pct} ideal"
        tpn = f"{pct} torch-pruning (mlp only)"
        vs_ideal = vs_ideal_lat = vs_tp = vs_tp_lat = ""
        if ideal in variants and "mlp only" not in name:
            vs_ideal = f"{tput / statistics.median(throughput[ideal]):.3f}x"
            vs_ideal_lat = f"{statistics.median(latency[ideal]) / lat:.3f}x"
        if tpn in variants and "mlp only" in name:
            vs_tp = f"{tput / statistics.median(throughput[tpn]):.3f}x"
            vs_tp_lat = f"{statistics.median(latency[tpn]) / lat:.3f}x"
        print(
            f"| {name} | {widths[name]} | {params(model):.2f} | {tput:,.0f} | {vs_ideal} | {vs_tp} | {lat:.2f} | "
            f"{vs_ideal_lat} | {vs_tp_lat} |"
        )
    print("(ratios are speed ratios: > 1 means faster than the reference; latency ratios are reference_ms / ms)")


if __name__ == "__main__":
    main()
