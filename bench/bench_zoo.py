"""torchvision's whole classification zoo: discovery + 50% prune + shrink + exactness, next to Torch-Pruning (CPU).

    make bench-zoo                                          # installs torch-pruning==1.6.1 (--no-deps), then this
    python bench/bench_zoo.py --threads 1 --json bench/results/zoo.jsonl   # every model: the run in BENCHMARKS.md
    python bench/bench_zoo.py --quick                       # two small models, ours only: a smoke test
    python bench/bench_zoo.py --table bench/results/zoo.jsonl   # the table of a run's results

Every model of ``torchvision.models.list_models(module=torchvision.models)`` (``tests/common/torchvision_zoo.py``:
random init, 10 classes, randomised norm weights, running statistics, layer scales and class tokens, small inputs:
64x64, ViTs 32x32 (``image_size`` set), ViT-H 28x28, Swin 64x64, Inception 80x80, MaxViT 224x224), each in a fresh
process with a time limit, for both tools at 50%:

* ``ours``: ``discover(model, x)``, ``prune_clusters(model, found.clusters, 0.5)``, then
  ``shrink(model, result, example_input=found)``, which itself runs the shrunk model and compares it with the masked
  one (it raises, naming the module, if the shrunk model does not run or differs); the bench compares again
  (relative error of the logits);
* ``torch-pruning``: ``MagnitudePruner`` (L2 magnitude, ``pruning_ratio=0.5``, the classifier ignored) in interactive
  mode: every group's channels are first zeroed (the masked model), then pruned; the pruned model is compared with
  the masked one, so "exact" means the same thing for both tools.

A model is *pruned exactly* when the shrink ran, removed parameters, and the pruned logits equal the masked ones
(relative error < 1e-4). Columns: parameters dense and after, forward ms (batch 8, the bench's input size,
``torch.inference_mode``, median of ``--reps``) dense / ours / Torch-Pruning, and for ours the causes that left
channels out (grouped; the counts are groups of channels, see ``docs/discovery.md``). A tool that fails prints its
error in its cells.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.common import torchvision_zoo as zoo  # noqa: E402

EXACT = 1e-4
QUICK = ("resnet18", "mobilenet_v3_small")

#: (cause, pattern of a left-out reason), in the order of the issue; the first match names a reason's cause
CAUSES: tuple[tuple[str, str], ...] = (
    ("LayerNorm over the channels", r"LayerNorm normalises"),
    ("parameter used in forward (layer scale, class token, position embedding)", r"parameter .* used directly"),
    ("channels-last permute/reshape", r"merges a channel axis behind|channels-last"),
    ("nn.MultiheadAttention (packed in_proj)", r"MultiheadAttention|in_proj"),
    ("head count from the input width / a literal", r"shrunk model|does not run shrunk|traces with other shapes"),
    ("split/chunk/select of channels", r"`split`|`chunk`|`select`|`split_with_sizes`|`unbind`"),
    ("roll / channel shuffle / ops not followed", r"does not see through"),
    ("reaches the output (the logits)", r"reaches the model's output"),
    ("reduction/softmax/broadcast over channels", r"reduces over|mixes channels|broadcasts|sums over"),
    ("buffer / constant used in forward", r"buffer|constant"),
    ("a single channel / no reader or writer", r"single channel|no Linear/Conv"),
    ("grouped convolution / GroupNorm constraints", r"grouped|GroupNorm|straddle"),
    ("shrink cannot rewrite a member", r"cannot rewrite|would lose indices|does not resolve"),
)


def cause_of(reason: str) -> str:
    return next((cause for cause, pattern in CAUSES if re.search(pattern, reason)), "other: " + reason[:60])


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@torch.inference_mode()
def forward_ms(model: nn.Module, x: torch.Tensor, reps: int) -> float:
    model(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------------------------------- one model
def run_ours(name: str, reps: int) -> dict:
    from lightning_pat import discover, prune_clusters, shrink

    model = zoo.build(name)
    x, xb = zoo.images(name, 2), zoo.images(name, 8, seed=3)
    out: dict = {"params": numel(model), "ms_dense": forward_ms(model, xb, reps)}
    start = time.perf_counter()
    found = discover(model, x)
    out["discover_s"] = time.perf_counter() - start
    out["clusters"] = len(found.clusters)
    out["causes"] = dict(collections.Counter(cause_of(r) for lo in found.left_out for r in set(lo.reasons)))
    if not found.clusters:
        out.update(params_after=out["params"], rel=0.0, exact=False, error="no cluster found")
        return out
    result = prune_clusters(model, found.clusters, 0.5)
    with torch.inference_mode():
        masked = model(x)
    try:
        small = shrink(model, result, example_input=found)
    except Exception as err:  # noqa: BLE001 - a refused shrink is a result
        out.update(params_after=out["params"], exact=False, error=f"shrink: {type(err).__name__}: {err}"[:300])
        return out
    with torch.inference_mode():
        out["rel"] = rel(small(x), masked)
    out["params_after"] = numel(small)
    out["ms_after"] = forward_ms(small, xb, reps)
    out["exact"] = out["rel"] < EXACT and out["params_after"] < out["params"]
    return out


def _classifier(model: nn.Module) -> nn.Module:
    heads = [m for m in model.modules() if getattr(m, "out_features", getattr(m, "out_channels", None)) == 10]
    return heads[-1]


def _zero(group, tp) -> None:
    """Zero every channel a Torch-Pruning group is about to remove (the masked model of that pruning)."""
    graph = group._DG  # noqa: SLF001 - the group's dependency graph
    for dep, idxs in group:
        target, handler = dep.target.module, dep.handler
        idx = torch.as_tensor(list(idxs), dtype=torch.long)
        if isinstance(target, nn.Parameter):
            dim = getattr(dep.target, "pruning_dim", -1)
            target.data.index_fill_(dim, idx, 0.0)
            continue
        out = graph.is_out_channel_pruning_fn(handler)
        weight, bias = getattr(target, "weight", None), getattr(target, "bias", None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
            transposed = bool(getattr(target, "transposed", False))
            dim = 0 if out != transposed else 1  # out channels: rows (a transposed convolution: columns)
            if weight.dim() == 1 or (isinstance(target, nn.modules.conv._ConvNd) and target.groups > 1):  # noqa: SLF001
                dim = 0
            if idx.numel() and int(idx.max()) < weight.shape[dim]:
                weight.data.index_fill_(dim, idx, 0.0)
        norm_like = isinstance(weight, torch.Tensor) and weight.dim() == 1  # a norm: in and out are one axis
        if (out or norm_like) and isinstance(bias, torch.Tensor) and idx.numel() and int(idx.max()) < bias.shape[0]:
            bias.data.index_fill_(0, idx, 0.0)
        if isinstance(target, nn.MultiheadAttention) and out:
            for p in (target.in_proj_weight, target.in_proj_bias):
                if p is not None:
                    p.data.index_fill_(0, idx[idx < p.shape[0]], 0.0)


def run_tp(name: str, reps: int) -> dict:
    import torch_pruning as tp

    model = zoo.build(name)
    x, xb = zoo.images(name, 2), zoo.images(name, 8, seed=3)
    out: dict = {"params": numel(model), "ms_dense": forward_ms(model, xb, reps)}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruner = tp.pruner.MagnitudePruner(
            model, x, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=0.5,
            ignored_layers=[_classifier(model)],
        )  # fmt: skip
        groups = list(pruner.step(interactive=True))
        with torch.no_grad():
            for group in groups:
                _zero(group, tp)
            masked = model(x)
        for group in groups:
            group.prune()
    out["prune_s"] = time.perf_counter() - start
    with torch.inference_mode():
        out["rel"] = rel(model(x), masked)
    out["params_after"] = numel(model)
    out["ms_after"] = forward_ms(model, xb, reps)
    out["exact"] = out["rel"] < EXACT and out["params_after"] < out["params"]
    return out


def child(name: str, tool: str, reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    try:
        result = run_ours(name, reps) if tool == "ours" else run_tp(name, reps)
    except Exception as err:  # noqa: BLE001 - the failure is the result
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result = {"error": f"{type(err).__name__}: {first}"[:300]}
    print("RESULT " + json.dumps({"model": name, "tool": tool, **result}), flush=True)


def spawn(name: str, tool: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", name, "--tool", tool, "--reps", str(args.reps)]
    cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"model": name, "tool": tool, "error": f"timed out after {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": name, "tool": tool, "error": f"exit {proc.returncode}: {tail[:200]}"}
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------------------- the table
def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "-"
    if "error" in r and key not in r:
        return "error"
    return format(r[key], fmt) if key in r else "-"


def table(rows: dict[str, dict[str, dict]]) -> list[str]:
    lines = [
        "| model | params | ours: clusters | ours: exact | ours: params cut | TP: exact | TP: params cut "
        "| ms dense | ms ours | ms TP | ours / dense | TP / dense | what ours left out (groups per cause) |",
        "| --- " * 13 + "|",
    ]
    for name, by_tool in rows.items():
        o, t = by_tool.get("ours"), by_tool.get("tp")
        dense = (o or t or {}).get("params")

        def cut(r: dict | None, dense: int | None = dense) -> str:
            if r is None or "params_after" not in r or not dense:
                return "-" if r is None else "error"
            return f"{1 - r['params_after'] / dense:.0%}"

        def exact(r: dict | None) -> str:
            if r is None:
                return "-"
            if "rel" in r and r.get("exact"):
                return f"yes ({r['rel']:.0e})"
            return ("no: " + r["error"][:70]) if "error" in r else f"no ({r.get('rel', float('nan')):.0e})"

        causes = "; ".join(f"{c} ({n})" for c, n in sorted((o or {}).get("causes", {}).items(), key=lambda kv: -kv[1]))

        def ratio(r: dict | None) -> str:
            ok = r is not None and "ms_after" in r and r.get("ms_dense")
            return f"{r['ms_after'] / r['ms_dense']:.2f}x" if ok else "-"

        lines.append(
            f"| {name} | {dense or 0:,} | {_cell(o, 'clusters', 'd')} | {exact(o)} | {cut(o)} | {exact(t)} | {cut(t)} "
            f"| {_cell(o, 'ms_dense', '.1f')} | {_cell(o, 'ms_after', '.1f')} | {_cell(t, 'ms_after', '.1f')} "
            f"| {ratio(o)} | {ratio(t)} | {causes or '-'} |"
        )
    return lines


def summary(rows: dict[str, dict[str, dict]]) -> list[str]:
    def count(tool: str) -> int:
        return sum(1 for r in rows.values() if r.get(tool, {}).get("exact"))

    def broken(tool: str) -> int:  # a shrink that ran but is not exact, or does not run
        return sum(1 for r in rows.values() if "rel" in r.get(tool, {}) and not r[tool].get("exact"))

    blocked = collections.Counter(c for r in rows.values() for c in r.get("ours", {}).get("causes", {}))
    lines = [
        "",
        f"models: {len(rows)}; pruned and shrunk exactly: ours {count('ours')}, Torch-Pruning {count('tp')}; "
        f"ran but not exact: ours {broken('ours')}, Torch-Pruning {broken('tp')}",
        "",
        "| cause (ours) | models where it leaves channels out |",
        "| --- | --- |",
    ]
    lines += [f"| {c} | {n} |" for c, n in blocked.most_common()]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="default: every classification model")
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}, ours only, 1 repetition")
    parser.add_argument("--tools", nargs="*", default=["ours", "tp"], choices=["ours", "tp"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model and tool")
    parser.add_argument("--json", type=Path, help="append one JSON line per model and tool")
    parser.add_argument("--table", type=Path, help="print the table of a --json file (a run's results) and stop")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--tool", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        child(args.one, args.tool, args.reps, args.threads)
        return
    if args.table:
        rows: dict[str, dict[str, dict]] = {}
        for line in args.table.read_text().splitlines():
            result = json.loads(line)
            rows.setdefault(result["model"], {})[result["tool"]] = result
        print("\n".join(table(rows) + summary(rows)))
        return
    if args.quick:
        args.models, args.tools, args.reps = args.models or list(QUICK), ["ours"], 1
    names = args.models or zoo.names()
    try:
        import torch_pruning as tp

        tp_version = tp.__version__
    except ImportError:
        tp_version = "not installed"
        args.tools = [t for t in args.tools if t != "tp"]
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, torch {torch.__version__}, "
        f"torchvision {zoo.import_torchvision().__version__}, torch-pruning {tp_version}, {args.threads} thread(s), "
        f"50% of every cluster / group, {len(names)} models",
        flush=True,
    )
    rows = {}
    for name in names:
        for tool in args.tools:
            result = spawn(name, tool, args)
            rows.setdefault(name, {})[tool] = result
            if args.json:
                with args.json.open("a") as fh:
                    fh.write(json.dumps(result) + "\n")
            print(f"# {name} {tool}: {json.dumps(result)[:400]}", file=sys.stderr, flush=True)
    print("\n".join(table(rows) + summary(rows)))


if __name__ == "__main__":
    main()
