"""Train a tiny GPT on an embedded text while CoupledPruningCallback removes half of its MLP channels and query
groups; print what happened. Runs on CPU in about a minute, no download.

    python examples/demo.py                      # defaults embedded below
    python examples/demo.py --max_steps=20 --warmup_steps=2 --ramp_steps=8

The same classes drive the LightningCLI config ``examples/config/demo.yaml``:

    python -m lightning_pat.cli fit --config examples/config/demo.yaml
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pat import CoupledPruningCallback
from lightning_pat.demo_model import TinyGPT, TinyGPTConfig

TEXT = (
    "Pruning-aware training removes whole channels while the model keeps learning. Every weight that reads or "
    "writes a channel is pruned together, so the channel can later be cut out and the model becomes smaller and "
    "faster. A head of attention is one unit; a query group under grouped-query attention is one unit; a hidden "
    "channel of the feed-forward block is one unit. The schedule warms up, ramps the target up along a cubic curve, "
    "applies the final mask, and then heals: the pruned units stay exactly zero while the rest of the network adapts. "
)


class ByteText(Dataset):
    """Fixed-length windows of the UTF-8 bytes of a text (next-byte prediction)."""

    def __init__(self, text: str, seq_len: int, repeats: int = 64) -> None:
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.data, self.seq_len = data.repeat(repeats), seq_len
        self.num = (self.data.numel() - 1) // seq_len

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextData(pl.LightningDataModule):
    """The embedded demo text as a LightningDataModule."""

    def __init__(self, seq_len: int = 32, batch_size: int = 16) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            ByteText(TEXT, self.seq_len),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )


class TinyGPTModule(pl.LightningModule):
    """Next-byte language modelling with :class:`~lightning_pat.demo_model.TinyGPT`."""

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        n_kv_head: int = 2,
        d_model: int = 64,
        d_ff: int = 256,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = TinyGPT(
            TinyGPTConfig(
                n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=d_model, d_ff=d_ff, max_seq_len=64
            )
        )
        self.lr = lr

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--ramp_steps", type=int, default=150)
    parser.add_argument("--target_sparsity", type=float, default=0.5)
    parser.add_argument("--mode", choices=["latent", "direct"], default="latent")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)

    module = TinyGPTModule()
    pruning = CoupledPruningCallback(
        "tiny_gpt",
        args.target_sparsity,
        warmup_steps=args.warmup_steps,
        ramp_steps=args.ramp_steps,
        every_n_steps=5,
        mode=args.mode,
        preset_options={"mlp": True, "heads": True},
    )
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator=args.accelerator,
        devices=1,
        callbacks=[pruning],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(module, datamodule=TextData())

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    total = sum(p.numel() for p in module.parameters())
    zeros = sum(int((p == 0).sum()) for p in module.parameters())
    print(f"\nsteps: {pruning.step}   final train_loss: {metrics.get('train_loss', float('nan')):.3f}")
    print(
        f"unit sparsity: {metrics.get('pruning/unit_sparsity', 0.0):.3f}   "
        f"clustered-parameter sparsity: {metrics.get('pruning/param_sparsity', 0.0):.3f}"
    )
    print(f"exact zeros: {zeros:,} of {total:,} parameters ({zeros / total:.1%}), removable by a physical shrink")
    for name, idx in pruning.dropped.items():
        print(f"  {name:<16} dropped {len(idx):>3} units: {idx[:8]}{' ...' if len(idx) > 8 else ''}")
    return metrics


if __name__ == "__main__":
    main()
