"""CoupledPruningCallback under DDP on CPU (2 processes, gloo): every rank selects the same units."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_pat import CoupledPruningCallback
from tests.common.lit_models import HIDDEN, MLPModule, mlp_cluster

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


class AgreementCheck(pl.Callback):
    """In every worker: after each step, all ranks hold the same mask and bitwise-identical weights."""

    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb = cb

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        record = (self.cb.step, self.cb.dropped, pl_module.fc1.weight.detach().double().sum().item())
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
        assert all(r == records[0] for r in records), records

    def on_train_end(self, trainer, pl_module):
        assert len(self.cb.dropped["hidden"]) == HIDDEN // 2
        assert torch.all(pl_module.fc1.weight[self.cb.dropped["hidden"]] == 0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_ddp_spawn_two_ranks_agree(mode):
    module = MLPModule(optimizer="adamw", n_batches=16)
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=3, mode=mode)
    trainer = pl.Trainer(
        max_steps=7,
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        callbacks=[cb, AgreementCheck(cb)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    trainer.fit(module)
    # weights come back from rank 0: exactly half the hidden rows are zero, and the metric was logged
    zero_rows = (module.fc1.weight == 0).all(dim=1) & (module.fc1.bias == 0)
    assert int(zero_rows.sum()) == HIDDEN // 2
    assert torch.all(module.fc2.weight[:, zero_rows] == 0)
    assert float(trainer.callback_metrics["pruning/unit_sparsity"]) == pytest.approx(0.5)
