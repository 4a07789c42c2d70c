"""Every decoder-only causal LM class of transformers through ``clusters="auto"``: prune, shrink, stock reload (CPU).

    OMP_NUM_THREADS=1 python bench/bench_lmzoo.py --json bench/results/lmzoo.jsonl   # every class: BENCHMARKS.md
    python bench/bench_lmzoo.py --only llama gpt2 phi --timeout 0                   # a few model types
    python bench/bench_lmzoo.py --table bench/results/lmzoo.jsonl                   # the table of a run
    PYTHONPATH=<torch-pruning 1.6.1 folder> python bench/bench_lmzoo.py --only llama qwen3 --tp   # + the columns below
    python bench/bench_lmzoo.py --only qwen3 --tp --no-torch-pruning                # our two columns only

Every ``model_type`` of ``transformers.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose class is a decoder-only LM (not an
encoder used as a decoder, not the decoder of an encoder-decoder, not a multimodal ``...ForConditionalGeneration``)
is built from its default config made tiny (``tests/common/lm_zoo.py``: hidden 64, 2 layers, 4 heads of 16, 2 KV
heads where the family has GQA, vocabulary 128, every parameter jittered), then what a new user runs:
``prune_clusters(model, "auto", 0.5, calibration=[ids, ids])``, ``shrink``, the shrunk logits against the masked
model's (fp32), ``lightning_pat.save_pretrained``, stock ``AutoModelForCausalLM.from_pretrained`` and ``generate()``.

Columns: class; resolves ("auto" found clusters and pruned); exact (relative error of the shrunk logits, < 1e-4);
cut (share of the non-embedding parameters removed); reload (relative error of the stock reload's logits against
the masked model's); the stage that failed and its error. A class whose tiny config does not build, or whose dense
model does not run on it, is listed as not built and not counted.

With ``--tp`` three more columns, each on a fresh copy of the model: *query heads* (a GQA config only: ``"auto"`` with
``preset_options={"query_heads": True}`` at 0.5 cuts query heads inside their KV groups, the KV head count kept,
shrinks exactly and reloads stock with the same logits; else why not); *target_params* (``"auto"`` with
``target_params`` = the embeddings plus 60% of the other parameters: the shrunk model's own count equals the solver's
``achieved``, which is not above the target and one granule below ``above``, and it reloads stock with the same
logits); *Torch-Pruning* (1.6.1, the recipe of its ``examples/LLMs/prune_llm.py`` at ratio 0.5: ``MetaPruner``,
``GroupMagnitudeImportance(p=2, group_reduction="mean")``, ``lm_head`` ignored, ``num_heads`` from the config with
``prune_num_heads=True``, ``prune_head_dims=False``, ``head_pruning_ratio=0.5``, a fused ``gate_up_proj`` in 2 output
groups, ``round_to=4``, the config updated as the recipe does: whether its step and the pruned model's forward run,
the share cut, and whether stock ``from_pretrained`` of its ``save_pretrained`` gives the pruned model's logits).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.common import lm_zoo  # noqa: E402

#: Class-name parts of encoders used as decoders and of encoder-decoder decoders (not decoder-only LMs).
_NOT_DECODER_ONLY = (
    "Bert", "Roberta", "Electra", "Ernie", "RoFormer", "Xmod", "XLM", "XLNet", "Bart", "Blenderbot", "Marian",
    "Pegasus", "PLBart", "ProphetNet", "Mvp", "TrOCR", "Whisper", "Reformer", "BigBird", "Camembert", "Data2Vec",
    "RemBert", "RoCBert", "Musicgen", "Moshi", "Git", "CpmAnt",
)  # fmt: skip


def decoder_only() -> dict[str, str]:
    """``model_type`` -> class name of the decoder-only causal LMs transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    return {
        t: c
        for t, c in sorted(names.items())
        if "ConditionalGeneration" not in c and not any(part in c for part in _NOT_DECODER_ONLY)
    }


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _stock_rel(model: Any, ids: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative error of stock ``from_pretrained``'s logits, ``model`` saved by ``lightning_pat.save_pretrained``."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, overwrite=True, tokenizer=None)
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
        return lm_zoo._rel(lm_zoo._logits(stock, ids), reference)  # noqa: SLF001 - the bench's own helpers


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def query_heads(model_type: str) -> str:
    """``"yes"`` if ``"auto"`` with ``query_heads`` cuts query heads inside the KV groups exactly, with stock reload."""
    from lightning_pat import prune_clusters, shrink
    from lightning_pat.shrink.layer_config import layer_values

    def counts(config: Any) -> tuple[Any, Any]:  # per layer where the config holds them per layer (Dots3-note)
        heads, kv = layer_values(config, "num_attention_heads"), layer_values(config, "num_key_value_heads")
        return (heads[0], kv[0]) if heads and kv and len(heads) == len(kv) == 1 else (heads, kv)

    model = lm_zoo.build(model_type)
    heads, kv = counts(model.config)
    pairs = list(zip(heads, kv, strict=True)) if isinstance(heads, list) and isinstance(kv, list) else [(heads, kv)]
    if not any(isinstance(h, int) and isinstance(k, int) and 0 < k < h for h, k in pairs):
        return "-"  # no GQA
    ids, calibration = lm_zoo.token_ids(), [lm_zoo.token_ids(seed=s) for s in (2, 3)]
    try:
        res = prune_clusters(model, "auto", 0.5, calibration=calibration, preset_options={"query_heads": True})
        masked = lm_zoo._logits(model, ids)  # noqa: SLF001
        small = shrink(model, res, example_input=None)
        new_heads, new_kv = counts(small.config)
        half = [h // 2 for h in heads] if isinstance(heads, list) else heads // 2
        if (new_heads, new_kv) != (half, kv):
            return f"no: heads {heads}/{kv} -> {new_heads}/{new_kv} (query heads / KV heads)"
        exact, reload = lm_zoo._rel(lm_zoo._logits(small, ids), masked), _stock_rel(small, ids, masked)  # noqa: SLF001
    except Exception as err:  # noqa: BLE001 - recorded
        return f"no: {_why(err)}"
    return "yes" if max(exact, reload) < lm_zoo.EXACT else f"no: rel {exact:.1e}, stock reload {reload:.1e}"


def target_params(model_type: str) -> str:
    """``"yes"`` if ``target_params`` (the embeddings + 60% of the rest) lands where the solver says, exact reload."""
    from lightning_pat import prune_clusters, shrink

    model = lm_zoo.build(model_type)
    total = sum(p.numel() for p in model.parameters())
    body = lm_zoo.non_embedding_params(model)
    target = total - body + int(0.6 * body)
    ids, calibration = lm_zoo.token_ids(), [lm_zoo.token_ids(seed=s) for s in (2, 3)]
    try:
        res = prune_clusters(model, "auto", target_params=target, calibration=calibration)
        masked = lm_zoo._logits(model, ids)  # noqa: SLF001
        small = shrink(model, res, example_input=None)
        counted = sum(p.numel() for p in small.parameters())
        size = res.size
        assert size is not None
        if counted != size.achieved or not size.achieved <= target < (size.above or total + 1):
            return f"no: counted {counted:,}, solver {size.achieved:,} (target {target:,}, above {size.above})"
        reload = _stock_rel(small, ids, masked)
    except Exception as err:  # noqa: BLE001 - recorded
        return f"no: {_why(err)}"
    return f"yes ({1 - counted / total:.0%})" if reload < lm_zoo.EXACT else f"no: stock reload {reload:.1e}"


def torch_pruning(model_type: str) -> dict[str, Any]:
    """Torch-Pruning 1.6.1's LLM recipe at 0.5 (see the module docs): runs, share cut, stock reload."""
    try:
        import torch_pruning as tp
    except ImportError as err:
        return {"tp_runs": False, "tp_error": f"{_why(err)} (install torch-pruning==1.6.1 with --no-deps --target)"}
    model = lm_zoo.build(model_type)
    dense = lm_zoo.non_embedding_params(model)
    config = model.config
    ids = lm_zoo.token_ids()
    out: dict[str, Any] = {"tp_runs": False}
    try:
        num_heads: dict[Any, int] = {}
        groups: dict[Any, int] = {}
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        for name, m in model.named_modules():
            if name.endswith("self_attn") and heads:
                if hasattr(m, "q_proj"):
                    num_heads.update({m.q_proj: heads, m.k_proj: kv, m.v_proj: kv})
                elif hasattr(m, "qkv_proj"):
                    num_heads[m.qkv_proj] = heads
            if name.endswith("mlp") and hasattr(m, "gate_up_proj"):
                groups[m.gate_up_proj] = 2
        head = model.get_output_embeddings()
        importance = tp.importance.GroupMagnitudeImportance(p=2, group_reduction="mean")
        pruner = tp.pruner.MetaPruner(
            model, example_inputs=ids[:1], importance=importance,
            global_pruning=False, pruning_ratio=0.5, ignored_layers=[head] if head is not None else [],
            num_heads=num_heads, prune_num_heads=True, prune_head_dims=False, head_pruning_ratio=0.5,
            out_channel_groups=groups, round_to=4, output_transform=lambda o: o.logits,
        )  # fmt: skip
        for group in pruner.step(interactive=True):
            group.prune()
        hidden = head.in_features if head is not None else None
        if hidden is not None and hasattr(config, "hidden_size"):
            config.hidden_size = hidden
        for name, m in model.named_modules():  # the recipe's config update
            if name.endswith("self_attn") and hasattr(m, "q_proj") and isinstance(getattr(m, "head_dim", None), int):
                config.num_attention_heads = m.q_proj.out_features // m.head_dim
                if kv == heads:
                    config.num_key_value_heads = config.num_attention_heads
                m.num_key_value_groups = max(1, config.num_attention_heads // max(1, config.num_key_value_heads))
            elif name.endswith("mlp") and hasattr(m, "gate_proj") and hasattr(config, "intermediate_size"):
                config.intermediate_size = m.gate_proj.out_features
            elif name.endswith("mlp") and hasattr(m, "gate_up_proj") and hasattr(config, "intermediate_size"):
                config.intermediate_size = m.gate_up_proj.out_features // 2
        with torch.no_grad():
            pruned = lm_zoo._logits(model, ids)  # noqa: SLF001
        out.update(tp_runs=True, tp_cut=1 - lm_zoo.non_embedding_params(model) / dense)
        out["tp_reload"] = _stock_rel(model, ids, pruned)
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - recorded (MemoryError included)
        out["tp_error"] = _why(err)
    return out


def run_one(
    model_type: str, class_name: str, timeout: int, *, extra: bool = False, extra_timeout: int = 30, tp: bool = True
) -> dict[str, Any]:
    """One class through the chain (``lm_zoo.chain``) within ``timeout`` seconds (``extra``: the ``--tp`` columns,
    each within ``extra_timeout`` seconds of its own, no limits where ``timeout`` is 0; ``tp``: Torch-Pruning's)."""
    row: dict[str, Any] = {"model_type": model_type, "class": class_name}
    start = time.perf_counter()
    if timeout > 0:  # the main thread only (the smoke test runs without one: --timeout 0)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
    try:
        try:
            model = lm_zoo.build(model_type)
            alone = lm_zoo.standalone_refusal(model)
            if alone is not None:  # built, but not a model that runs on token ids: said, not counted
                row.update(builds=False, error=f"not standalone: {alone}")
                return row
            with torch.no_grad():
                model(lm_zoo.token_ids())  # the dense model must run on the tiny config before anything is judged
        except _Timeout:
            raise
        except Exception as err:  # noqa: BLE001 - recorded (MemoryError included)
            row.update(builds=False, error=f"{type(err).__name__}: {' '.join(str(err).split())[:200]}")
            return row
        row["builds"] = True
        out = lm_zoo.chain(model)
        row.update(
            resolves=out.resolves, exact=out.exact, cut=out.cut, reload=out.reload, generates=out.generates,
            ok=out.ok, stage=out.stage, error=out.error,
        )  # fmt: skip
    except _Timeout:
        row.update(builds=row.get("builds", False), ok=False, stage="timeout", error=f"over {timeout} s")
    finally:
        if timeout > 0:
            signal.alarm(0)
        row["seconds"] = round(time.perf_counter() - start, 1)
    if extra and row.get("builds"):
        steps = [("query_heads", query_heads), ("target_params", target_params), ("tp", torch_pruning)][
            : 3 if tp else 2
        ]
        for key, step in steps:
            if timeout > 0:
                signal.signal(signal.SIGALRM, _alarm)
                signal.alarm(extra_timeout)
            try:
                found = step(model_type)
                row.update(found if isinstance(found, dict) else {key: found})
            except _Timeout:
                why = f"over {extra_timeout} s"
                row.update({"tp_error": why} if key == "tp" else {key: f"no: {why}"})
            finally:
                if timeout > 0:
                    signal.alarm(0)
    return row


def _fmt(value: float | None, digits: str = ".1e") -> str:
    return "-" if value is None else format(value, digits)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of a run, then the counts."""
    extra = any("query_heads" in r for r in rows)
    more = " query heads | target_params | Torch-Pruning runs | its cut | its stock reload (rel) |" if extra else ""
    lines = [
        f"| class | resolves | exact (rel) | share cut | stock reload (rel) | generate |{more} failure |",
        "| --- " * (7 + 5 * extra) + "|",
    ]
    built = [r for r in rows if r.get("builds")]
    for r in built:
        failure = f"{r['stage']}: {r['error']}"[:160] if r.get("error") or r.get("stage") else ""
        if not failure and not r.get("ok"):
            failure = "cut below 20%" if (r.get("cut") or 0) < 0.2 else "not exact"
        cells = ""
        if extra:
            tp = "yes" if r.get("tp_runs") else f"no: {r.get('tp_error', '')}"[:90].replace("|", "/")
            tp = tp if "tp_runs" in r or "tp_error" in r else "-"
            qh, tgt = (str(r.get(k, "-"))[:90].replace("|", "/") for k in ("query_heads", "target_params"))
            cells = f" {qh} | {tgt} | {tp} | {_fmt(r.get('tp_cut'), '.0%')} | {_fmt(r.get('tp_reload'))} |"
        lines.append(
            f"| {r['class']} ({r['model_type']}) | {'yes' if r.get('resolves') else 'no'} | {_fmt(r.get('exact'))} "
            f"| {_fmt(r.get('cut'), '.0%')} | {_fmt(r.get('reload'))} | {'yes' if r.get('generates') else 'no'} "
            f"|{cells} {failure.replace('|', '/')} |"
        )
    ok = sum(bool(r.get("ok")) for r in built)
    resolves = sum(bool(r.get("resolves")) for r in built)
    exact = sum(r.get("exact") is not None and r["exact"] < lm_zoo.EXACT for r in built)
    lines.append("")
    lines.append(
        f"{len(rows)} decoder-only classes, {len(built)} build from a tiny config: {resolves} resolve, {exact} shrink "
        f"exactly, {ok} pass end to end (exact, >= 20% cut, stock reload equal, generate)."
    )
    if extra:
        gqa = [r for r in built if r.get("query_heads", "-") != "-"]
        tp_reload = sum(r.get("tp_reload") is not None and r["tp_reload"] < lm_zoo.EXACT for r in built)
        lines.append(
            f"Query heads: {sum(r['query_heads'] == 'yes' for r in gqa)} of {len(gqa)} GQA classes; target_params: "
            f"{sum(str(r.get('target_params', '')).startswith('yes') for r in built)} of {len(built)}; Torch-Pruning "
            f"1.6.1's LLM recipe: step and forward run on {sum(bool(r.get('tp_runs')) for r in built)}, stock reload "
            f"equal on {tp_reload}."
        )
    not_built = [f"{r['model_type']} ({r['error'][:60]})" for r in rows if not r.get("builds")]
    if not_built:
        lines.append(f"Not built ({len(not_built)}): " + "; ".join(not_built))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="model types to run (default: every decoder-only class)")
    parser.add_argument("--json", type=Path, help="append one JSON row per class to this file")
    parser.add_argument("--table", type=Path, help="print the table of an earlier run's JSON rows and exit")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per class (0: none)")
    parser.add_argument("--max-gib", type=float, default=8.0, help="address-space limit of the process (0: none)")
    parser.add_argument("--tp", action="store_true", help="add query heads, target_params and Torch-Pruning columns")
    parser.add_argument("--tp-timeout", type=int, default=30, help="seconds for each --tp column of a class")
    parser.add_argument("--no-torch-pruning", action="store_true", help="with --tp: our two columns only")
    args = parser.parse_args()
    if args.table is not None:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        print(table(rows))
        return
    if args.max_gib > 0:  # a class whose tiny config still allocates too much fails alone (MemoryError), never OOM
        import resource

        limit = int(args.max_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import transformers

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    classes = decoder_only()
    if args.only:
        classes = {t: c for t, c in classes.items() if t in args.only}
    rows = []
    for model_type, class_name in classes.items():
        row = run_one(
            model_type, class_name, args.timeout, extra=args.tp, extra_timeout=args.tp_timeout,
            tp=not args.no_torch_pruning,
        )  # fmt: skip
        rows.append(row)
        status = "ok" if row.get("ok") else (row.get("stage") or "build") + ": " + str(row.get("error", ""))[:100]
        print(f"{model_type:28s} {row['seconds']:6.1f}s {status}", flush=True)
        if args.json is not None:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
