"""Per-step cost of each pruning component, side by side, in one process, on the same weights.

    python bench/bench_components.py                  # TinyGPT d=256, ffn=1024, 4 layers, batch 8 x 128, CPU
    python bench/bench_components.py --rounds 60      # more rounds, tighter medians
    python bench/bench_components.py --json out.json  # also write the numbers

End-to-end step times on a shared machine drift by several percent between processes, which hides a 1-3%
pruning overhead. Here every component runs once per round, in the same order, on weights restored to the same
values before each call (the restore is not timed), and the table reports the median over rounds as milliseconds,
as a share of one forward+backward, and as a ratio to a naive coupled projection written below. By default torch
runs one intra-op thread and the clock is the process's CPU time (``time.process_time``): on a machine shared
with other work, wall time mostly measures how long the process waited for a core (``--clock wall`` to switch).

* ``forward+backward``: the reference (cross-entropy of next-token logits, gradients set to ``None`` first).
* ``naive coupled projection``: per cluster, the squared rows (writers) and columns (readers) summed per unit in
  the weights' dtype, one ``topk``, one ``index_fill_`` per member. What a short hand-written loop does, with none
  of lightning_pat's guarantees (float64 scores, deterministic ties, sharded layouts, validation).
* ``naive, float64 scores``: the same with the squares taken in float64 (what exact, layout-invariant scores cost
  in the naive loop).
* ``lightning_pat fresh selection``: ``Pruner.step`` (score, select, apply), as the callback calls it.
* ``ablation: fresh selection, float32 sums``: the same step with the unit sums accumulated in float32 (patched
  in for this row only; the library always sums in float64 so that selections do not depend on the layout).
* ``lightning_pat held mask``: ``Pruner.hold`` (re-zero the current mask), between selections and while healing.
* ``lightning_pat latent swap + commit``: ``LatentStore.swap_in`` + ``commit`` (latent mode, every ramp step).
* ``torchao PAT proximal step``: ``PruneOptimizer(AdamW)`` with ``MinSparsityConstraint`` at the same sparsity
  (rows of gate/up and q/k/v, columns of down and o, heads as ``AttentionHeadGrouperDim0/1``; torchao prunes each
  tensor on its own, it cannot couple) minus a bare ``AdamW`` step on the same parameters and gradients. Needs
  ``torchao`` with ``torchao.prototype.pat`` (``pip install --no-deps torchao==0.18.0``); otherwise the row says
  why it is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pat import resolve_clusters  # noqa: E402
from lightning_pat.demo import preset as demo_preset  # noqa: E402
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig  # noqa: E402
from lightning_pat.parallel.executors import materializing  # noqa: E402
from lightning_pat.pruning.pruner import Pruner  # noqa: E402
from lightning_pat.training.latent import LatentStore  # noqa: E402


# ---------------------------------------------------------------------------------------------- the naive baseline
class NaiveProjection:
    """Coupled projection by hand: squared rows/columns per unit, ``topk``, ``index_fill_`` (see module docstring)."""

    def __init__(self, clusters, params: dict[str, torch.Tensor], *, sparsity: float, acc: torch.dtype | None) -> None:
        self.acc = acc
        self.groups = []
        for rc in clusters:
            members = [(params[m.name].detach(), m.dim, m.block) for m in rc.members]
            self.groups.append((members, rc.num_units, math.ceil(sparsity * rc.num_units)))

    @torch.no_grad()
    def __call__(self) -> None:
        for members, num_units, k in self.groups:
            q = None
            for w, dim, _ in members:
                x = w if self.acc is None else w.to(self.acc)
                s = x.square().sum(dim=1 - dim).view(num_units, -1).sum(dim=1)
                q = s if q is None else q + s
            units = torch.topk(q, k, largest=False).indices
            for w, dim, block in members:
                idx = units if block == 1 else (units[:, None] * block + torch.arange(block)).flatten()
                w.index_fill_(dim, idx, 0.0)


# ---------------------------------------------------------------------------------------------- torchao PAT
def torchao_pat(model: TinyGPT, *, sparsity: float, heads: bool, lr: float):
    """``(prune_optimizer, bare_adamw)`` over the clustered weights, or ``(None, reason)``."""
    try:
        from torchao.prototype.pat import PruneOptimizer
    except Exception as err:  # noqa: BLE001 - any import failure means "not available"
        return None, f"torchao.prototype.pat unavailable ({type(err).__name__}: {err})"
    cfg = model.config
    groups = []
    for layer in model.layers:
        mlp = layer.mlp
        common = {"prox_type": "MinSparsityConstraint", "min_sparsity": sparsity}
        groups.append({"params": [mlp.gate_proj.weight, mlp.up_proj.weight], "group_type": "Dim0Grouper", **common})
        groups.append({"params": [mlp.down_proj.weight], "group_type": "Dim1Grouper", **common})
        if heads:
            att = layer.attn
            dim0 = "AttentionHeadGrouperDim0"
            groups.append({"params": [att.q_proj.weight], "group_type": dim0, "num_heads": cfg.n_head, **common})
            groups.append(
                {"params": [att.k_proj.weight, att.v_proj.weight], "group_type": dim0, "num_heads": cfg.n_kv_head}
                | common
            )
            groups.append(
                {"params": [att.o_proj.weight], "group_type": "AttentionHeadGrouperDim1", "num_heads": cfg.n_head}
                | common
            )
    params = [p for g in groups for p in g["params"]]
    bare = torch.optim.AdamW(params, lr=lr)
    pat = PruneOptimizer(torch.optim.AdamW(groups, lr=lr), warmup_steps=0)
    return pat, bare


# ---------------------------------------------------------------------------------------------- the harness
def build(args: argparse.Namespace, *, heads: bool):
    torch.manual_seed(0)
    cfg = TinyGPTConfig(
        vocab_size=args.vocab,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_kv_head=args.n_kv_head,
        d_model=args.d_model,
        d_ff=args.d_ff,
        max_seq_len=args.seq,
    )
    model = TinyGPT(cfg)
    params = dict(model.named_parameters())
    clusters = resolve_clusters(model, demo_preset.tiny_gpt(model, mlp=True, heads=heads))
    clustered = sorted({n for rc in clusters for n in rc.param_names})
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    return model, params, clusters, clustered, tokens


def measure(args: argparse.Namespace, *, heads: bool) -> dict:
    model, params, clusters, clustered, tokens = build(args, heads=heads)
    sparsity = args.sparsity
    snapshot = {n: params[n].detach().clone() for n in clustered}
    live = [params[n].detach() for n in clustered]
    saved = [snapshot[n] for n in clustered]

    def restore() -> None:
        torch._foreach_copy_(live, saved)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()

    pruner = Pruner(model, clusters)
    targets = dict.fromkeys((rc.name for rc in clusters), sparsity)
    with torch.no_grad():
        pruner.step(targets)  # a current mask for `hold`
    restore()
    latents = LatentStore(params, clustered)
    latents.commit()  # creates the copies, as the first ramp step does
    opt_ids = {id(p) for p in model.parameters()}

    def fresh() -> None:
        with torch.no_grad():
            pruner.step(targets)

    def fresh_float32_sums() -> None:  # ablation: what the float64 sums cost (not what the library does)
        original = materializing.ACCUMULATION_DTYPE
        materializing.ACCUMULATION_DTYPE = torch.float32
        try:
            with torch.no_grad():
                pruner.step(targets)
        finally:
            materializing.ACCUMULATION_DTYPE = original

    def hold() -> None:
        with torch.no_grad():
            pruner.hold()

    def latent() -> None:
        with torch.no_grad():
            latents.swap_in(opt_ids)
            latents.commit()

    components: dict[str, Callable[[], None] | None] = {
        "forward+backward": fwd_bwd,
        "naive coupled projection": NaiveProjection(clusters, params, sparsity=sparsity, acc=None),
        "naive, float64 scores": NaiveProjection(clusters, params, sparsity=sparsity, acc=torch.float64),
        "lightning_pat fresh selection": fresh,
        "ablation: fresh selection, float32 sums": fresh_float32_sums,
        "lightning_pat held mask": hold,
        "lightning_pat latent swap + commit": latent,
    }
    pat, bare = torchao_pat(model, sparsity=sparsity, heads=heads, lr=1e-3)
    notes = {}
    if pat is None:
        notes["torchao PAT proximal step"] = bare
        components["torchao PAT proximal step"] = None
    else:
        fwd_bwd()
        pat.step()  # first step: torchao saves its latent copies
        restore()
        components["torchao AdamW step (bare)"] = bare.step
        components["torchao PAT step (AdamW + prox)"] = pat.step

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {k: [] for k, fn in components.items() if fn is not None}
    for r in range(args.warmup + args.rounds):
        fwd_bwd()  # gradients for the optimizer steps (also timed below as the reference)
        for name, fn in components.items():
            if fn is None:
                continue
            restore()
            t0 = clock()
            fn()
            dt = clock() - t0
            if r >= args.warmup:
                times[name].append(dt * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    if pat is not None:
        diffs = [
            p - b
            for p, b in zip(times["torchao PAT step (AdamW + prox)"], times["torchao AdamW step (bare)"], strict=True)
        ]
        med["torchao PAT proximal step"] = max(statistics.median(diffs), 0.0)
    med["lightning_pat latent step (fresh + swap/commit)"] = (
        med["lightning_pat fresh selection"] + med["lightning_pat latent swap + commit"]
    )
    return {"ms": med, "notes": notes, "num_clusters": len(clusters)}


# ---------------------------------------------------------------------------------------------- memory
def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _pruner_bytes(pruner: Pruner) -> int:
    """Tensors the engine holds between steps: the current mask's index tensors and cached channel indices."""
    held = [a.dropped for a in pruner.last.values()] + [a.factors for a in pruner.last.values()]
    for ex in pruner.executors:
        held += [channels for _, channels in ex._channels.values()]
    return _storage_bytes(held)


def memory(args: argparse.Namespace, *, heads: bool) -> dict:
    """Exact tensor bytes each method keeps on top of dense AdamW training (params + grads + two moments)."""
    import copy

    from torch.nn.utils import prune

    model, params, clusters, clustered, _ = build(args, heads=heads)
    dense = 4 * _storage_bytes(params.values())
    clustered_bytes = _storage_bytes(params[n] for n in clustered)
    pruner = Pruner(model, clusters)
    targets = dict.fromkeys((rc.name for rc in clusters), args.sparsity)
    with torch.no_grad():
        pruner.step(targets)
        pruner.hold()  # fills the held mask's channel-index cache
    direct = _pruner_bytes(pruner)
    latents = LatentStore(params, clustered)
    latents.commit()
    latent = direct + _storage_bytes(latents.state_dict().values())
    # Lightning's ModelPruning (torch.nn.utils.prune): weight_orig parameter + weight_mask buffer + recomputed weight
    mp_model = copy.deepcopy(model)
    before = _storage_bytes(list(mp_model.parameters()) + list(mp_model.buffers()))
    mods = [m for n, m in mp_model.named_modules() if n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")]
    if heads:
        mods += [m for n, m in mp_model.named_modules() if n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")]
    for m in mods:
        prune.ln_structured(m, "weight", amount=args.sparsity, n=2, dim=0)
    after = _storage_bytes(
        list(mp_model.parameters()) + list(mp_model.buffers()) + [m.weight for m in mods if hasattr(m, "weight")]
    )
    return {
        "dense_training_bytes": dense,
        "clustered_bytes": clustered_bytes,
        "direct": direct,
        "latent_ramp": latent,
        "latent_after_ramp": direct,
        "model_pruning": after - before,
    }


def memory_table(title: str, mem: dict) -> str:
    dense, cl = mem["dense_training_bytes"], mem["clustered_bytes"]
    lines = [
        f"\n{title}: extra tensor bytes over dense AdamW training ({dense / 2**20:.1f} MiB: params, grads, 2 moments; "
        f"clustered weights {cl / 2**20:.1f} MiB; activations not counted)",
        "| method | extra MiB | vs dense training | copies of the clustered weights |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in (
        ("direct", "lightning_pat direct (every phase)"),
        ("latent_ramp", "lightning_pat latent, during the ramp"),
        ("latent_after_ramp", "lightning_pat latent, after the ramp"),
        ("model_pruning", "ModelPruning ln_structured (same weights)"),
    ):
        b = mem[key]
        lines.append(f"| {label} | {b / 2**20:.3f} | +{100 * b / dense:.3f}% | {b / cl:.3f} |")
    return "\n".join(lines)


ROWS = [
    "forward+backward",
    "naive coupled projection",
    "naive, float64 scores",
    "lightning_pat fresh selection",
    "ablation: fresh selection, float32 sums",
    "lightning_pat held mask",
    "lightning_pat latent swap + commit",
    "lightning_pat latent step (fresh + swap/commit)",
    "torchao PAT proximal step",
]


def table(title: str, res: dict) -> str:
    ms = res["ms"]
    ref, naive = ms["forward+backward"], ms["naive coupled projection"]
    lines = [
        f"\n{title}",
        "| component | ms | % of forward+backward | vs naive projection |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in ROWS:
        if row in ms:
            lines.append(f"| {row} | {ms[row]:.2f} | {100 * ms[row] / ref:.2f}% | {ms[row] / naive:.2f}x |")
        else:
            lines.append(f"| {row} | n/a | n/a | {res['notes'].get(row, 'not measured')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--d_ff", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--n_kv_head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {}
    header = (
        f"TinyGPT {args.n_layer} x (d={args.d_model} / ffn={args.d_ff}), {args.n_head} q / {args.n_kv_head} kv heads, "
        f"batch {args.batch}x{args.seq}, fp32, CPU threads {torch.get_num_threads()}, sparsity {args.sparsity}, "
        f"{args.clock} time, median of {args.rounds} interleaved rounds, torch {torch.__version__}"
    )
    print(header)
    for label, heads in (("MLP only", False), ("MLP + heads", True)):
        res = measure(args, heads=heads)
        res["memory"] = memory(args, heads=heads)
        out[label] = res
        print(table(f"{label} ({res['num_clusters']} clusters)", res), flush=True)
        print(memory_table(label, res["memory"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, **out}, indent=2))
    return out


if __name__ == "__main__":
    main()
