"""One rank of the sharded ``shrink_on_freeze`` test (launched per rank by test_shrink_on_freeze_sharded.py).

    python mp_shrink_worker.py OUT_DIR

A TinyGPT (``LitTiny`` of ``tests/distributed/workers/model_parallel.py``: FSDP2 per decoder layer and the root,
data-parallel size 2) pruned with ``shrink_on_freeze=True``: warmup 1, ramp 3 (freeze at step 4), 7 steps, a
distributed checkpoint after every step. Each data-parallel rank trains on a batch of its own that depends only on
its rank (:func:`rank_tokens`), so a resumed run sees the same data and the one-process reference trains on both
batches at once (the mean loss over them is the mean of the ranks' losses, which FSDP2 averages). Runs in sequence:

1. ``uninterrupted``: the fit through the freeze; per step the loss and this rank's parameter bytes;
2. ``after``: resumed from the step-6 checkpoint (written after the freeze, small shapes);
3. ``before``: resumed from the step-2 checkpoint (written before the freeze): it freezes and shrinks itself;
4. ``validate``: ``trainer.validate`` of a fresh module from the step-7 checkpoint;
5. ``distill``: a fit with distillation through the freeze, then ``distill-after``: its resume from the step-6
   checkpoint (written after the freeze: a small student, the dense teacher's shards); each also reports its teacher
   (``{name}:teacher``: shapes, this rank's bytes, whether it is sharded);
   ``file`` and ``file-after``: the same with ``distill_teacher_store="file"`` (each rank's teacher shards in a file
   of its own next to the checkpoints, which hold a reference);
   ``full`` and ``full-after``: 5 with full (gathered) checkpoints, the teacher gathered into the callback state
   (written to ``OUT_DIR/ckpts-full``);
   ``tp`` and ``tp-after``: 5 and its resume after the freeze under tensor parallel 2 (sequence-parallel plan, FSDP2
   over a data-parallel axis of 1) on the MLP and residual clusters, both ranks on data-parallel rank 0's batch.

Rank 0 saves the final full weights of every run to ``OUT_DIR/{name}.pt`` (and the teacher's, gathered, to
``OUT_DIR/{name}-teacher.pt``); each rank prints one ``RESULT {json}`` line per run.
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

from lightning_pat import CoupledPruningCallback
from lightning_pat.demo.model import TinyGPT
from tests.common.dist import finish_worker
from tests.distributed.workers.model_parallel import CFG, CLUSTERS, LitTiny

WARMUP, RAMP, TOTAL = 1, 3, 7  # the freeze is at step WARMUP + RAMP = 4


def rank_tokens(dp_rank: int) -> torch.Tensor:
    """The batch of data-parallel rank ``dp_rank`` at every step."""
    g = torch.Generator().manual_seed(10_000 + 7919 * dp_rank)
    return torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g)


class RankTiny(LitTiny):
    """LitTiny on its data-parallel rank's fixed batch; on one device (no mesh) unsharded, on every rank's batches.

    The model gets a config of its own: the shrink rewrites the model's config (head counts, widths) in place.
    """

    def __init__(self, dp: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(dataclasses.replace(CFG))
        self.dp = dp  # the data-parallel ranks whose batches one process trains on at once

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            super().configure_model()

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.device_mesh is None:
            x = torch.cat([rank_tokens(rank) for rank in range(self.dp)])
        else:
            x = rank_tokens(self.device_mesh["data_parallel"].get_local_rank())
        return super().training_step((x,), batch_idx)

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):  # noqa: ANN201
        return self.train_dataloader()


def local_bytes(module: torch.nn.Module) -> int:
    """This rank's bytes of ``module``'s parameters (a DTensor's local shard)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class Record(pl.Callback):
    """Listed after the pruning callback: the loss and this rank's parameter bytes after every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.bytes: list[int] = []
        self.dtensors: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))
        self.bytes.append(local_bytes(pl_module))
        self.dtensors.append(all(hasattr(p, "placements") for p in pl_module.parameters()))


#: under tensor parallel: the MLP channels and the residual stream (the 2 KV groups cut to 1 cannot split over 2 ranks)
TP_CLUSTERS = [c for c in CLUSTERS if not c.name.startswith("heads")]


def make_callback(*, distill: bool = False, tp: int = 1, store: str = "checkpoint") -> CoupledPruningCallback:
    return CoupledPruningCallback(
        CLUSTERS if tp == 1 else TP_CLUSTERS, 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, score="rms",
        shrink_on_freeze=True,
        distill_alpha=0.5 if distill else 0.0, distill_module="model" if distill else "", distill_teacher_store=store,
    )  # fmt: skip


def fit(
    ckpts: str | None, *, ckpt_path: str | None = None, distill: bool = False, devices: int = 2, dcp: bool = True,
    tp: int = 1, store: str = "checkpoint",
):  # fmt: skip
    cb, record = make_callback(distill=distill, tp=tp, store=store), Record()
    callbacks: list = [cb, record]
    if ckpts is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    strategy = (
        ModelParallelStrategy(data_parallel_size=2 // tp, tensor_parallel_size=tp, save_distributed_checkpoint=dcp)
        if devices == 2
        else "auto"
    )
    trainer = pl.Trainer(
        max_steps=TOTAL, accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks, logger=False,
        enable_checkpointing=ckpts is not None, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1,
    )  # fmt: skip
    module = RankTiny(dp=2 // tp)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, cb, record, trainer


def validate(ckpt_path: str):
    """``trainer.validate`` of a fresh full-size module from a checkpoint written after the freeze."""
    cb, record = make_callback(), Record()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, logger=False, callbacks=[cb, record], limit_val_batches=1,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = RankTiny()
    trainer.validate(module, ckpt_path=ckpt_path, verbose=False)
    record.bytes = [local_bytes(module)]
    record.losses = [float(trainer.callback_metrics["val_loss"])]
    return module, cb, record, trainer


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def report(name: str, out_dir: Path, module, cb, record, trainer) -> None:  # noqa: ANN001
    weights = full_weights(module)
    if dist.get_rank() == 0:
        torch.save(weights, out_dir / f"{name}.pt")
    out = {
        "run": name, "rank": dist.get_rank(), "dropped": cb.dropped, "step": cb.step, "losses": record.losses,
        "bytes": record.bytes, "dtensors": record.dtensors, "shrunk": cb.controller.shrunk is not None,
        "optimizer_params_are_module_params": [id(p) for opt in trainer.optimizers for g in opt.param_groups
                                               for p in g["params"]] == [id(p) for p in module.parameters()],
    }  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def report_distilled(name: str, out_dir: Path, module, cb, record, trainer) -> None:  # noqa: ANN001
    """:func:`report`, then the teacher's record: its shapes, this rank's bytes of it, its full weights (rank 0)."""
    report(name, out_dir, module, cb, record, trainer)
    teacher = full_weights(cb.teacher)
    if dist.get_rank() == 0:
        torch.save(teacher, out_dir / f"{name}-teacher.pt")
    out = {
        "run": f"{name}:teacher", "rank": dist.get_rank(), "teacher_bytes": local_bytes(cb.teacher),
        "teacher_dtensors": all(hasattr(p, "placements") for p in cb.teacher.parameters()),
        "teacher_shapes": {n: list(p.shape) for n, p in cb.teacher.named_parameters()},
        "student_shapes": {n: list(p.shape) for n, p in module.model.named_parameters()},
    }  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def main(out_dir: Path) -> None:
    report("uninterrupted", out_dir, *fit("ckpts"))
    for name, stop in (("after", 6), ("before", 2)):
        report(name, out_dir, *fit(f"ckpts-{name}", ckpt_path=f"ckpts/step={stop}.ckpt"))
    module, cb, record, trainer = validate("ckpts/step=7.ckpt")
    report("validate", out_dir, module, cb, record, trainer)
    report_distilled("distill", out_dir, *fit("ckpts-distill", distill=True))
    report_distilled("distill-after", out_dir, *fit(None, ckpt_path="ckpts-distill/step=6.ckpt", distill=True))
    report_distilled("file", out_dir, *fit("ckpts-file", distill=True, store="file"))  # the teacher's shard files
    report_distilled("file-after", out_dir, *fit(None, ckpt_path="ckpts-file/step=6.ckpt", distill=True, store="file"))
    for name in ("full", "full-after"):  # a full (gathered) checkpoint: the distilled fit, resumed after the freeze
        ckpts = out_dir / "ckpts-full"  # kept: `lightning-pat shrink` reads its last checkpoint afterwards
        ckpt = str(ckpts / "step=6.ckpt") if name == "full-after" else None
        report_distilled(name, out_dir, *fit(str(ckpts) if ckpt is None else None, ckpt_path=ckpt, dcp=False,
                                             distill=True))  # fmt: skip
    report_distilled("tp", out_dir, *fit("ckpts-tp", tp=2, distill=True))  # FSDP2 (a data-parallel axis of 1) x TP 2
    report_distilled("tp-after", out_dir, *fit(None, ckpt_path="ckpts-tp/step=6.ckpt", tp=2, distill=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish_worker()
