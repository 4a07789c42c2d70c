"""One rank of the ModelParallelStrategy distillation test (launched per rank by test_distill_model_parallel.py).

    python mp_distill_worker.py DP TP CASE[,CASE...]    with CASE = {dcp|full}:STOP[:user|:file]

A TinyGPT sharded in ``configure_model`` (``LitTiny`` of ``distributed/workers/model_parallel.py``: FSDP2 over the
data-parallel axis, a sequence-parallel TP plan when TP > 1) distils from the default teacher (a frozen copy sharded
like it). The fit runs uninterrupted with a checkpoint after every step, then again resumed from the step-STOP
checkpoint. The cases run in sequence in one process per rank, each with a checkpoint folder of its own. Prints one
``RESULT {json}`` line per case (its index as ``case``):

* ``max_rel_diff``: at every distilled step, the largest difference between the sharded gradient (gathered) and
  the float64 gradient of ``CE + alpha * T^2 * KL(teacher || student)`` computed by hand from every data-parallel
  rank's batch (averaged over them, as FSDP2 averages), relative to the reference's largest entry;
* the teacher: bitwise the model at the warmup end, never moved, no gradient, not in the optimizer, laid out like
  the student, one forward per step, its bytes logged as ``pruning/teacher_bytes``;
* ``resume_mismatches``: weights and teacher of the resumed run vs the uninterrupted one (bitwise).

With ``user``, the teacher is the user's: a second TinyGPT sharded by the user in ``configure_model``. With
``file``, ``distill_teacher_store="file"``: ``teacher_files`` lists the teacher files in the checkpoint directory and
``teacher_keys_in_ckpt`` the teacher entries of the step-STOP checkpoint (model state and callback state).
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_pat import CoupledPruningCallback
from lightning_pat.demo.model import TinyGPT
from lightning_pat.parallel.teacher import local_nbytes
from tests.common.dist import finish_worker
from tests.common.distill_reference import distill_term
from tests.distributed.workers.model_parallel import CFG, CLUSTERS, LitTiny, _tp_plan

ALPHA, TEMPERATURE, WARMUP, RAMP, TOTAL = 0.6, 1.5, 2, 3, 7


class StepTiny(LitTiny):
    """LitTiny whose batch is a function of (global step, data-parallel rank) only: a resumed run sees the same data."""

    @staticmethod
    def step_tokens(step: int, dp_rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 + step + 7919 * dp_rank)
        return torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=g)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x = self.step_tokens(self.global_step, self.device_mesh["data_parallel"].get_local_rank())
        return super().training_step((x,), batch_idx)


class UserTeacherTiny(StepTiny):
    """LitTiny with a teacher of the user's (other weights), sharded like the model in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.teacher = [TinyGPT(CFG)]  # a list: not a submodule (not optimized, not in the state dict)

    def configure_model(self) -> None:
        super().configure_model()
        mesh, teacher = self.device_mesh, self.teacher[0]
        if mesh["tensor_parallel"].size() > 1:
            _tp_plan(teacher, mesh["tensor_parallel"])
        for block in teacher.layers:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(teacher, mesh=mesh["data_parallel"])


def full(tensors) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().clone() for n, t in tensors}


class Late(pl.Callback):
    """Listed after the pruning callback: what it logged at the end of the step."""

    def __init__(self, check: Check) -> None:
        self.check = check

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.check.after_pruning_callback(trainer)


class Check(pl.Callback):
    """Listed before the pruning callback: every distilled step's gradient against the float64 reference."""

    def __init__(self, cb: CoupledPruningCallback, user: TinyGPT | None) -> None:
        self.cb, self.user = cb, user
        self.max_rel_diff, self.checked, self.teacher_calls, self.bytes_logged = 0.0, 0, [], []
        self.params: dict = {}
        self.at_warmup_end: dict = {}
        self.teacher_first: dict = {}
        self._calls = 0
        self._hooked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params = full(pl_module.named_parameters())
        if trainer.global_step == WARMUP:
            self.at_warmup_end = self.params
        self._calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        teacher = self.cb.teacher
        if teacher is None or trainer.global_step < WARMUP:
            return
        dense = full(teacher.state_dict().items())
        if not self.teacher_first:
            self.teacher_first = dense
        dp = pl_module.device_mesh["data_parallel"].size()
        per_dp = [StepTiny.step_tokens(trainer.global_step, rank) for rank in range(dp)]
        student, ref_teacher = TinyGPT(CFG).double(), TinyGPT(CFG).double()
        student.load_state_dict({n[len("model.") :]: v for n, v in self.params.items()})
        ref_teacher.load_state_dict(dense)
        for x in per_dp:
            s, t = student(x[:, :-1]), ref_teacher(x[:, :-1])
            ce = nn.functional.cross_entropy(s.reshape(-1, CFG.vocab_size), x[:, 1:].reshape(-1))
            ((ce + distill_term(s, t, alpha=ALPHA, temperature=TEMPERATURE)) / len(per_dp)).backward()
        ref = dict(student.named_parameters())
        for name, param in pl_module.named_parameters():
            got = param.grad.full_tensor().double()
            want = ref[name[len("model.") :]].grad
            self.max_rel_diff = max(self.max_rel_diff, ((got - want).abs().max() / want.abs().max()).item())
        self.checked += 1

    def after_pruning_callback(self, trainer) -> None:  # noqa: ANN001 - on_train_batch_end, after the pruning callback
        teacher = self.cb.teacher
        if teacher is None:
            return
        if self._hooked:
            self.teacher_calls.append(self._calls)
        else:  # count the teacher's forwards from the next step on
            teacher.register_forward_pre_hook(lambda *_: setattr(self, "_calls", self._calls + 1))
            self._hooked = True
        if self.cb.controller.distiller.on:
            self.bytes_logged.append(float(trainer.callback_metrics["pruning/teacher_bytes"]))


def fit(
    dp: int, tp: int, ckpt: str, *, user: bool, ckpt_path: str | None = None, save: bool = False,
    store: str = "checkpoint", ckpts: str = "ckpts",
):  # fmt: skip
    module = UserTeacherTiny() if user else StepTiny()
    teacher = module.teacher[0] if user else None
    cb = CoupledPruningCallback(
        CLUSTERS, 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, mode="latent", distill_alpha=ALPHA,
        distill_temperature=TEMPERATURE, distill_module="model", distill_teacher=teacher, distill_teacher_store=store,
    )  # fmt: skip
    check = Check(cb, teacher)
    callbacks: list = [check, cb, Late(check)]
    if save:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=TOTAL, accelerator="cpu", devices=dp * tp, callbacks=callbacks, logger=False,
        strategy=ModelParallelStrategy(
            data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=ckpt == "dcp"
        ),
        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, cb, check, trainer


def teacher_keys(path: str) -> list[str]:
    """The teacher's entries in a checkpoint: keys under the teacher prefix, teacher tensors in callback states."""
    from pathlib import Path

    from lightning_pat.parallel.comm.dcp import read_distributed_checkpoint
    from lightning_pat.training.state import TEACHER_PREFIX

    root = Path(path)
    state = read_distributed_checkpoint(root) if root.is_dir() else torch.load(root, weights_only=True)
    if root.is_dir() and (root / "meta.pt").is_file():
        state = {**state, **torch.load(root / "meta.pt", weights_only=True)}
    found: list[str] = []

    def walk(obj, where: str) -> None:  # noqa: ANN001
        if isinstance(obj, dict):
            if obj.get("format") == "file":
                return  # a file reference: names and digests only
            for key, value in obj.items():
                name = f"{where}.{key}" if where else str(key)
                is_ref = isinstance(value, dict) and value.get("format") == "file"
                if str(key).startswith(TEACHER_PREFIX) or (where.endswith("distill") and key == "teacher" and value):
                    if is_ref:
                        continue
                    found.append(name)
                walk(value, name)

    walk(state, "")
    return found


def run_case(dp: int, tp: int, ckpt: str, stop: int, user: bool, store: str = "checkpoint", *, case: int = 0) -> None:
    ckpts = f"ckpts-{case}"  # each case of the launch checkpoints into a folder of its own
    module, cb, check, trainer = fit(dp, tp, ckpt, user=user, save=not user, store=store, ckpts=ckpts)
    teacher = cb.teacher
    s_params = dict(module.model.named_parameters())
    t_params = dict(teacher.named_parameters())
    out = {
        "case": case,
        "rank": dist.get_rank(),
        "checked": check.checked,
        "max_rel_diff": check.max_rel_diff,
        "teacher_is_user": teacher is (module.teacher[0] if user else object()),
        "teacher_calls": check.teacher_calls,
        "teacher_grads": sum(p.grad is not None for p in teacher.parameters()),
        "teacher_in_optimizer": bool(
            {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]} & set(map(id, t_params.values()))
        ),
        "teacher_layout_like_student": all(
            (t_params[n].device_mesh, t_params[n].placements) == (p.device_mesh, p.placements)
            for n, p in s_params.items()
        ),
        "teacher_bytes_logged": check.bytes_logged,
        "teacher_bytes_local": local_nbytes(teacher),
        "student_bytes_local": local_nbytes(module.model),
        "full_bytes": sum(p.numel() * p.element_size() for p in s_params.values()),
        "dropped": cb.dropped,
    }
    end = full(teacher.state_dict().items())
    out["teacher_moved"] = sorted(n for n in end if not torch.equal(end[n], check.teacher_first[n]))
    if not user:
        warm = {n[len("model.") :]: v for n, v in check.at_warmup_end.items()}
        out["teacher_is_warmup_end"] = all(torch.equal(end[n], warm[n]) for n in end)
        want = full(module.named_parameters())
        if store == "file":
            from pathlib import Path

            out["teacher_files"] = sorted(p.name for p in Path(ckpts).glob("pat-teacher-*"))
        if dist.get_rank() == 0:
            out["teacher_keys_in_ckpt"] = teacher_keys(f"{ckpts}/step={stop}.ckpt")
        resumed, cb2, _, _ = fit(
            dp, tp, ckpt, user=False, ckpt_path=f"{ckpts}/step={stop}.ckpt", store=store, ckpts=ckpts
        )
        got = full(resumed.named_parameters())
        got_teacher = full(cb2.teacher.state_dict().items())
        out["resume_mismatches"] = [n for n in want if not torch.equal(got[n], want[n])] + [
            "teacher." + n for n in end if not torch.equal(got_teacher[n], end[n])
        ]
    print("RESULT " + json.dumps(out), flush=True)


def main(dp: int, tp: int, cases: list[str]) -> None:
    """Each case ``CKPT:STOP[:user|:file]`` in sequence in this one process (one launch per rank for all of them)."""
    for index, case in enumerate(cases):
        ckpt, stop, extra = (case.split(":") + [""])[:3]
        run_case(
            dp, tp, ckpt, int(stop), extra == "user", store="file" if extra == "file" else "checkpoint", case=index
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","))
    finish_worker()
