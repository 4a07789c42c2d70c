"""The demo task as Lightning classes: next-byte prediction on the Python standard library's own source files.

Every Python installation ships its standard library as ``.py`` files, so this task needs no download and gives a
real, held-out validation set: the files are listed in sorted order and every ``val_every``-th file is kept out of
training. The classes are importable by LightningCLI configs (``class_path: lightning_pat.demo.TinyGPTModule``).

Example::

    >>> files = stdlib_sources()
    >>> len(files) > 50 and all(f.suffix == ".py" for f in files)
    True
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from lightning_pat.parallel.comm import dtensor


def stdlib_sources() -> list[Path]:
    """The top-level ``.py`` files of the running interpreter's standard library, sorted by name.

    Returns:
        Paths such as ``.../lib/python3.11/abc.py`` (deterministic for a given Python installation).

    Raises:
        FileNotFoundError: If the standard library directory holds no ``.py`` files (a zip-only install).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"No .py files in the standard library directory {root}.")
    return files


def stdlib_bytes(*, val_every: int = 10, max_bytes: int | None = None) -> tuple[Tensor, Tensor]:
    """The standard library's sources as two byte tensors: train and held-out validation (split by file).

    Args:
        val_every: Every ``val_every``-th file (in sorted order, starting with the 5th) is a validation file.
        max_bytes: Optional cap on the bytes of each split (the first bytes, in file order).

    Returns:
        ``(train, val)``, 1-D ``torch.long`` tensors of byte values in ``[0, 256)``.

    Raises:
        ValueError: If ``val_every`` is smaller than 2.
    """
    if val_every < 2:
        raise ValueError(f"Expected `val_every` >= 2, got {val_every}.")
    train: list[bytes] = []
    val: list[bytes] = []
    for i, path in enumerate(stdlib_sources()):
        (val if i % val_every == val_every // 2 else train).append(path.read_bytes())
    out = []
    for chunks in (train, val):
        data = b"\n".join(chunks)[:max_bytes]
        out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
    return out[0], out[1]


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte tensor for next-byte prediction: ``(x, y)`` with ``y`` shifted by one.

    Args:
        data: 1-D tensor of token ids.
        seq_len: Window length ``T``.
        num_windows: Keep only this many windows, spread evenly over the data (default: all).
    """

    def __init__(self, data: Tensor, seq_len: int, num_windows: int | None = None) -> None:
        total = (data.numel() - 1) // seq_len
        if total < 1:
            raise ValueError(f"Expected more than {seq_len} tokens, got {data.numel()}.")
        count = total if num_windows is None else min(num_windows, total)
        self.starts = (torch.arange(count) * (total // count) * seq_len).tolist()
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[self.starts[i] : self.starts[i] + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class StdlibText(pl.LightningDataModule):
    """Byte-level language modelling data from the standard library's sources (see :func:`stdlib_bytes`).

    Args:
        seq_len: Window length ``T``.
        batch_size: Windows per batch.
        val_windows: Number of validation windows (a fixed set, spread evenly over the held-out files).
        max_bytes: Optional cap on the bytes of each split (small values make tests fast).
        seed: Seed of the training shuffle.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 32,
        val_windows: int = 256,
        max_bytes: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.val_windows = seq_len, batch_size, val_windows
        self.max_bytes, self.seed = max_bytes, seed
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read the sources once (a few MB)."""
        if self.train_data is None:
            self.train_data, self.val_data = stdlib_bytes(max_bytes=self.max_bytes)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training windows (seeded)."""
        self.setup()
        assert self.train_data is not None
        return DataLoader(
            ByteWindows(self.train_data, self.seq_len),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        """The fixed held-out windows, in order."""
        self.setup()
        assert self.val_data is not None
        return DataLoader(ByteWindows(self.val_data, self.seq_len, self.val_windows), batch_size=self.batch_size)


class _NextTokenModule(pl.LightningModule):
    """Next-token prediction with AdamW: the loss, steps and optimizer shared by the demo's modules.

    Subclasses build ``self.model``, set ``self.lr`` and ``self.weight_decay``, and define ``forward`` (ids -> logits).
    """

    lr: float
    weight_decay: float

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of a batch (nats per byte on the byte-level demo data)."""
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """One training step; logs ``train_loss`` (shown in the progress bar)."""
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Logs ``val_loss``, averaged over the validation set."""
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over every parameter."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


class TinyGPTModule(_NextTokenModule):
    """Next-byte language modelling with :class:`~lightning_pat.demo.model.TinyGPT` (AdamW, constant learning rate).

    Args:
        n_layer: Decoder blocks.
        n_head: Query heads.
        n_kv_head: Key/value heads (GQA when fewer than ``n_head``).
        d_model: Residual width.
        d_ff: MLP hidden width.
        max_seq_len: Longest sequence.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        seed: Seed of the weight initialisation.
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        n_kv_head: int = 2,
        d_model: int = 64,
        d_ff: int = 256,
        max_seq_len: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.model = TinyGPT(
            TinyGPTConfig(
                n_layer=n_layer,
                n_head=n_head,
                n_kv_head=n_kv_head,
                d_model=d_model,
                d_ff=d_ff,
                max_seq_len=max_seq_len,
            )
        )
        self.lr, self.weight_decay = lr, weight_decay

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: shard every block and the root with FSDP2 over the data-parallel axis."""
        mesh = self._device_mesh
        if mesh is not None and not dtensor.is_dtensor(self.model.embed.weight):
            fully_shard_blocks(self.model, list(self.model.layers), mesh["data_parallel"])

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, V)``."""
        return self.model(idx)


class CausalLMModule(_NextTokenModule):
    """A Hugging Face causal language model built from a config dict (no download), for next-token prediction.

    Args:
        config: Keyword arguments of the transformers config, including ``model_type`` (e.g. ``"llama"``); for
            the byte-level demo data ``vocab_size`` must be at least 256.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        seed: Seed of the weight initialisation.

    Example::

        >>> module = CausalLMModule({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
        >>> type(module.model).__name__
        'LlamaForCausalLM'
    """

    def __init__(self, config: dict[str, Any], lr: float = 3e-3, weight_decay: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters()
        options = dict(config)
        model_type = options.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"`config` needs a `model_type` such as 'llama', got keys {sorted(config)}.")
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **options))
        self.lr, self.weight_decay = lr, weight_decay

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, V)``."""
        return self.model(input_ids=idx).logits


def fully_shard_blocks(root: torch.nn.Module, blocks: Sequence[torch.nn.Module], mesh: Any) -> None:
    """FSDP2: ``fully_shard`` each block, then the root, over a 1-D device mesh (parameters become DTensors).

    Args:
        root: The model.
        blocks: Its repeated blocks (each becomes one FSDP2 unit).
        mesh: The data-parallel device mesh.
    """
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)
