"""``distill_teacher_store="file"``: the copied teacher is written once as safetensors, checkpoints hold a reference.

The reference for every resumed teacher is the model's weights when pruning started, copied by a callback of the
test itself (not the teacher the callback built); the reference for the student is an uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import CoupledPruningCallback
from tests.common.lit_models import StepDataModule, ends_mid_ramp, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration

WARMUP, RAMP, TOTAL = 2, 4, 9  # the final ramp step is 6; healing after it
OPTION = "distill_teacher_store='file'"


def make_cb(**overrides) -> CoupledPruningCallback:
    kwargs = {
        "warmup_steps": WARMUP, "ramp_steps": RAMP, "mode": "latent", "distill_alpha": 0.7,
        "distill_temperature": 2.0, "distill_teacher_store": "file", **overrides,
    }  # fmt: skip
    return CoupledPruningCallback(mlp_cluster(), 0.5, **kwargs)


class AtPruningStart(pl.Callback):
    """The model's weights after the last warmup step: what the teacher must be, copied independently."""

    def __init__(self) -> None:
        self.dense: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == WARMUP:
            self.dense = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def every_step(dirpath: Path) -> pl.callbacks.ModelCheckpoint:
    return pl.callbacks.ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)


def train(tmp_path: Path, **overrides) -> tuple[StepDataModule, CoupledPruningCallback, dict]:
    """The uninterrupted run, a checkpoint after every step into ``tmp_path / "ckpts"``."""
    module, cb, start = StepDataModule(lr=0.2, optimizer="adamw"), make_cb(**overrides), AtPruningStart()
    quiet_trainer(max_steps=TOTAL, callbacks=[cb, start, every_step(tmp_path / "ckpts")], checkpointing=True).fit(
        module
    )
    return module, cb, start.dense


def resume(ckpt: Path, *, max_steps: int = TOTAL, **overrides) -> tuple[StepDataModule, CoupledPruningCallback]:
    module, cb = StepDataModule(lr=0.2, optimizer="adamw", seed=99), make_cb(**overrides)
    trainer = quiet_trainer(max_steps=max_steps, callbacks=[cb], default_root_dir=ckpt.parent)
    trainer.fit(module, ckpt_path=str(ckpt))
    return module, cb


def assert_teacher_is(cb: CoupledPruningCallback, dense: dict) -> None:
    got = cb.teacher.state_dict()
    assert set(got) == set(dense)
    for name, tensor in got.items():
        assert torch.equal(tensor, dense[name]), name


def saved_teacher(ckpt: Path):
    state = torch.load(ckpt, weights_only=True)
    (mine,) = (v for k, v in state["callbacks"].items() if k.startswith("CoupledPruningCallback"))
    return mine["distill"]["teacher"]


@pytest.mark.parametrize("shrink", [False, True], ids=["masked", "shrink_on_freeze"])
def test_checkpoints_reference_one_file_and_resume_bitwise(tmp_path, shrink):
    module, cb, dense = train(tmp_path, shrink_on_freeze=shrink)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    assert_teacher_is(cb, dense)
    ckpts = tmp_path / "ckpts"
    files = sorted(ckpts.glob("pat-teacher-*.safetensors"))
    assert len(files) == 1  # written once, for the 7 checkpoints of pruning
    for step in range(1, TOTAL + 1):
        entry = saved_teacher(ckpts / f"step={step}.ckpt")
        if step <= WARMUP:  # the teacher is taken before the batch after the last warmup step
            assert entry is None
            continue
        assert entry["format"] == "file"
        assert [f["name"] for f in entry["files"]] == [files[0].name]
        assert not any(isinstance(v, torch.Tensor) for f in entry["files"] for v in f.values())  # names only
    from safetensors.torch import load_file

    assert {k: torch.equal(v, dense[k]) for k, v in load_file(files[0]).items()} == dict.fromkeys(dense, True)
    for step in (3, 6, 8):  # ramp, final ramp step, healing
        resumed, cb2 = resume(ckpts / f"step={step}.ckpt", shrink_on_freeze=shrink)
        assert_teacher_is(cb2, dense)
        for name, tensor in resumed.state_dict().items():
            assert torch.equal(tensor, want[name]), (step, name)
    if shrink:
        assert module.fc1.weight.shape[0] == 16
        assert cb.teacher.fc1.weight.shape[0] == 32  # the teacher keeps the dense shape
    assert sorted(ckpts.glob("pat-teacher-*.safetensors")) == files  # the resumed runs reused the same file


def test_the_checkpoint_is_half_the_size_of_the_checkpoint_store(tmp_path):
    sizes = {}
    for store in ("checkpoint", "file"):
        cb = make_cb(distill_teacher_store=store)
        trainer = quiet_trainer(max_steps=4, callbacks=[cb], default_root_dir=tmp_path)
        with ends_mid_ramp():
            trainer.fit(StepDataModule(lr=0.2))
        trainer.save_checkpoint(tmp_path / f"{store}.ckpt")
        sizes[store] = (tmp_path / f"{store}.ckpt").stat().st_size
    weights = sum(t.numel() * t.element_size() for t in StepDataModule().state_dict().values())
    assert sizes["checkpoint"] - sizes["file"] > 0.9 * weights  # the teacher's bytes are gone from the checkpoint
    assert len(list(tmp_path.glob("pat-teacher-*.safetensors"))) == 1  # in default_root_dir (no ModelCheckpoint)


def test_a_copied_folder_resumes_and_a_bad_file_is_refused_before_any_step(tmp_path):
    _, _, dense = train(tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "ckpts", moved)
    shutil.rmtree(tmp_path / "ckpts")  # the original folder is gone: the copy is self-contained
    _, cb = resume(moved / "step=4.ckpt")
    assert_teacher_is(cb, dense)

    (file,) = moved.glob("pat-teacher-*.safetensors")
    good = file.read_bytes()
    started = []

    class Stepped(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            started.append(trainer.global_step)

    def refused(match: str) -> None:
        module = StepDataModule(lr=0.2, optimizer="adamw", seed=99)
        trainer = quiet_trainer(max_steps=TOTAL, callbacks=[make_cb(), Stepped()], default_root_dir=moved)
        with pytest.raises(MisconfigurationException, match=match):
            trainer.fit(module, ckpt_path=str(moved / "step=4.ckpt"))
        assert started == []  # refused at fit start, before the first batch
        assert trainer.global_step == 4

    file.write_bytes(good[: len(good) // 2])
    refused(rf"{OPTION}: cannot read the teacher file .*{file.name}.*truncated.* Copy that file next to the checkpoint")
    tampered = bytearray(good)
    tampered[-3] ^= 0xFF  # one byte of the last tensor's data: still a valid safetensors file
    file.write_bytes(bytes(tampered))
    refused(rf"{OPTION}: the teacher file .*{file.name} does not hold the teacher this checkpoint was written with")
    file.unlink()
    refused(rf"{OPTION}: the checkpoint's teacher file '{file.name}' is in none of .*distill_teacher_dir")
    # the fix the message names: pass the dense model as `distill_teacher`
    module = StepDataModule(lr=0.2, optimizer="adamw", seed=99)
    teacher = StepDataModule()
    teacher.load_state_dict(dense)
    cb = make_cb(distill_teacher=teacher)
    quiet_trainer(max_steps=6, callbacks=[cb]).fit(module, ckpt_path=str(moved / "step=4.ckpt"))
    assert cb.teacher is teacher


@pytest.mark.parametrize("name", ["../pat-teacher-0123456789abcdef.safetensors", "/etc/passwd", "x/y.safetensors"])
def test_a_reference_naming_a_path_is_refused(tmp_path, name):
    train(tmp_path)
    ckpt = tmp_path / "ckpts" / "step=4.ckpt"
    state = torch.load(ckpt, weights_only=True)
    (key,) = (k for k in state["callbacks"] if k.startswith("CoupledPruningCallback"))
    state["callbacks"][key]["distill"]["teacher"]["files"][0]["name"] = name
    edited = tmp_path / "ckpts" / "edited.ckpt"
    torch.save(state, edited)
    with pytest.raises(MisconfigurationException, match=rf"{OPTION}: the checkpoint names the teacher file .* is not"):
        resume(edited)


def test_save_checkpoint_elsewhere_resumes_from_distill_teacher_dir(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    cb, start = make_cb(), AtPruningStart()
    trainer = quiet_trainer(max_steps=5, callbacks=[cb, start], default_root_dir=root)
    with ends_mid_ramp():
        trainer.fit(StepDataModule(lr=0.2, optimizer="adamw"))
    trainer.save_checkpoint(other / "mine.ckpt")
    (file,) = root.glob("pat-teacher-*.safetensors")  # the checkpoint directory of that Trainer: default_root_dir
    assert not list(other.glob("pat-teacher-*"))
    with pytest.raises(MisconfigurationException, match=rf"'{file.name}' is in none of \[.*other.*\]"):
        resume(other / "mine.ckpt", max_steps=7)
    _, cb2 = resume(other / "mine.ckpt", max_steps=7, distill_teacher_dir=str(root))
    assert_teacher_is(cb2, start.dense)


def test_second_fit_continues_and_the_store_may_change_on_resume(tmp_path):
    _, cb, dense = train(tmp_path)
    ckpts = tmp_path / "ckpts"
    # a second fit of the same Trainer keeps its teacher (and writes no second file)
    module, cb2, again = StepDataModule(lr=0.2, optimizer="adamw"), make_cb(), tmp_path / "again"
    trainer = quiet_trainer(max_steps=4, callbacks=[cb2], default_root_dir=again)
    with ends_mid_ramp():
        trainer.fit(module, ckpt_path=str(ckpts / "step=3.ckpt"))
    first = cb2.teacher
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(module)
    assert cb2.teacher is first
    trainer.save_checkpoint(again / "six.ckpt")
    assert [p.name for p in again.glob("pat-teacher-*")] == [next(ckpts.glob("pat-teacher-*")).name]
    assert_teacher_is(cb2, dense)
    # a file checkpoint resumed with the checkpoint store: the next checkpoint holds the weights again
    module, cb3 = resume(ckpts / "step=5.ckpt", max_steps=7, distill_teacher_store="checkpoint")
    assert_teacher_is(cb3, dense)
    # ... and a checkpoint-store checkpoint resumed with the file store
    plain = tmp_path / "plain"
    cb4 = make_cb(distill_teacher_store="checkpoint")
    with ends_mid_ramp():
        quiet_trainer(max_steps=5, callbacks=[cb4, every_step(plain)], checkpointing=True).fit(
            StepDataModule(lr=0.2, optimizer="adamw")
        )
    assert isinstance(saved_teacher(plain / "step=4.ckpt")["fc1.weight"], torch.Tensor)
    assert not list(plain.glob("pat-teacher-*"))
    module, cb5 = StepDataModule(lr=0.2, optimizer="adamw", seed=99), make_cb()
    trainer = quiet_trainer(max_steps=6, callbacks=[cb5], default_root_dir=tmp_path / "resumed")
    trainer.fit(module, ckpt_path=str(plain / "step=4.ckpt"))
    assert_teacher_is(cb5, dense)  # the same run and data: the same dense weights at the pruning start
    trainer.save_checkpoint(tmp_path / "resumed" / "six.ckpt")
    assert saved_teacher(tmp_path / "resumed" / "six.ckpt")["format"] == "file"
    assert len(list((tmp_path / "resumed").glob("pat-teacher-*.safetensors"))) == 1
    _, cb6 = resume(tmp_path / "resumed" / "six.ckpt", max_steps=7)
    assert_teacher_is(cb6, dense)


def test_a_fresh_trainer_writes_a_new_file_and_keeps_the_old_one(tmp_path):
    cb, module = make_cb(), StepDataModule(lr=0.2)
    for _ in range(2):
        trainer = quiet_trainer(max_steps=4, callbacks=[cb], default_root_dir=tmp_path)
        with ends_mid_ramp():
            trainer.fit(module)  # the module trains on: a fresh Trainer takes a new teacher at its warmup end
        trainer.save_checkpoint(tmp_path / f"{len(list(tmp_path.glob('*.ckpt')))}.ckpt")
    assert len(list(tmp_path.glob("pat-teacher-*.safetensors"))) == 2
    names = {saved_teacher(p)["files"][0]["name"] for p in tmp_path.glob("*.ckpt")}
    assert names == {p.name for p in tmp_path.glob("pat-teacher-*.safetensors")}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_rank_zero_writes_one_file_every_rank_resumes_bitwise_and_a_rank_without_it_stops_all():
    import json

    from tests.common.dist import run_rank_scripts

    outputs = run_rank_scripts(Path(__file__).parent / "workers" / "ddp_teacher_file_worker.py", 2, timeout=280)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert len(r["files"]) == 1  # one file for the replicas, written by rank 0
        assert r["resumed_teacher_is_warmup_end"]
        # rank 1 cannot find the file: both ranks raise its error (neither hangs in the next collective)
        assert r["refused"] is not None
        assert "is in none of" in r["refused"]
        assert "[raised on rank 1; all ranks stop here]" in r["refused"]
    assert results[0]["files"] == results[1]["files"]
