"""One rank of a multi-process Trainer test (DDP or FSDP1 on CPU); launched per rank by the tests.

    python strategy_worker.py {ddp|fsdp1} MODE:SCORE[,MODE:SCORE...]    e.g. ``fsdp1 latent:rms,latent:auto``

Fits each case in sequence in this one process (one launch per rank for all of a strategy's cases; the module seeds
its own weights and data, so a case does not depend on the fits before it). Prints one ``RESULT {json}`` line per
case with what the test asserts: the case, the mask, the zero rows/columns of the full weights, routes, logged
sparsity, and whether every rank agreed after every step.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_pat import CoupledPruningCallback
from tests.common.dist import finish_worker
from tests.common.lit_models import MLPModule, mlp_cluster


class CPUFSDPStrategy(FSDPStrategy):
    """Test-only: Lightning's FSDPStrategy refuses CPU, but FSDP1 runs on CPU when given ``device_id=cpu``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), use_orig_params=True)


class AgreementCheck(pl.Callback):
    """After every batch: all ranks hold the same step, mask and (for DDP) bitwise-identical weights."""

    def __init__(self, cb: CoupledPruningCallback, *, check_weights: bool) -> None:
        self.cb, self.check_weights, self.disagreements = cb, check_weights, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        checksum = pl_module.fc1.weight.detach().double().sum().item() if self.check_weights else 0.0
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, (self.cb.step, self.cb.dropped, checksum))
        self.disagreements += any(r != records[0] for r in records)


def fit_once(strategy_name: str, mode: str, score: str) -> None:
    module = MLPModule(optimizer="adamw" if strategy_name == "ddp" else "sgd", n_batches=16)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, mode=mode, score=score)
    check = AgreementCheck(cb, check_weights=strategy_name == "ddp")
    strategy = (
        CPUFSDPStrategy(process_group_backend="gloo")
        if strategy_name == "fsdp1"
        else DDPStrategy(process_group_backend="gloo")
    )
    trainer = pl.Trainer(
        max_steps=7,
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        callbacks=[cb, check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    flat_shapes = [tuple(p.shape) for p in trainer.strategy.model.parameters()]
    if strategy_name == "fsdp1":
        context = FullyShardedDataParallel.summon_full_params(trainer.strategy.model)
    else:
        context = torch.no_grad()
    with context:
        w1, b1, w2 = module.fc1.weight.detach(), module.fc1.bias.detach(), module.fc2.weight.detach()
        zero_rows = ((w1 == 0).all(dim=1) & (b1 == 0)).nonzero().flatten().tolist()
        zero_cols = (w2 == 0).all(dim=0).nonzero().flatten().tolist()
    print(
        "RESULT "
        + json.dumps(
            {
                "case": f"{mode}:{score}",
                "rank": dist.get_rank(),
                "step": cb.step,
                "score": cb.score,
                "dropped": cb.dropped,
                "zero_rows": zero_rows,
                "zero_cols": zero_cols,
                "routes": {k: v[0] for k, v in cb.pruner.routes.items()},
                "unit_sparsity": float(trainer.callback_metrics["pruning/unit_sparsity"]),
                "flat_shapes": flat_shapes,
                "disagreements": check.disagreements,
                "activation": cb.controller.run.collectors.act.state_dict()["ema"]["fc2"].tolist()
                if cb.controller.run.collectors.act is not None
                else None,
            }
        ),
        flush=True,
    )


def main(strategy_name: str, cases: str) -> None:
    for case in cases.split(","):
        mode, score = case.split(":")
        fit_once(strategy_name, mode, score)


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_worker()
