"""Discovery by tracing on vision models no one here wrote, side by side with Torch-Pruning at the same ratio (CPU).

    make bench-discover                                      # installs torch-pruning==1.6.1 (--no-deps), then this
    python bench/bench_discover.py --reps 5 --threads 1      # the run in BENCHMARKS.md
    python bench/bench_discover.py --quick                   # two models, two repetitions: a smoke test

Models: transformers ``ResNetForImageClassification`` (bottleneck, widths 64-512), ``ConvNextForImageClassification``
(widths 48-384), ``MobileNetV2ForImageClassification`` (depth multiplier 1.0) and ``ViTForImageClassification`` (4
layers, d=192, 3 heads, ffn 768), the ``wide`` configs of ``tests/common/vision_models.py`` (random init, healthy
norms, 64x64 images, 1,000 classes).

For each model and both tools at 50%:

* ``lightning_pat``: ``discover(model, images)`` (no declarations), ``prune_clusters(..., 0.5)`` (each discovered
  cluster loses half its units), ``shrink``; the shrunk model's logits are compared with the masked model's (the
  relative error is printed: the shrink is exact);
* ``torch-pruning``: ``MagnitudePruner`` with L2 magnitude importance, ``pruning_ratio=0.5``, the classifier
  ignored, ``forward_fn`` returning the logits; its dependency graph is built from the same example input. It
  removes channels with their current (non-zero) weights, so its output is a different function (it is meant to be
  fine-tuned afterwards); it also prunes channels discovery leaves out (a LayerNorm-ed residual stream).

Columns: clusters found / left out (ours), seconds to trace (ours: ``discover``; Torch-Pruning: graph + prune),
parameters after the shrink, forward time of dense / ours / Torch-Pruning (``torch.inference_mode``, fp32, batch
32, one thread by default, interleaved: every repetition times every variant once; median over repetitions) and
the ratio ours / dense. A tool that fails on a model prints the error in its cells instead of a number.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pat import discover, prune_clusters, shrink  # noqa: E402
from tests.common.vision_models import BUILDERS, WIDE_IMAGE, build, images  # noqa: E402


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=x).logits


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def ours(name: str, x: torch.Tensor) -> tuple[nn.Module, dict]:
    model = build(name, wide=True)
    start = time.perf_counter()
    found = discover(model, x)
    secs = time.perf_counter() - start
    result = prune_clusters(model, found.clusters, 0.5)
    with torch.inference_mode():
        masked = logits(model, x)
    small = shrink(model, result).eval()
    with torch.inference_mode():
        rel = float((logits(small, x) - masked).norm() / masked.norm())
    return small, {"clusters": len(found.clusters), "left": len(found.left_out), "secs": secs, "rel": rel}


def torch_pruning(name: str, x: torch.Tensor) -> tuple[nn.Module | None, dict]:
    try:
        import torch_pruning as tp
    except ImportError:
        return None, {"error": "torch-pruning not installed (make bench-discover)"}
    model = build(name, wide=True)
    head = model.classifier[-1] if isinstance(model.classifier, nn.Sequential) else model.classifier
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pruner = tp.pruner.MagnitudePruner(
                model,
                x,
                importance=tp.importance.MagnitudeImportance(p=2),
                pruning_ratio=0.5,
                ignored_layers=[head],
                forward_fn=logits,
            )
            pruner.step()
            logits(model, x)
    except Exception as err:  # noqa: BLE001 - the baseline's failure is a result, printed in the table
        return None, {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"}
    return model.eval(), {"secs": time.perf_counter() - start}


@torch.inference_mode()
def timed(models: dict[str, nn.Module | None], x: torch.Tensor, reps: int) -> dict[str, float]:
    live = {k: m for k, m in models.items() if m is not None}
    for m in live.values():
        for _ in range(2):
            logits(m, x)
    times: dict[str, list[float]] = {k: [] for k in live}
    for _ in range(reps):
        for k, m in live.items():
            start = time.perf_counter()
            logits(m, x)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*", choices=list(BUILDERS), help="default: all")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.models or (["resnet", "mobilenet_v2"] if args.quick else list(BUILDERS))
    reps = 2 if args.quick else args.reps
    try:
        import torch_pruning as tp

        tp_version = tp.__version__
    except ImportError:
        tp_version = "not installed"
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, torch {torch.__version__}, "
        f"torch-pruning {tp_version}, {args.threads} thread(s), batch {args.batch}, 50% of every cluster / layer"
    )
    header = (
        "| model | ours: clusters / left out | trace s (ours / TP) | params dense | params ours | params TP "
        "| ms dense | ms ours | ms TP | ours / dense | ours exact (rel) |"
    )
    print(header)
    print("| --- " * 11 + "|")
    for name in names:
        x = images(2, size=WIDE_IMAGE)
        small, info = ours(name, x)
        tp_model, tp_info = torch_pruning(name, x)
        dense = build(name, wide=True)
        ms = timed({"dense": dense, "ours": small, "tp": tp_model}, images(args.batch, seed=3, size=WIDE_IMAGE), reps)
        tp_err = tp_info.get("error")
        print(
            f"| {name} | {info['clusters']} / {info['left']} | {info['secs']:.2f} / "
            f"{tp_err or format(tp_info['secs'], '.2f')} | {numel(dense):,} | {numel(small):,} | "
            f"{'-' if tp_model is None else format(numel(tp_model), ',')} | {ms['dense']:.2f} | {ms['ours']:.2f} | "
            f"{'-' if tp_model is None else format(ms['tp'], '.2f')} | {ms['ours'] / ms['dense']:.2f}x | "
            f"{info['rel']:.1e} |"
        )


if __name__ == "__main__":
    main()
