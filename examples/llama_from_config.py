"""Prune a transformers Llama built from a config (nothing downloaded) with the `llama` preset.

The preset reads the layout from the model: MLP channels (`gate/up` rows, `down` columns) and GQA query groups
(a KV head's `k/v` rows with its query heads' `q` rows and `o` columns) of every layer. The same preset serves
Mistral and Qwen2 models. After training, `lightning_pat.shrink` cuts the dropped units out and the model is saved
with `save_pretrained`; `AutoModelForCausalLM.from_pretrained` loads it back with no lightning_pat code.

    python examples/llama_from_config.py
    python examples/llama_from_config.py --max_steps=8 --warmup_steps=2 --ramp_steps=3 --max_bytes=100000
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_pat import CoupledPruningCallback
from lightning_pat.cli import StepProgressBar
from lightning_pat.demo import CausalLMModule, StdlibText
from lightning_pat.demo.threads import use_cpu_threads

CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,  # the demo data are bytes
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,  # GQA: query groups of 2 heads
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--warmup_steps", type=int, default=50)
    parser.add_argument("--ramp_steps", type=int, default=100)
    parser.add_argument("--max_bytes", type=int, default=None, help="cap the data (tests)")
    parser.add_argument("--output_dir", default=None, help="where to save the shrunk model (default: a temp dir)")
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)

    pl.seed_everything(0)
    module = CausalLMModule(CONFIG)
    pruning = CoupledPruningCallback(
        "llama", 0.5, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps, every_n_steps=5
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="auto",
        devices=1,
        callbacks=[pruning, StepProgressBar()],
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=4,
        num_sanity_val_steps=0,
    )
    data = StdlibText(max_bytes=args.max_bytes)
    trainer.fit(module, datamodule=data)
    (val,) = trainer.validate(module, datamodule=data, verbose=False)
    print(f"\nsteps: {pruning.step}   held-out val_loss: {val['val_loss']:.3f}   dropped units:")
    units = {rc.name: rc.num_units for rc in pruning.resolved}
    for name, idx in pruning.dropped.items():
        print(f"  {name:<8} {len(idx):>3} of {units[name]}: {idx[:6]}{' ...' if len(idx) > 6 else ''}")

    from transformers import AutoModelForCausalLM

    from lightning_pat import save_pretrained, shrink

    model = module.model.eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked = model(x).logits
    shrink(model, pruning)  # in place: still a LlamaForCausalLM, with a smaller config
    cfg = model.config
    print(
        f"shrunk: intermediate_size {cfg.intermediate_size}, heads {cfg.num_attention_heads}, "
        f"kv heads {cfg.num_key_value_heads}, parameters {sum(p.numel() for p in model.parameters()):,}"
    )
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="llama-shrunk-"))
    save_pretrained(model, out, overwrite=True)  # model.save_pretrained(out), plus what a stock config cannot express
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False).eval()  # stock transformers
    with torch.no_grad():
        diff = float((reloaded(x).logits - masked).abs().max())
    print(f"saved to {out}; reloaded with AutoModelForCausalLM: max |logits - masked logits| = {diff:.1e}")
    return {"val_loss": val["val_loss"], "max_abs_diff": diff, "intermediate_size": cfg.intermediate_size}


if __name__ == "__main__":
    main()
