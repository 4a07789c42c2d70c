"""One rank of the DDP distillation test (2 ranks, gloo on CPU); launched per rank by tests/integration/test_distill.py.

Prints one ``RESULT {json}`` line: whether the teacher agreed across ranks, and the largest difference between the
DDP gradient (after the all-reduce) and the average over ranks of the blended-loss gradients computed by hand in
float64 from every rank's batch, at every step after pruning started.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_pat import CoupledPruningCallback
from tests.common.dist import finish_worker
from tests.common.distill_reference import distill_term
from tests.common.lit_models import MLPModule, mlp_cluster

ALPHA, TEMPERATURE, WARMUP = 0.6, 1.5, 1


def blended(student: nn.Module, teacher: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s, t = student(x), teacher(x)
    return nn.functional.mse_loss(s, y) + distill_term(s, t, alpha=ALPHA, temperature=TEMPERATURE)


class Check(pl.Callback):
    """Listed before the pruning callback: the batch, the parameters and the reduced gradient of every step."""

    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb, self.max_diff, self.checked, self.teacher_disagreements = cb, 0.0, 0, 0
        self.batch: tuple = ()
        self.params: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = tuple(t.clone() for t in batch)
        self.params = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        teacher = self.cb.teacher
        if teacher is None:
            return
        state = {k: v.double() for k, v in teacher.state_dict().items()}
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, sum(v.sum().item() for v in state.values()))
        self.teacher_disagreements += any(s != sums[0] for s in sums)
        batches = [None] * dist.get_world_size()
        dist.all_gather_object(batches, self.batch)
        student, dense = MLPModule().double(), MLPModule().double()
        student.load_state_dict(self.params)
        dense.load_state_dict(state)
        for x, y in batches:
            (blended(student, dense, x.double(), y.double()) / len(batches)).backward()
        for name, param in pl_module.named_parameters():
            ref = dict(student.named_parameters())[name].grad
            self.max_diff = max(self.max_diff, (param.grad.double() - ref).abs().max().item())
        self.checked += 1


def main() -> None:
    module = MLPModule(optimizer="adamw", n_batches=16)
    cb = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=WARMUP, ramp_steps=3, mode="direct", distill_alpha=ALPHA,
        distill_temperature=TEMPERATURE,
    )  # fmt: skip
    check = Check(cb)
    trainer = pl.Trainer(
        max_steps=6, strategy=DDPStrategy(process_group_backend="gloo"), accelerator="cpu", devices=2,
        callbacks=[check, cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    teacher_ids = {id(p) for p in cb.teacher.parameters()}
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": dist.get_rank(),
                "checked": check.checked,
                "max_diff": check.max_diff,
                "teacher_disagreements": check.teacher_disagreements,
                "teacher_in_optimizer": any(
                    id(p) in teacher_ids for g in trainer.optimizers[0].param_groups for p in g["params"]
                ),
                "teacher_grads": sum(p.grad is not None for p in cb.teacher.parameters()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
    finish_worker()
