"""One rank of the DDP test of ``distill_teacher_store="file"`` (2 ranks, gloo on CPU), launched per rank by
``tests/integration/test_teacher_store.py``, in a fresh temporary directory (its cwd). Prints one ``RESULT {json}``:

* ``files``: the teacher files in the checkpoint directory after a fit with a checkpoint after every step;
* ``resumed_teacher_is_warmup_end``: the teacher of a fit resumed from the step-3 checkpoint is bitwise the model's
  weights after the last warmup step, as this rank copied them itself during the first fit;
* ``refused``: the message each rank raised when the file is visible to rank 0 only (each rank is given another
  ``distill_teacher_dir`` and the file is moved out of the checkpoint directory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy

from lightning_pat import CoupledPruningCallback
from tests.common.dist import finish_worker
from tests.common.lit_models import StepDataModule, mlp_cluster

WARMUP = 1


class AtPruningStart(pl.Callback):
    def __init__(self) -> None:
        self.dense: dict = {}
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARMUP:
            self.dense = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def fit(max_steps: int, *, ckpt_path: str | None = None, teacher_dir: str | None = None, save: bool = False):
    cb = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=WARMUP, ramp_steps=3, mode="direct", distill_alpha=0.6,
        distill_teacher_store="file", distill_teacher_dir=teacher_dir,
    )  # fmt: skip
    probe = AtPruningStart()
    callbacks: list = [cb, probe]
    if save:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath="ckpts", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=max_steps, strategy=DDPStrategy(process_group_backend="gloo"), accelerator="cpu", devices=2,
        callbacks=callbacks, logger=False, enable_checkpointing=save, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=".",
    )  # fmt: skip
    trainer.fit(StepDataModule(lr=0.2), ckpt_path=ckpt_path)
    return cb, probe


def main() -> None:
    _, probe = fit(5, save=True)
    rank = dist.get_rank()
    out: dict = {"rank": rank, "files": sorted(p.name for p in Path("ckpts").glob("pat-teacher-*"))}
    cb, _ = fit(6, ckpt_path="ckpts/step=3.ckpt")
    got = cb.teacher.state_dict()
    out["resumed_teacher_is_warmup_end"] = set(got) == set(probe.dense) and all(
        (got[k] == probe.dense[k]).all().item() for k in got
    )
    dist.barrier()
    if rank == 0:  # the file only where rank 0 looks
        Path("only0").mkdir()
        Path("empty").mkdir()
        for path in Path("ckpts").glob("pat-teacher-*"):
            shutil.move(str(path), "only0")
    dist.barrier()
    try:
        fit(6, ckpt_path="ckpts/step=3.ckpt", teacher_dir="only0" if rank == 0 else "empty")
        out["refused"] = None
    except MisconfigurationException as err:
        out["refused"] = str(err)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    finish_worker()
