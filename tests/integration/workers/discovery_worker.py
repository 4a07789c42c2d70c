"""One rank of the discovery-under-strategies test: ``clusters="auto"`` (traced) under DDP or FSDP2.

    python discovery_worker.py {ddp|fsdp2} {convchain|mlp}

Rank 0 alone traces the module (a meta copy, in ``setup``, before FSDP2 shards it) and broadcasts the declarations
as JSON; the callback then compares the resolved clusters' fingerprints across ranks before training, as for
declared clusters. Prints one ``RESULT {json}`` line: how many times this rank traced, the resolved fingerprints,
routes, the mask, and which rows of the first writer are zero.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import CoupledPruningCallback
from lightning_pat.discovery import entry
from tests.common.cnn_models import INPUTS, MLP, ConvChain, randomize_norms
from tests.common.dist import finish_worker

MODELS = {"convchain": ConvChain, "mlp": MLP}


class Traced(pl.LightningModule):
    def __init__(self, name: str, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = randomize_norms(MODELS[name]())
        self.shape = INPUTS[MODELS[name]]
        self.shard = shard
        self.example_input_array = torch.zeros(self.shape)

    def configure_model(self) -> None:
        if self.shard:
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


TRACES = []
_trace = entry.trace


def _counted_trace(*args, **kwargs):
    """The real trace, counted (which ranks trace is what the test checks)."""
    TRACES.append(1)
    return _trace(*args, **kwargs)


def main(strategy_name: str, model_name: str) -> None:
    entry.trace = _counted_trace
    fsdp2 = strategy_name == "fsdp2"
    module = Traced(model_name, shard=fsdp2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, *module.shape[1:], generator=g)
    with torch.no_grad():
        y = torch.randn(module.model(x).shape, generator=g)
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if fsdp2
        else DDPStrategy(process_group_backend="gloo")
    )
    trainer = pl.Trainer(
        max_steps=5,
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    first = cb.resolved[0].members[0]
    weight = dict(module.named_parameters())[first.name].detach()
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    zero_rows = (weight.flatten(1) == 0).all(dim=1).nonzero().flatten().tolist()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": dist.get_rank(),
                "traces": len(TRACES),
                "names": [rc.name for rc in cb.resolved],
                "fingerprints": [rc.fingerprint() for rc in cb.resolved],
                "routes": {k: v[0] for k, v in cb.pruner.routes.items()},
                "dropped": cb.dropped,
                "first": cb.resolved[0].name,
                "zero_rows": zero_rows,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_worker()
