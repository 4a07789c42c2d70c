"""One rank of test_shrink_on_freeze_tensor_parallel.py (launched per rank): a tiny Qwen3 (per-head ``q_norm`` and
``k_norm``) sharded by ``shard_causal_lm`` from transformers' own ``base_model_tp_plan`` (tensor parallel over 2
ranks, FSDP2 over a data-parallel axis of 1), pruned with ``shrink_on_freeze=True`` through the freeze.

    python mp_tp_family_worker.py OUT_DIR

Both ranks train on the same fixed batch (:func:`tokens`), so the one-process reference (:func:`fit` with
``devices=1``, run by the test) sees the same data. Runs:

1. ``sparsity``: the MLP channels at ``target_sparsity=0.5`` (even kept counts);
2. ``params``: the MLP channels at ``target_params=0.75``: the solver keeps the MLP widths at multiples of the
   tensor-parallel size by itself (the one-process reference declares ``multiple_of=2`` instead).

Rank 0 saves each run's final weights (gathered) to ``OUT_DIR/{run}.pt``; each rank prints one ``RESULT {json}``
line per run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_pat import CoupledPruningCallback, presets
from tests.common import lm_zoo
from tests.common.dist import finish_worker

WARMUP, RAMP, TOTAL = 1, 2, 5  # the freeze is at step 3


def tokens() -> torch.Tensor:
    """The batch of every step (the same on every rank)."""
    return torch.randint(3, lm_zoo.VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))


class LitFamily(pl.LightningModule):
    """A tiny Hugging Face causal LM of ``model_type``; sharded by ``shard_causal_lm`` on a mesh, else plain."""

    def __init__(self, model_type: str = "qwen3") -> None:
        super().__init__()
        self.model = lm_zoo.build(model_type).float().train()

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            from lightning_pat.lm.sharding import shard_causal_lm

            shard_causal_lm(self.model, self.device_mesh)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x = tokens()
        return self.model(input_ids=x[:, :-1], labels=x[:, :-1]).loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):  # noqa: ANN201
        return torch.utils.data.DataLoader(torch.zeros(TOTAL, 1), batch_size=1)


def clusters(module: LitFamily, *, multiple_of: int = 1) -> list:
    """The MLP channels (no heads: 2 KV groups cut to 1 cannot split over 2 ranks; no residual stream: transformers'
    plan leaves the embedding and the final norm off the tensor-parallel mesh, one cluster cannot span two meshes)."""
    found = presets.llama(module, heads=False)
    return [dataclasses.replace(c, multiple_of=multiple_of) if c.name.startswith("mlp") else c for c in found]


def fit(run: str, *, devices: int = 2) -> tuple[LitFamily, CoupledPruningCallback, list[float]]:
    """One fit of ``run`` (see the module docstring) on 2 ranks (tensor parallel 2) or, ``devices=1``, one process."""
    module = LitFamily()
    size = {"target_params": 0.75} if run == "params" else {}
    cb = CoupledPruningCallback(
        clusters(module, multiple_of=2 if devices == 1 and run == "params" else 1),
        None if size else 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, score="rms", shrink_on_freeze=True, **size,
    )  # fmt: skip
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) if devices == 2 else "auto"
    trainer = pl.Trainer(
        max_steps=TOTAL, accelerator="cpu", devices=devices, strategy=strategy, callbacks=[cb, Losses()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return module, cb, losses


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def main(out_dir: Path) -> None:
    for run in ("sparsity", "params"):
        module, cb, losses = fit(run)
        weights = full_weights(module.model)
        if dist.get_rank() == 0:
            torch.save(weights, out_dir / f"{run}.pt")
        out = {
            "run": run, "rank": dist.get_rank(), "dropped": cb.dropped, "losses": losses,
            "shrunk": cb.controller.shrunk is not None,
            "dtensors": all(hasattr(p, "placements") for p in module.parameters()),
            "size": None if cb.controller.run is None or cb.controller.run.size is None
            else cb.controller.run.size.to_dict(),
            "intermediate": module.model.config.intermediate_size,
        }  # fmt: skip
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish_worker()
