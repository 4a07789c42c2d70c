"""One rank of the multi-process resume matrix (launched per rank by test_resume_distributed.py).

    python resume_worker.py '[["ddp", "latent", [2, 4, 8], "rms"], ["ddp", "direct", [4], "taylor"], ...]'

For each case ``[kind, mode, stops, score]`` in the JSON list, in sequence in this one process (one launch per rank
for all the cases; each case writes its checkpoints to a folder of its own): runs the fit uninterrupted with a
checkpoint after every step, then, for each K in stops, a fresh module, callback and Trainer resumed from the step-K
checkpoint; prints one ``RESULT {json}`` line per case (with its index as ``case``) with every mismatch (weights of
the whole model, masks and logged sparsity per step) between the resumed runs and the uninterrupted one. ``mp``
shards the MLP with FSDP2 under ModelParallelStrategy (sharded path, latents as DTensors in a distributed
checkpoint); ``mp-full`` writes a full (gathered) checkpoint instead; ``fsdp1`` uses FSDPStrategy (flat parameters,
latents of every rank's flat shard gathered into the callback state; not in the test matrix: FSDP1 checkpointing on
CPU crashes, see test_resume_distributed.py).
"""

from __future__ import annotations

import copy
import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_pat import CoupledPruningCallback
from tests.common.dist import finish_worker
from tests.common.lit_models import MLPModule, StepDataModule, mlp_cluster

TOTAL = 10
SCHEDULE = {"warmup_steps": 2, "ramp_steps": 5, "every_n_steps": 1}


class ShardedStepModule(StepDataModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"])


class CPUFSDPStrategy(FSDPStrategy):
    """Test-only: Lightning's FSDPStrategy refuses CPU, but FSDP1 runs on CPU when given ``device_id=cpu``."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), use_orig_params=True)


class RankStepModule(StepDataModule):
    """Data from (global_step, rank): the ranks see different batches (activation statistics differ per rank)."""

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(10_000 + self.global_step + 7919 * self.global_rank)
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 4, generator=g)
        return MLPModule.training_step(self, (x, y), batch_idx)


class ShardedRankStepModule(RankStepModule):
    """FSDP2-sharded, with per-rank data (data-aware scores under ModelParallelStrategy)."""

    configure_model = ShardedStepModule.configure_model


class Recorder(pl.Callback):
    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb, self.rows = cb, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pruning/")}
        self.rows[self.cb.step] = [copy.deepcopy(self.cb.dropped), logged]


def fit(
    kind: str, mode: str, *, score: str = "rms", ckpt_path: str | None = None, save: str | None = None
) -> tuple[dict, dict, dict]:
    if kind.startswith("mp"):
        cls = ShardedStepModule if score == "rms" else ShardedRankStepModule
    else:
        cls = RankStepModule if score != "rms" else StepDataModule
    module = cls(optimizer="adamw", lr=0.2, seed=0)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, mode=mode, score=score, **SCHEDULE)
    rec = Recorder(cb)
    callbacks = [cb, rec]
    if save:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=save, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    strategy = {
        "mp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "mp-full": lambda: ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        ),
        "fsdp1": lambda: CPUFSDPStrategy(process_group_backend="gloo"),
        "ddp": lambda: DDPStrategy(process_group_backend="gloo"),
    }[kind]()
    trainer = pl.Trainer(
        max_steps=TOTAL,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    context = (
        FullyShardedDataParallel.summon_full_params(trainer.strategy.model) if kind == "fsdp1" else torch.no_grad()
    )
    with context, torch.no_grad():
        weights = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).double().flatten().tolist()
            for n, p in module.named_parameters()
        }
    routes = {k: v[0] for k, v in cb.pruner.routes.items()}
    return weights, rec.rows, routes


def run_case(index: int, kind: str, mode: str, stops: list[int], score: str = "rms") -> None:
    ckpts = f"ckpts-{index}"
    want_w, want_rows, routes = fit(kind, mode, score=score, save=ckpts)
    mismatches = []
    for k in stops:
        path = f"{ckpts}/step={k}.ckpt"
        got_w, rows, _ = fit(kind, mode, score=score, ckpt_path=path)
        if sorted(rows) != list(range(k + 1, TOTAL + 1)):
            mismatches.append(f"k={k}: resumed steps {sorted(rows)}")
        mismatches += [f"k={k} step {s}: {rows[s]} != {want_rows[s]}" for s in rows if rows[s] != want_rows.get(s)]
        mismatches += [f"k={k}: weights of {n} differ" for n in want_w if got_w[n] != want_w[n]]
    masks = [set(want_rows[s][0]["hidden"]) for s in range(SCHEDULE["warmup_steps"] + 1, TOTAL + 1)]
    revived = any(a - b for a, b in zip(masks, masks[1:], strict=False))
    out = {"case": index, "rank": dist.get_rank(), "mismatches": mismatches, "routes": routes, "revived": revived}
    print("RESULT " + json.dumps(out), flush=True)


def main(cases: list[list]) -> None:
    for index, case in enumerate(cases):
        run_case(index, *case)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    finish_worker()
