"""Every decoder-only causal LM class of transformers through ``clusters="auto"``: prune, shrink, stock reload (CPU).

    OMP_NUM_THREADS=1 python bench/bench_lmzoo.py --json bench/results/lmzoo.jsonl   # every class: BENCHMARKS.md
    python bench/bench_lmzoo.py --only llama gpt2 phi --timeout 0                   # a few model types
    python bench/bench_lmzoo.py --table bench/results/lmzoo.jsonl                   # the table of a run

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


def run_one(model_type: str, class_name: str, timeout: int) -> dict[str, Any]:
    """One class through the chain (``lm_zoo.chain``) within ``timeout`` seconds."""
    row: dict[str, Any] = {"model_type": model_type, "class": class_name}
    start = time.perf_counter()
    if timeout > 0:  # the main thread only (the smoke test runs without one: --timeout 0)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
    try:
        try:
            model = lm_zoo.build(model_type)
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
    return row


def _fmt(value: float | None, digits: str = ".1e") -> str:
    return "-" if value is None else format(value, digits)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of a run, then the counts."""
    lines = [
        "| class | resolves | exact (rel) | share cut | stock reload (rel) | generate | failure |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    built = [r for r in rows if r.get("builds")]
    for r in built:
        failure = f"{r['stage']}: {r['error']}"[:160] if r.get("error") or r.get("stage") else ""
        if not failure and not r.get("ok"):
            failure = "cut below 20%" if (r.get("cut") or 0) < 0.2 else "not exact"
        lines.append(
            f"| {r['class']} ({r['model_type']}) | {'yes' if r.get('resolves') else 'no'} | {_fmt(r.get('exact'))} "
            f"| {_fmt(r.get('cut'), '.0%')} | {_fmt(r.get('reload'))} | {'yes' if r.get('generates') else 'no'} "
            f"| {failure.replace('|', '/')} |"
        )
    ok = sum(bool(r.get("ok")) for r in built)
    resolves = sum(bool(r.get("resolves")) for r in built)
    exact = sum(r.get("exact") is not None and r["exact"] < lm_zoo.EXACT for r in built)
    lines.append("")
    lines.append(
        f"{len(rows)} decoder-only classes, {len(built)} build from a tiny config: {resolves} resolve, {exact} shrink "
        f"exactly, {ok} pass end to end (exact, >= 20% cut, stock reload equal, generate)."
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
        row = run_one(model_type, class_name, args.timeout)
        rows.append(row)
        status = "ok" if row.get("ok") else (row.get("stage") or "build") + ": " + str(row.get("error", ""))[:100]
        print(f"{model_type:28s} {row['seconds']:6.1f}s {status}", flush=True)
        if args.json is not None:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
