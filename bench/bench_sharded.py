"""One pruning step under FSDP-style sharding: the sharded executor vs the materializing executor, CPU gloo.

    python bench/bench_sharded.py                      # world 4; sizes S, M, L (L = hidden 1024, MLP 4096)
    python bench/bench_sharded.py --sizes L --steps 3  # quicker

Each size builds a Llama-style stack (GQA attention, gated MLP, embedding and lm_head), shards every weight with
``Shard(0)`` on a 1-D mesh of ``--world`` gloo ranks (what ``fully_shard`` produces), and declares one MLP cluster
and one GQA head cluster per layer plus one residual-stream cluster. Per executor it times ``Pruner.step`` (select
and apply, no literal-zero counts) and reports, per rank and per step:

* collectives and bytes received: every c10d and functional-collective op is seen by a ``TorchDispatchMode`` (so
  DTensor's internal all-gathers of ``full_tensor`` are counted too). Bytes received: all-gather = output minus
  own input; all-to-all = (n-1)/n of the output; all-reduce = 2(n-1)/n of the payload (ring model).
* wall time: median over the measured steps (after one warm-up step) of the slowest rank.
* peak extra memory: the rise of the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) over its resident size before the step, slowest rank. glibc's mmap threshold is fixed
  at 64 KiB so freed tensor memory goes back to the OS and cannot hide behind earlier peaks.

An analytic table follows for Llama-3-8B shapes (not measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # hidden, ffn, layers, q heads, kv heads, head_dim, vocab
    "S": (256, 1024, 2, 4, 2, 64, 4096),
    "M": (512, 2048, 4, 8, 2, 64, 8192),
    "L": (1024, 4096, 4, 16, 4, 64, 8192),
}


class CommBytes(TorchDispatchMode):
    """Counts collective ops and the bytes this rank receives through them."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size  # every collective here runs on the 1-D mesh's group
        self.ops: list[str] = []
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func._schema.name
        keys = ("gather", "reduce", "broadcast", "scatter", "alltoall", "all_to_all", "barrier", "send", "recv")
        collective = any(k in name for k in keys)
        if name.startswith(("c10d::", "_c10d_functional::")) and collective:
            self.ops.append(name)
            if name == "c10d::_allgather_base_":
                self.received += args[0].nbytes - args[1].nbytes
            elif name == "_c10d_functional::all_gather_into_tensor":
                self.received += args[0].nbytes * (args[1] - 1)
            elif name == "c10d::alltoall_base_":
                self.received += args[0].nbytes * (self.group_size - 1) // self.group_size
            elif name == "c10d::allreduce_":
                n = self.group_size
                self.received += int(2 * (n - 1) / n * sum(t.nbytes for t in args[0]))
            else:
                raise NotImplementedError(f"byte accounting for {name}")
        return func(*args, **kwargs)


def rss_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> None:
    """Reset the resident-set high-water mark (``VmHWM``) to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(size: str, mesh):  # noqa: ANN001, ANN201
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_pat import Cluster

    d, ffn, layers, nq, nkv, hd, vocab = SIZES[size]
    shapes = {"embed": (vocab, d), "head": (vocab, d), "norm": (d,)}
    for i in range(layers):
        shapes |= {
            f"l{i}.q": (nq * hd, d),
            f"l{i}.k": (nkv * hd, d),
            f"l{i}.v": (nkv * hd, d),
            f"l{i}.o": (d, nq * hd),
            f"l{i}.norm": (d,),
            f"l{i}.gate": (ffn, d),
            f"l{i}.up": (ffn, d),
            f"l{i}.down": (d, ffn),
        }
    root = nn.Module()
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        full = torch.randn(shape, generator=gen)
        mod.register_parameter(leaf, nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)))
        del full
    lay = r"l(?P<layer>\d+)"
    clusters = [
        Cluster("mlp.{layer}", writers=[f"re:{lay}\\.(gate|up)"], readers=[f"re:{lay}\\.down"]),
        Cluster("heads.{layer}", writers=[f"re:{lay}\\.(q|k|v)"], readers=[f"re:{lay}\\.o"], head_dim=hd),
        Cluster(
            "resid", writers=[r"re:l\d+\.(o|down|norm)", "norm"], readers=["embed", "head", r"re:l\d+\.(q|k|v|gate|up)"]
        ),
    ]
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    return root, clusters, numel


def worker(rank: int, world: int, store_path: str, sizes: list[str], steps: int, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_pat import resolve_clusters
    from lightning_pat.pruning.pruner import Pruner

    mesh = init_device_mesh("cpu", (world,))
    rows = []
    from lightning_pat.parallel.executors.sharded import ShardedExecutor

    for size in sizes:
        for variant in ("sharded", "sharded, forced 2-phase", "materializing"):
            module, clusters, numel = build(size, mesh)
            resolved = resolve_clusters(module, clusters)
            saved = ShardedExecutor.two_phase_min_bytes
            if variant == "sharded, forced 2-phase":
                ShardedExecutor.two_phase_min_bytes = 0
            try:
                pruner = Pruner(module, resolved, executor=variant.split(",")[0])
            finally:
                ShardedExecutor.two_phase_min_bytes = saved
            targets = {rc.name: 0.5 for rc in resolved}
            times, peaks, received, ops = [], [], [], []
            for step in range(steps + 1):
                dist.barrier()
                base = rss_kib("VmRSS")
                reset_peak()
                with torch.no_grad():
                    start = time.perf_counter()
                    res = pruner.step(targets)
                    elapsed = time.perf_counter() - start
                peak = rss_kib("VmHWM") - base
                if step:  # step 0 is a warm-up
                    times.append(elapsed)
                    peaks.append(peak * 1024)
            with torch.no_grad(), CommBytes(world) as comm:  # one more step, outside the timed ones, for accounting
                pruner.step(targets)
            received.append(comm.received)
            ops.append(len(comm.ops))
            with torch.no_grad(), CommBytes(world) as comm:
                pruner.counts()
            rows.append(
                {
                    "size": size,
                    "executor": variant,
                    "clusters": len(resolved),
                    "numel": numel,
                    "time": statistics.median(times),
                    "peak": max(peaks),
                    "received": max(received),
                    "ops": max(ops),
                    "count_ops": len(comm.ops),
                    "count_received": comm.received,
                    "dropped": res.dropped,
                }
            )
            del module, pruner
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def measured_table(gathered: list[list[dict]], world: int) -> str:
    by = {}
    for rank_rows in gathered:
        for row in rank_rows:
            key = (row["size"], row["executor"])
            cur = by.setdefault(key, dict(row))
            for k in ("time", "peak", "received", "ops"):
                cur[k] = max(cur[k], row[k])
    lines = [
        f"Measured per pruning step, world {world}, every weight Shard(0) on a 1-D gloo mesh (worst rank):",
        "",
        "| size (d/ffn/layers, params) | clusters | executor | collectives | bytes received/rank | wall time "
        "(median) | peak extra memory |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for size in dict.fromkeys(k[0] for k in by):
        s, t, m = by[(size, "sharded")], by[(size, "sharded, forced 2-phase")], by[(size, "materializing")]
        assert s["dropped"] == m["dropped"] == t["dropped"], f"size {size}: executors disagree"
        d, ffn, layers, *_ = SIZES[size]
        label = f"{size}: {d}/{ffn}/{layers}, {s['numel'] / 1e6:.1f}M"
        for row in (s, t, m):
            lines.append(
                f"| {label} | {row['clusters']} | {row['executor']} | {row['ops']} | "
                f"{_fmt_bytes(row['received'])} | {row['time'] * 1e3:.1f} ms | {_fmt_bytes(row['peak'])} |"
            )
        ratios.append(
            (
                size,
                m["ops"] / max(s["ops"], 1),
                m["received"] / max(s["received"], 1),
                m["time"] / s["time"],
                m["peak"] / max(s["peak"], 1),
            )
        )
        count_s = (by[(size, "sharded")]["count_ops"], by[(size, "sharded")]["count_received"])
        count_m = (by[(size, "materializing")]["count_ops"], by[(size, "materializing")]["count_received"])
        lines.append(
            f"| {label} | | counts (log steps only) | {count_s[0]} vs {count_m[0]} | "
            f"{_fmt_bytes(count_s[1])} vs {_fmt_bytes(count_m[1])} | | |"
        )
    lines += [
        "",
        "Ratios materializing / sharded (the default one-collective path at these sizes):",
        "",
        "| size | collectives | bytes received | wall time | peak extra memory |",
        "|---|---|---|---|---|",
    ]
    for size, ops, recv, t, mem in ratios:
        lines.append(f"| {size} | {ops:.0f}x | {recv:,.0f}x | {t:.1f}x | {mem:.1f}x |")
    return "\n".join(lines)


@dataclass
class Llama:
    d: int = 4096
    layers: int = 32
    ffn: int = 14336
    nq: int = 32
    nkv: int = 8
    hd: int = 128
    vocab: int = 128256
    b: int = 2  # bf16 parameters


def analytic_table(cfg: Llama, worlds: tuple[int, ...] = (8, 64)) -> str:
    """Per pruning step, per rank, for every weight Shard(0) (FSDP) on a 1-D mesh of n ranks."""
    d, ffn, hd = cfg.d, cfg.ffn, cfg.hd
    attn = [(cfg.nq * hd, d), (cfg.nkv * hd, d), (cfg.nkv * hd, d), (d, cfg.nq * hd)]
    mlp = [(ffn, d), (ffn, d), (d, ffn)]
    per_layer = sum(a * b for a, b in attn + mlp) + d
    n_params_total = cfg.layers * per_layer + 2 * cfg.vocab * d + d
    num_tensors = cfg.layers * 8 + 3
    c_mlp, c_heads, c_resid = ffn, cfg.nkv, d  # GQA: one unit = one kv head with its query group
    num_clusters = 2 * cfg.layers + 1
    sum_c = c_resid + cfg.layers * (c_mlp + c_heads)
    lines = [
        f"Llama-3-8B shapes (d={d}, {cfg.layers} layers, ffn {ffn}, {cfg.nq} q / {cfg.nkv} kv heads of {hd}, vocab "
        f"{cfg.vocab}; {n_params_total / 1e9:.2f}B clustered parameters in {num_tensors} tensors, bf16), every weight "
        f"Shard(0) over n ranks; {num_clusters} clusters (32 MLP, 32 GQA head groups, 1 residual), per pruning step "
        "and rank, arithmetic (not measured):",
        "",
        "| n | design | collectives per step (+ on log steps) | bytes received per rank | vs materializing | "
        "peak extra memory |",
        "|---|---|---|---|---|---|",
    ]
    for n in worlds:
        ring = 2 * (n - 1) / n
        mat = (n - 1) / n * n_params_total * cfg.b
        # torchao first version (pat-algorithm.md §3.2/§7): per cluster a fp32 all-reduce of reader partials [C],
        # a fp32 all-gather of writer blocks [n_w, C/n], an int64 all-reduce of per-parameter counts.
        writers = {"mlp": 2, "heads": 3, "resid": 2 * cfg.layers}
        members = {"mlp": 3, "heads": 4, "resid": 7 * cfg.layers + 2}
        tao = 0.0
        for kind, c, count in (("mlp", c_mlp, cfg.layers), ("heads", c_heads, cfg.layers), ("resid", c_resid, 1)):
            tao += count * (ring * 4 * c + (n - 1) / n * 4 * writers[kind] * c)
        tao_counts = sum(ring * 8 * members[k] * cnt for k, cnt in (("mlp", 32), ("heads", 32), ("resid", 1)))
        ours = (n - 1) * 8 * sum_c  # float64 partial sums (layout-invariant scores)
        ours_counts = ring * 8 * num_tensors
        two_phase = 2 * (n - 1) / n * 8 * -(-sum_c // n) * n
        heads_note = "" if c_heads % n == 0 else "; its head clusters (C=8 not divisible by n) would materialize"
        lines += [
            f"| {n} | materializing (full_tensor per weight) | {num_tensors} (+{num_tensors}) | {_fmt_bytes(mat)} "
            f"| 1x | {_fmt_bytes(n_params_total * cfg.b)} dense copies |",
            f"| {n} | torchao per-cluster 3-collective fast path (counts every step){heads_note} | "
            f"{3 * num_clusters} | {_fmt_bytes(tao + tao_counts)} | {mat / (tao + tao_counts):,.0f}x | "
            "O(n_w C) fp32 per cluster |",
            f"| {n} | lightning_pat, one packed all_gather per shard group (its choice up to 4 MiB received) | "
            f"1 (+1) | {_fmt_bytes(ours)} (+{_fmt_bytes(ours_counts)}) | {mat / ours:,.0f}x | "
            f"{_fmt_bytes(8 * sum_c * n)} gathered fp64 |",
            f"| {n} | lightning_pat, all_to_all + all_gather, same bits (its choice above 4 MiB: **used here**) | "
            f"2 (+1) | {_fmt_bytes(two_phase)} (+{_fmt_bytes(ours_counts)}) | {mat / two_phase:,.0f}x | "
            f"{_fmt_bytes(4 * 8 * sum_c)} fp64 buffers |",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--sizes", default="S,M,L")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the workers: freed tensors return to the OS
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, args.world, os.path.join(tmp, "store"), sizes, args.steps, queue))
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        gathered = None
        while gathered is None:
            try:
                gathered = queue.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: check the workers are alive
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.kill()
                    raise SystemExit("a benchmark worker failed (see its traceback above)") from None
        for p in procs:
            p.join(60)
    sys.stdout.write(measured_table(gathered, args.world) + "\n\n" + analytic_table(Llama()) + "\n")


if __name__ == "__main__":
    main()
