"""Load one export in a serving engine, generate greedily from token ids, time it, write the tokens as JSON.

Runs in the serving venv (``tools/serve_venv.sh``: vLLM's CPU build, llama-cpp-python), not in the project's venv:
it imports neither lightning_pat nor anything of this repository. bench/bench_serve.py and tests/serve/ start it.

    VLLM_CPU_KVCACHE_SPACE=2 $(tools/serve_venv.sh)/bin/python bench/serve_engines.py --engine vllm \
        --model out/small --prompts prompts.json --max_tokens 32 --out result.json [--trust_remote_code]
    $(LLAMA_CPP=1 tools/serve_venv.sh)/bin/python bench/serve_engines.py --engine llama_cpp \
        --model out/small/model.gguf --prompts prompts.json --max_tokens 32 --out result.json

``prompts.json`` is a list of token-id lists. The result is a JSON list, one entry per model: ``tokens`` (the
generated ids per prompt), ``load_s``, ``tokens_per_s`` (generated tokens / wall time of generating them all: vLLM as
one batch, llama.cpp one prompt after the other, as each is used; the best of ``--reps`` repetitions, all of them in
``tokens_per_s_reps``), ``ttft_s`` (time from submitting one prompt alone to its first token, prefill plus one
step: per prompt the best repetition, the median over prompts), ``engine`` and its version. Several ``.gguf`` files
are timed in one llama.cpp process, prompt by prompt in turn. EOS does not stop generation (every prompt yields
``max_tokens`` tokens); an untimed warm-up precedes the timed runs; llama.cpp keeps its KV cache in fp32.

``--profile`` (vLLM): the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, after the timed
runs, one more generation of all prompts runs under ``torch.profiler``; the result's ``profile`` lists every op with
its call count and self CPU time (ms), most time first: what two exports compute, op for op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    if args.profile:  # before vLLM is imported: its engine core then runs in this process, under the profiler
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    [model] = args.model
    start = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        trust_remote_code=args.trust_remote_code,
        seed=0,
    )
    load_s = time.perf_counter() - start
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(inputs[:2], greedy, use_tqdm=False)  # warm-up
    speeds, ttft, tokens = [], [[] for _ in inputs], None
    for _ in range(args.reps):
        start = time.perf_counter()
        outputs = llm.generate(inputs, greedy, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        speeds.append(sum(map(len, tokens)) / wall)
        for i, one in enumerate(inputs):
            start = time.perf_counter()
            llm.generate([one], first, use_tqdm=False)
            ttft[i].append(time.perf_counter() - start)
    result = _result("vllm", vllm.__version__, load_s, tokens, speeds, ttft)
    if args.profile:
        result["profile"] = _profile(lambda: llm.generate(inputs, greedy, use_tqdm=False))
    return [result]


def _profile(run: Any) -> list[dict]:
    """Every op ``run()`` calls: name, calls, self CPU ms, most time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in prof.key_averages()]
    return sorted(ops, key=lambda o: -o["self_cpu_ms"])


def _result(engine: str, version: str, load_s: float, tokens: list, speeds: list, ttft: list[list[float]]) -> dict:
    """Tokens/s: the best repetition and all of them; TTFT: per prompt the best repetition, median over prompts."""
    return {
        "engine": engine,
        "version": version,
        "load_s": load_s,
        "tokens": tokens,
        "tokens_per_s": max(speeds),
        "tokens_per_s_reps": speeds,
        "ttft_s": statistics.median(min(t) for t in ttft),
        "ttft_s_median_reps": statistics.median(statistics.median(t) for t in ttft),
    }


def run_llama_cpp(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    """Every model of ``--model`` in this one process; each repetition runs every prompt on every model in turn, so
    that the models are timed side by side (a machine whose load drifts favours none)."""
    import llama_cpp

    models, load_s = [], []
    for path in args.model:
        start = time.perf_counter()
        models.append(
            llama_cpp.Llama(
                model_path=path,
                n_ctx=args.max_model_len,
                n_threads=args.threads,
                n_threads_batch=args.threads,
                type_k=llama_cpp.GGML_TYPE_F32,  # the KV cache in fp32 too (llama.cpp's default is f16)
                type_v=llama_cpp.GGML_TYPE_F32,
                seed=0,
                verbose=False,
            )
        )
        load_s.append(time.perf_counter() - start)

    def greedy(llm: Any, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        llm.reset()
        out, first = [], 0.0
        begin = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                first = time.perf_counter() - begin
            out.append(int(token))
            if len(out) == n:
                break
        return out, first, time.perf_counter() - begin

    for llm in models:
        greedy(llm, prompts[0], 4)  # warm-up
    walls = [[0.0] * args.reps for _ in models]
    ttft = [[[] for _ in prompts] for _ in models]
    tokens: list[list[list[int]]] = [[[] for _ in prompts] for _ in models]
    for rep in range(args.reps):
        for i, prompt in enumerate(prompts):
            for m, llm in enumerate(models):
                out, first, wall = greedy(llm, prompt, args.max_tokens)
                tokens[m][i], walls[m][rep] = out, walls[m][rep] + wall
                ttft[m][i].append(first)
    texts = json.loads(Path(args.texts).read_text()) if args.texts else []
    results = []
    for m, llm in enumerate(models):
        n = sum(map(len, tokens[m]))
        result = _result("llama_cpp", llama_cpp.__version__, load_s[m], tokens[m], [n / w for w in walls[m]], ttft[m])
        result["tokenized"] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
        result["add_bos"] = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "llama_cpp"], required=True)
    parser.add_argument(
        "--model", nargs="+", required=True, help="vLLM: the export directory; llama_cpp: .gguf files (timed in turn)"
    )
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=1, help="timed repetitions (the tokens are those of the last)")
    parser.add_argument("--max_model_len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trust_remote_code", action="store_true", help="vLLM: a DeciLM export's config class")
    parser.add_argument("--profile", action="store_true", help="vLLM: in-process, and an op profile (see above)")
    parser.add_argument("--texts", help="llama_cpp: a JSON list of strings to tokenize with the GGUF's tokenizer")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.prompts) as fh:
        prompts = [[int(t) for t in p] for p in json.load(fh)]
    if args.engine == "vllm" and len(args.model) != 1:
        parser.error("--engine vllm takes one --model")
    result = run_vllm(args, prompts) if args.engine == "vllm" else run_llama_cpp(args, prompts)
    with open(args.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":  # vLLM spawns workers that import this module again
    main()
