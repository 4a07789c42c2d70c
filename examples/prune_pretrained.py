"""Prune a pretrained checkpoint you already have: load it, fine-tune it prune-aware, shrink it, save it.

Pass a Hugging Face causal-LM directory (`save_pretrained` output) with `--model_dir`; the preset is detected from
the model (Llama, Mistral, Qwen2/3, GPT-2). Its tokenizer, if the directory has one, tokenizes the fine-tuning text
(here: the Python standard library's sources). Without `--model_dir` the example first writes a tiny local stand-in
(a Llama with random weights and a byte vocabulary, saved with `save_pretrained` to a temp dir), so that it runs
anywhere without a download; the steps after that are the ones you would run on your own checkpoint.

    python examples/prune_pretrained.py --model_dir path/to/checkpoint --target_sparsity=0.3 --max_steps=2000
    python examples/prune_pretrained.py --max_steps=8 --ramp_steps=4      # the stand-in, a few seconds
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lightning_pat import CoupledPruningCallback, load_pretrained, save_pretrained, shrink
from lightning_pat.cli import StepProgressBar
from lightning_pat.demo import ByteWindows, stdlib_bytes
from lightning_pat.demo.threads import use_cpu_threads


def write_stand_in(directory: Path) -> Path:
    """A tiny Llama checkpoint on disk, standing in for the one you already have."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def token_ids(model_dir: Path, max_bytes: int | None) -> torch.Tensor:
    """The fine-tuning text as token ids: the checkpoint's tokenizer if it has one, else bytes."""
    train, _ = stdlib_bytes(max_bytes=max_bytes)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError):  # no tokenizer files: a byte-level model such as the stand-in
        return train
    return torch.tensor(tokenizer(bytes(train.tolist()).decode(errors="replace"))["input_ids"])


class FineTune(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=None, help="your checkpoint (default: a tiny stand-in)")
    parser.add_argument("--output_dir", type=Path, default=None, help="default: <model_dir>-pruned")
    parser.add_argument("--target_sparsity", type=float, default=0.5)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--ramp_steps", type=int, default=100, help="no warmup: the checkpoint is already trained")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--max_bytes", type=int, default=300_000)
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)
    pl.seed_everything(0)

    model_dir = args.model_dir or write_stand_in(Path(tempfile.mkdtemp(prefix="stand-in-")) / "checkpoint")
    output_dir = args.output_dir or model_dir.with_name(model_dir.name + "-pruned")
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False)  # 1. load
    dense_params = sum(p.numel() for p in model.parameters())
    loader = DataLoader(
        ByteWindows(token_ids(model_dir, args.max_bytes), args.seq_len),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )

    pruning = CoupledPruningCallback("auto", args.target_sparsity, warmup_steps=0, ramp_steps=args.ramp_steps)
    trainer = pl.Trainer(  # 2. prune-aware fine-tuning: ramp to the target, then heal with a frozen mask
        max_steps=args.max_steps,
        accelerator="auto",
        devices=1,
        callbacks=[pruning, StepProgressBar()],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(FineTune(model, args.lr), loader)

    model.eval()
    x = next(iter(loader))[0][:2]
    with torch.no_grad():
        masked = model(input_ids=x).logits
    shrink(model, pruning)  # 3. cut the dropped units out (in place)
    path = save_pretrained(model, output_dir, overwrite=True)  # 4. save: config.json describes the new sizes
    reloaded = load_pretrained(path).eval()
    with torch.no_grad():
        diff = float((reloaded(input_ids=x).logits - masked).abs().max())
    small_params = sum(p.numel() for p in reloaded.parameters())
    print(f"\nloaded {model_dir} ({dense_params:,} parameters), fine-tuned {pruning.step} steps while pruning")
    print(f"saved {path} ({small_params:,} parameters, {small_params / dense_params:.0%} of the original)")
    print(f"reloaded export vs the pruned model: max |logits diff| = {diff:.1e}")
    return {"dense_params": dense_params, "small_params": small_params, "max_abs_diff": diff}


if __name__ == "__main__":
    main()
