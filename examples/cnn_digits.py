"""A small CNN on scikit-learn's 8x8 digits, pruned with `clusters="auto"`: the coupled channels are discovered by
tracing the model (no declarations, no preset), pruned during training, then cut out with `lightning_pat.shrink`.

The network: conv-BN-ReLU, a residual block (two conv-BN with a skip connection), max-pooling, flatten and two
Linear layers. Discovery finds the first conv's channels (coupled through the residual addition with the block's
second conv), the block's inner channels, and the hidden units of the classifier head; the flatten makes the first
Linear read 4*4 columns per channel. The logits are never pruned. The same network is trained without pruning for
comparison.

    python examples/cnn_digits.py
    python examples/cnn_digits.py --max_steps=20 --warmup_steps=4 --ramp_steps=8
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import CoupledPruningCallback, discover, shrink
from lightning_pat.demo.threads import use_cpu_threads


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digit images as 1x8x8 tensors in [0, 1], split 80/20 into train and held-out test."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


class SmallCNN(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.fc1, self.fc2 = nn.Linear(width * 4 * 4, hidden), nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn0(self.stem(x)))
        y = F.relu(y + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(y))))))
        y = F.max_pool2d(y, 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(y, 1))))


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SmallCNN()
        self.lr = lr
        self.example_input_array = torch.zeros(2, 1, 8, 8)  # what clusters="auto" traces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@torch.no_grad()
def accuracy(net: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float((net(x).argmax(-1) == y).float().mean())


@torch.no_grad()
def forward_seconds(nets: dict[str, nn.Module], x: torch.Tensor, reps: int) -> dict[str, float]:
    """Median forward time of each network, interleaved (the same machine load for both)."""
    times: dict[str, list[float]] = {name: [] for name in nets}
    for net in nets.values():
        net(x)  # warm-up
    for _ in range(reps):
        for name, net in nets.items():
            start = time.perf_counter()
            net(x)
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


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
    parser.add_argument("--max_steps", type=int, default=400)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--ramp_steps", type=int, default=150)
    parser.add_argument("--target_sparsity", type=float, default=0.5)
    parser.add_argument("--speed_reps", type=int, default=30)
    args = parser.parse_args(argv)
    print(use_cpu_threads())  # never more threads than free CPUs (OMP_NUM_THREADS wins)
    _, test = digits()

    print(discover(Classifier(), torch.zeros(2, 1, 8, 8)).table())
    dense = fit(args, [])
    pruning = CoupledPruningCallback(
        "auto", args.target_sparsity, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps
    )
    pruned = fit(args, [pruning])
    acc = {"dense": accuracy(dense, test), "pruned": accuracy(pruned, test)}
    x = test.tensors[0]
    with torch.no_grad():
        logits = pruned(x)
        shrink(pruned, pruning)
        diff = float((pruned(x) - logits).abs().max())
    acc["shrunk"] = accuracy(pruned, test)
    net = pruned.net
    widths = [net.stem.out_channels, net.conv1.out_channels, net.fc1.out_features]
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("dense", dense), ("shrunk", pruned))}
    batch = torch.cat([x] * 2)[:256]
    secs = forward_seconds({"dense": dense, "shrunk": pruned}, batch, args.speed_reps)
    print(f"\nclusters (auto, discovered): {[rc.name for rc in pruning.resolved]}")
    print(f"held-out accuracy on {len(test)} digits, {args.max_steps} training steps each:")
    print(f"  dense   {acc['dense']:.3f}   widths [64, 64, 256]   {params['dense']:,} parameters")
    print(f"  pruned  {acc['pruned']:.3f}   {args.target_sparsity:.0%} of the discovered units pruned during training")
    print(f"  shrunk  {acc['shrunk']:.3f}   widths {widths}   {params['shrunk']:,} parameters")
    print(f"shrunk vs pruned: max |logits diff| = {diff:.2e}")
    speedup = secs["dense"] / secs["shrunk"]
    print(
        f"forward, batch {len(batch)}, CPU: dense {secs['dense'] * 1e3:.2f} ms, shrunk {secs['shrunk'] * 1e3:.2f} ms "
        f"(x{speedup:.2f}; median of {args.speed_reps} interleaved runs, noisy on a shared machine)"
    )
    return {**acc, "diff": diff, "widths": widths, "speedup": speedup}


if __name__ == "__main__":
    main()
