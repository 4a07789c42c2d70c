"""Load one export in a serving engine, generate greedily from token ids, time it, write the tokens as JSON.

Runs in the serving venv (``tools/serve_venv.sh``: vLLM's CPU build, llama-cpp-python), not in the project's venv:
it imports neither lightning_pat nor anything of this repository. bench/bench_serve.py and tests/serve/ start it.

    VLLM_CPU_KVCACHE_SPACE=2 $(tools/serve_venv.sh)/bin/python bench/serve_engines.py --engine vllm \
        --model out/small --prompts prompts.json --max_tokens 32 --out result.json [--trust_remote_code]
    $(LLAMA_CPP=1 tools/serve_venv.sh)/bin/python bench/serve_engines.py --engine llama_cpp \
        --model out/small/model.gguf --prompts prompts.json --max_tokens 32 --out result.json

``prompts.json`` is a list of token-id lists. The result: ``tokens`` (the generated ids per prompt), ``load_s``,
``tokens_per_s`` (generated tokens / wall time of generating them all: vLLM as one batch, llama.cpp one prompt
after the other, as each is used), ``ttft_s`` (median over the prompts of the time from submitting one prompt
alone to its first token: prefill plus one decode step), ``engine`` and its version. EOS does not stop generation
(every prompt yields ``max_tokens`` tokens), and one untimed warm-up generation precedes the timed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        trust_remote_code=args.trust_remote_code,
        seed=0,
    )
    load_s = time.perf_counter() - start
    inputs = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(inputs[:2], greedy, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(inputs, greedy, use_tqdm=False)
    wall = time.perf_counter() - start
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttft = []
    for one in inputs:
        start = time.perf_counter()
        llm.generate([one], first, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "load_s": load_s,
        "tokens": tokens,
        "tokens_per_s": sum(map(len, tokens)) / wall,
        "ttft_s": statistics.median(ttft),
    }


def run_llama_cpp(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import llama_cpp

    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.max_model_len,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=0,
        verbose=False,
    )
    load_s = time.perf_counter() - start

    def greedy(prompt: list[int], n: int) -> tuple[list[int], float]:
        llm.reset()
        out, first = [], 0.0
        begin = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                first = time.perf_counter() - begin
            out.append(int(token))
            if len(out) == n:
                break
        return out, first

    greedy(prompts[0], 4)  # warm-up
    start = time.perf_counter()
    results = [greedy(p, args.max_tokens) for p in prompts]
    wall = time.perf_counter() - start
    tokens = [r[0] for r in results]
    texts = json.loads(Path(args.texts).read_text()) if args.texts else []
    tokenized = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
    return {
        "tokenized": tokenized,
        "add_bos": bool(llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"),
        "engine": "llama_cpp",
        "version": llama_cpp.__version__,
        "load_s": load_s,
        "tokens": tokens,
        "tokens_per_s": sum(map(len, tokens)) / wall,
        "ttft_s": statistics.median(r[1] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "llama_cpp"], required=True)
    parser.add_argument("--model", required=True, help="vLLM: the export directory; llama_cpp: the .gguf file")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--max_model_len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trust_remote_code", action="store_true", help="vLLM: a DeciLM export's config class")
    parser.add_argument("--texts", help="llama_cpp: a JSON list of strings to tokenize with the GGUF's tokenizer")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.prompts) as fh:
        prompts = [[int(t) for t in p] for p in json.load(fh)]
    result = run_vllm(args, prompts) if args.engine == "vllm" else run_llama_cpp(args, prompts)
    with open(args.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":  # vLLM spawns workers that import this module again
    main()
