"""Not a language model: prune a plain `nn.Sequential` classifier on scikit-learn's handwritten digits.

The `linear_chain` preset pairs consecutive `nn.Linear` layers of an `nn.Sequential`: the hidden units of layer i
are the rows (and bias) of its Linear and the columns of the next one. Here 75% of both hidden layers' units are
pruned during training. The same network is trained without pruning for comparison; then `lightning_pat.shrink`
turns the pruned network into a small dense one with the same predictions.

    python examples/mlp_digits.py
    python examples/mlp_digits.py --max_steps=20 --warmup_steps=4 --ramp_steps=8
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import CoupledPruningCallback
from lightning_pat.demo.threads import use_cpu_threads


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digit images (scaled to [0, 1]) split 80/20 into train and held-out test."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 2e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=self.lr)


@torch.no_grad()
def accuracy(net: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float((net(x).argmax(-1) == y).float().mean())


def fit(args, callbacks: list) -> Classifier:
    model = Classifier()
    train, _ = digits()
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return model.eval()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=600)
    parser.add_argument("--warmup_steps", type=int, default=150)
    parser.add_argument("--ramp_steps", type=int, default=250)
    parser.add_argument("--target_sparsity", type=float, default=0.75)
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)
    _, test = digits()

    dense = fit(args, [])
    pruning = CoupledPruningCallback(
        "linear_chain", args.target_sparsity, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps
    )
    pruned = fit(args, [pruning])
    acc = {"dense": accuracy(dense.net, test), "pruned": accuracy(pruned.net, test)}

    from lightning_pat import shrink

    logits = pruned.net(test.tensors[0]).detach()
    shrink(pruned, pruning)
    acc["shrunk"] = accuracy(pruned.net, test)
    same = bool(torch.equal(pruned.net(test.tensors[0]).argmax(-1), logits.argmax(-1)))
    widths = [m.out_features for m in pruned.net if isinstance(m, nn.Linear)][:-1]
    params = {name: sum(p.numel() for p in m.net.parameters()) for name, m in (("dense", dense), ("shrunk", pruned))}
    print(f"\nheld-out accuracy on {len(test)} digits, {args.max_steps} training steps each:")
    print(f"  dense   {acc['dense']:.3f}   hidden widths [256, 256]   {params['dense']:,} parameters")
    print(f"  pruned  {acc['pruned']:.3f}   {args.target_sparsity:.0%} of hidden units pruned during training")
    print(f"  shrunk  {acc['shrunk']:.3f}   hidden widths {widths}   {params['shrunk']:,} parameters")
    print(f"shrunk predictions identical to the pruned network's: {same}")
    return {**acc, "same_predictions": same, "widths": widths}


if __name__ == "__main__":
    main()
