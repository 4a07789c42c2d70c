"""``shrink_on_freeze`` under ``ModelParallelStrategy`` (FSDP2, data-parallel size 2, gloo on CPU): healing small.

One launch of 2 ranks (``workers/mp_shrink_worker.py``) fits a TinyGPT through the freeze with a distributed
checkpoint after every step, resumes from a checkpoint written after the freeze and from one written before it, and
resumes a distilled run after its freeze. The reference is the same recipe on one process, on both
ranks' batches at once (the mean loss over them is the mean of the ranks' losses, which FSDP2 averages), run here:

* the selection (the dropped units) is the one process's on every rank, and the parameters are DTensors at the
  small size from the freeze on: each rank holds its shards of the small model (bytes measured per rank);
* the losses fall and stay finite through the freeze;
* the final weights (gathered: the export) have the one process's shapes and, within 1e-5, its values (the gloo
  reduction of two half-batches and the one-process mean of the whole batch round differently: 1.1e-6 at most,
  measured; a different selection would cut other rows, O(1) apart);
* a resume from either checkpoint ends bitwise on the uninterrupted run's weights, its losses bitwise too;
  ``trainer.validate`` of a fresh module from the last checkpoint loads exactly the trained small model;
* with distillation the student heals small from the dense teacher (sharded like the full-size student); a resume
  from a checkpoint written after the freeze rebuilds that dense teacher (a sharded copy of the module taken before
  it is cut to the checkpoint's shapes, the saved shards loaded into it) and continues bitwise, teacher included,
  with the teacher's shards in the distributed checkpoint or in files of their own (``distill_teacher_store="file"``);
  so does a resume from a full (gathered) checkpoint, whose teacher is gathered into the callback state;
* under tensor parallel 2 (a sequence-parallel plan, FSDP2 over a data-parallel axis of 1; the MLP and residual
  clusters), distilled: the one process's selection and weights (within 1e-4), a resume after the freeze bitwise,
  the dense teacher rebuilt sharded like the full-size student.

``lightning-pat fit`` of a ``CausalLM`` config with ``shrink_on_freeze: true`` (slow): FSDP2 at world 2, with the
model built whole and on meta (``empty_init``: each rank reads only its shards), and tensor parallel at world 2 on
the masked path (``shrink_on_freeze=false``, cut at the export) export the one process's model within 1e-4 (lr 1e-6:
the ``rms`` selection is the one process's), which stock ``from_pretrained`` loads with its tokenizer and generates
from (the 2x2 mesh on the real SmolLM2's weights is ``test_smollm2_sharded.py``'s); tensor parallel at world 2
with an explicit ``target_sparsity`` that keeps 37 MLP channels is refused at fit start with the numbers (a size
target rounds to the tensor-parallel size by itself). ``lightning-pat shrink`` (the installed console script) of
checkpoints written after a sharded freeze knows from the saved state that the model is already small and exports it
as it is: the FSDP2 front door's distributed checkpoint directory gives the in-run export's weights, config and logits
exactly (the one process's logits within 1e-3), loaded by stock ``from_pretrained``; the distilled TinyGPT run's full
checkpoint gives its trained weights exactly. It reads them without changing a byte, and refuses, whatever
``--overwrite`` says, an output that is the checkpoint or holds it.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.common.dist import result_records, run_rank_scripts
from tests.common.tiny_lm import fit_layouts, tiny_lm_dir

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "mp_shrink_worker.py"
FREEZE = 4  # warmup 1 + ramp 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], Path]:
    """The 2 ranks' records of every run, by run name, and the folder holding rank 0's final weights."""
    out = tmp_path_factory.mktemp("sharded_shrink")
    records = result_records(run_rank_scripts(WORKER, 2, args=[str(out)], timeout=240))
    runs: dict[str, list[dict]] = {}
    for record in records:
        runs.setdefault(record["run"], []).append(record)
    assert all([r["rank"] for r in runs[name]] == [0, 1] for name in runs), runs.keys()
    return runs, out


def one_process_run(tp: int) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """The recipe of the sharded run with tensor-parallel size ``tp`` on one process (no strategy): its dropped units
    and final (shrunk) weights (distilled, as the tensor-parallel run is)."""
    from tests.integration.workers.mp_shrink_worker import fit

    module, cb, _, _ = fit(None, devices=1, tp=tp, distill=tp > 1)
    return cb.dropped, {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.fixture(scope="module")
def one_process() -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """The FSDP2 run's recipe on one process, on both data-parallel ranks' batches."""
    return one_process_run(1)


@pytest.mark.timeout(300)
def test_sharded_run_heals_small_with_the_one_process_selection_and_weights(launched, one_process):
    runs, out = launched
    dropped, weights = one_process
    for r in runs["uninterrupted"]:
        assert r["dropped"] == dropped  # every rank: the one process's selection
        assert r["shrunk"]
        assert r["step"] == 7
        assert all(r["dtensors"])  # sharded again after the freeze, never gathered for good
        before, after = r["bytes"][FREEZE - 2], r["bytes"][FREEZE - 1]
        assert r["bytes"][: FREEZE - 1] == [before] * (FREEZE - 1)
        assert r["bytes"][FREEZE - 1 :] == [after] * (7 - FREEZE + 1)
        assert after < 0.35 * before, (before, after)  # this rank's shards of the small model
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][FREEZE - 1] < r["losses"][0]
        assert r["optimizer_params_are_module_params"]  # the optimizer trains the new parameters
    got = torch.load(out / "uninterrupted.pt", weights_only=True)
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in weights.items()}
    # the ranks' shards tile the small model: no rank keeps a full-size or a gathered copy
    assert sum(t.numel() * t.element_size() for t in got.values()) == sum(r["bytes"][-1] for r in runs["uninterrupted"])
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["after", "before"], ids=["ckpt-after-freeze", "ckpt-before-freeze"])
def test_resume_from_a_checkpoint_around_the_freeze_is_bitwise(launched, name):
    runs, out = launched
    want, got = (
        torch.load(out / "uninterrupted.pt", weights_only=True),
        torch.load(out / f"{name}.pt", weights_only=True),
    )
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    for uninterrupted, resumed in zip(runs["uninterrupted"], runs[name], strict=True):
        assert resumed["dropped"] == uninterrupted["dropped"]
        assert resumed["shrunk"]
        assert resumed["step"] == 7
        assert resumed["losses"] == uninterrupted["losses"][-len(resumed["losses"]) :]
        assert resumed["bytes"][-1] == uninterrupted["bytes"][-1]
        assert resumed["optimizer_params_are_module_params"]


@pytest.mark.timeout(300)
def test_fsdp2_x_tensor_parallel_heals_small_and_resumes_with_distillation(launched):
    runs, out = launched
    dropped, weights = one_process_run(2)  # both ranks train on data-parallel rank 0's batch, distilled
    for r in runs["tp"]:
        assert r["dropped"] == dropped
        assert r["shrunk"]
        assert all(r["dtensors"])
        before, after = r["bytes"][FREEZE - 2], r["bytes"][FREEZE - 1]
        assert after < 0.45 * before, (before, after)
        assert r["losses"][-1] < r["losses"][FREEZE - 1]
    got = torch.load(out / "tp.pt", weights_only=True)
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in weights.items()}
    for name, tensor in weights.items():  # measured: 1.06e-5 at most (the TP matmuls' partial sums round apart)
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-4)
    resumed = torch.load(out / "tp-after.pt", weights_only=True)  # the dense teacher rebuilt under TP: bitwise
    assert [n for n in got if not torch.equal(resumed[n], got[n])] == []
    teacher, resumed_teacher = (torch.load(out / f"{n}-teacher.pt", weights_only=True) for n in ("tp", "tp-after"))
    assert [n for n in teacher if not torch.equal(resumed_teacher[n], teacher[n])] == []
    for uninterrupted, resumed in zip(runs["tp"], runs["tp-after"], strict=True):
        assert resumed["losses"] == uninterrupted["losses"][-1:]
    for uninterrupted, resumed in zip(runs["tp:teacher"], runs["tp-after:teacher"], strict=True):
        assert resumed["teacher_shapes"] == uninterrupted["teacher_shapes"] != uninterrupted["student_shapes"]
        assert resumed["teacher_bytes"] == uninterrupted["teacher_bytes"]


@pytest.mark.timeout(300)
def test_validate_from_a_checkpoint_written_after_the_freeze_loads_it_into_a_fresh_module(launched):
    runs, out = launched
    want = torch.load(out / "uninterrupted.pt", weights_only=True)
    got = torch.load(out / "validate.pt", weights_only=True)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []  # the fresh full-size module, made small
    for r in runs["validate"]:  # (no bytes compared: FSDP2 keeps the root's parameters gathered after a forward)
        assert r["shrunk"]
        assert math.isfinite(r["losses"][0])


@pytest.mark.timeout(300)
def test_a_full_checkpoint_written_after_the_freeze_resumes_bitwise_with_distillation(launched):
    runs, out = launched
    # with distillation: the teacher gathered into the callback state, loaded into the dense skeleton's shards
    want, got = torch.load(out / "full.pt", weights_only=True), torch.load(out / "full-after.pt", weights_only=True)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    distilled = torch.load(out / "distill.pt", weights_only=True)  # the checkpoint format changes nothing
    assert [n for n in want if not torch.equal(distilled[n], want[n])] == []
    teacher = torch.load(out / "distill-teacher.pt", weights_only=True)
    for name in ("full-teacher", "full-after-teacher"):
        other = torch.load(out / f"{name}.pt", weights_only=True)
        assert [n for n in teacher if not torch.equal(other[n], teacher[n])] == [], name
    for r, t in zip(runs["full-after"], runs["full-after:teacher"], strict=True):
        assert r["shrunk"]
        assert r["bytes"] == [runs["distill"][r["rank"]]["bytes"][-1]]
        assert r["losses"] == runs["full"][r["rank"]]["losses"][-1:]
        assert t["teacher_shapes"] == runs["distill:teacher"][r["rank"]]["teacher_shapes"]


@pytest.mark.timeout(300)
def test_distillation_heals_the_small_student_from_the_dense_teacher(launched):
    runs, _ = launched
    for r, t in zip(runs["distill"], runs["distill:teacher"], strict=True):
        assert r["dropped"] == runs["uninterrupted"][r["rank"]]["dropped"]  # the teacher's term starts after the cut
        assert r["shrunk"]
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["losses"] != runs["uninterrupted"][r["rank"]]["losses"]  # the teacher's term changed the training
        small = t["student_shapes"]
        dense = {n: t["teacher_shapes"][n] for n in small}
        assert small != dense  # the student was cut, the teacher kept the dense shape
        assert t["teacher_dtensors"]  # sharded like the student was
        assert t["teacher_bytes"] > r["bytes"][-1]  # this rank's shards: the dense teacher outweighs the student


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["distill", "file"], ids=["teacher-in-checkpoint", "teacher-file"])
def test_resume_after_the_freeze_with_distillation_is_bitwise_with_the_dense_teacher(launched, name):
    runs, out = launched
    want = torch.load(out / f"{name}.pt", weights_only=True)
    got = torch.load(out / f"{name}-after.pt", weights_only=True)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    teacher = torch.load(out / "distill-teacher.pt", weights_only=True)  # the teacher store changes nothing
    for run in (name, f"{name}-after"):
        other = torch.load(out / f"{run}-teacher.pt", weights_only=True)
        assert [n for n in teacher if not torch.equal(other[n], teacher[n])] == [], run  # the dense teacher, exactly
    for uninterrupted, resumed in zip(runs[name], runs[f"{name}-after"], strict=True):
        assert resumed["dropped"] == uninterrupted["dropped"]
        assert resumed["shrunk"]
        assert resumed["step"] == 7
        assert resumed["losses"] == uninterrupted["losses"][-len(resumed["losses"]) :]
        assert resumed["bytes"][-1] == uninterrupted["bytes"][-1]  # the small student's shards
        assert resumed["optimizer_params_are_module_params"]
    for uninterrupted, resumed in zip(runs[f"{name}:teacher"], runs[f"{name}-after:teacher"], strict=True):
        assert resumed["teacher_shapes"] == uninterrupted["teacher_shapes"]  # dense, though the student came back small
        assert resumed["teacher_bytes"] == uninterrupted["teacher_bytes"]  # this rank's shards of it, as before
        assert resumed["teacher_dtensors"]


FRONT_DOOR = """seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 6
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  default_root_dir: {export}-run
  enable_progress_bar: false
  callbacks:
    - class_path: lightning_pat.CoupledPruningCallback
      init_args: {{clusters: llama, target_params: 0.7, score: rms, warmup_steps: 1, ramp_steps: 2,
        shrink_on_freeze: true}}
model:
  class_path: lightning_pat.lm.CausalLM
  init_args: {{pretrained: {model}, lr: 1.0e-6, export: {export}}}
data:
  class_path: lightning_pat.lm.TextFiles
  init_args: {{files: {files}, holdout_every: 2, batch_size: 2, seq_len: 16, val_windows: 2, train_windows: 32,
    english: false}}
"""
MESH = ["--trainer.strategy=ModelParallelStrategy", "--trainer.devices=2"]
FSDP2_X2 = [*MESH, "--trainer.strategy.data_parallel_size=2", "--trainer.strategy.tensor_parallel_size=1"]
FRONT_DOOR_LAYOUTS = {
    "one-process": [],
    "fsdp2-x2": FSDP2_X2,
    # the model built on meta, each rank reading only its shards after fully_shard
    "fsdp2-x2-empty-init": [*FSDP2_X2, "--model.init_args.empty_init=true"],
    # the masked path under tensor parallelism: no freeze, the export cut from the masked model at the end
    "tp-x2-masked": [*MESH, "--trainer.strategy.data_parallel_size=1", "--trainer.strategy.tensor_parallel_size=2",
                     "--trainer.callbacks.init_args.shrink_on_freeze=false"],
}  # fmt: skip
#: Layouts through the freeze (the others prune masked and cut at the export).
HEALS_SMALL = ("one-process", "fsdp2-x2", "fsdp2-x2-empty-init")
FRONT_DOOR_TP = {
    "tp-x2": [*MESH, "--trainer.strategy.data_parallel_size=1", "--trainer.strategy.tensor_parallel_size=2"],
}


@pytest.fixture(scope="module")
def front_door(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """``lightning-pat fit`` of one CausalLM config with ``shrink_on_freeze: true`` in each layout (the export dirs;
    each run's checkpoint, written at its last step, after the freeze, in ``<layout>-run/checkpoints``)."""
    root = tmp_path_factory.mktemp("sharded_shrink_front_door")
    done = fit_layouts(root, FRONT_DOOR, FRONT_DOOR_LAYOUTS, timeout=240)
    # an explicit sparsity is taken as given: 27 of the 64 MLP channels dropped, 37 kept, which 2 ranks cannot split
    # (a size target such as target_params rounds to the tensor-parallel size by itself: see
    # test_shrink_on_freeze_tensor_parallel.py)
    explicit = FRONT_DOOR.replace("target_params: 0.7", "target_sparsity: 0.42")
    return root, {**done, **fit_layouts(root, explicit, FRONT_DOOR_TP, timeout=240)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_front_door_heals_small_under_fsdp2_and_exports_the_one_process_model(front_door):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, done = front_door
    for name in FRONT_DOOR_LAYOUTS:
        assert done[name].returncode == 0, f"{name}: {done[name].stderr[-4000:]}"
        healed = "healing runs on the small model" in done[name].stderr + done[name].stdout
        assert healed == (name in HEALS_SMALL), name
    reference = load_file(root / "one-process" / "model.safetensors")
    full = load_file(tiny_lm_dir(root) / "model.safetensors")
    assert sum(t.numel() for t in reference.values()) < 0.8 * sum(t.numel() for t in full.values())  # really cut
    for name in FRONT_DOOR_LAYOUTS:
        # the one process's selection, so its rows and columns; the weights move by a few 1e-6 at lr 1e-6, masked
        # or small alike (another selection would cut other rows: O(1) apart)
        weights = load_file(root / name / "model.safetensors")
        assert sorted(weights) == sorted(reference), name
        for key, tensor in reference.items():
            assert weights[key].shape == tensor.shape, (name, key)
            torch.testing.assert_close(weights[key], tensor, atol=1e-4, rtol=0, msg=f"{name}: {key}")
        model = AutoModelForCausalLM.from_pretrained(root / name, trust_remote_code=False).eval()
        tokenizer = AutoTokenizer.from_pretrained(root / name, trust_remote_code=False)
        ids = tokenizer("def f(x):", return_tensors="pt").input_ids
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kept_count_tensor_parallel_cannot_split_is_refused_at_fit_start_with_the_numbers(front_door):
    _, done = front_door
    tp = done["tp-x2"]
    assert tp.returncode != 0
    assert "keeps 37 of 64 units" in tp.stderr
    assert "over mesh axis 'tensor_parallel' of 2 ranks" in tp.stderr
    assert "healing runs on the small model" not in tp.stderr + tp.stdout  # refused before any step
    assert "target_params:" not in tp.stderr + tp.stdout  # at fit start: before the size is even reported


def _digests(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (a file or a directory), by path."""
    import hashlib

    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def shrunk_checkpoints(front_door, launched) -> tuple[dict[str, Path], dict[str, dict], dict[str, str], dict[str, str]]:
    """``lightning-pat shrink`` (the installed console script, run as ``__main__`` in one process by
    ``tests/common/run_scripts.py``) of two checkpoints written after a sharded freeze at world 2: the FSDP2 front
    door's distributed checkpoint (a CausalLM) and the distilled TinyGPT run's full one (``--model_class``); then
    onto what it reads, with ``--overwrite`` (the checkpoint directory; the folder holding the full checkpoint).
    The checkpoints, the results by job, and every file it read hashed before and after."""
    import json
    import os
    import sys

    from tests.common.processes import ROOT, console_script
    from tests.common.run_scripts import PREFIX

    root, done = front_door
    assert done["fsdp2-x2"].returncode == 0, done["fsdp2-x2"].stderr[-4000:]
    ckpts = {
        "dcp": next((root / "fsdp2-x2-run" / "checkpoints").glob("*.ckpt")),
        "full": launched[1] / "ckpts-full" / "step=7.ckpt",  # the last: the weights of full.pt
    }
    read = (*ckpts.values(), tiny_lm_dir(root), root / "fsdp2-x2-run" / "config.yaml")
    before = _digests(*read)
    exe = console_script()
    tiny = "--model_class=tests.integration.workers.mp_shrink_worker.RankTiny"
    jobs = {
        "dcp": [exe, "shrink", f"--ckpt_path={ckpts['dcp']}", f"--output={root / 'shrunk'}"],
        "full": [exe, "shrink", f"--ckpt_path={ckpts['full']}", f"--output={root / 'shrunk-full'}", tiny],
        "onto-dcp": [exe, "shrink", f"--ckpt_path={ckpts['dcp']}", f"--output={ckpts['dcp']}", "--overwrite"],
        "above-full": [
            exe, "shrink", f"--ckpt_path={ckpts['full']}", f"--output={ckpts['full'].parent}", "--overwrite", tiny,
        ],
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "common" / "run_scripts.py"), json.dumps(list(jobs.values()))],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    records = [json.loads(line[len(PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    assert len(records) == len(jobs), proc.stderr[-4000:]
    return ckpts, dict(zip(jobs, records, strict=True)), before, _digests(*read)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_pat_shrink_of_a_distributed_checkpoint_written_after_the_freeze_exports_the_small_model(
    front_door, shrunk_checkpoints
):
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, _ = front_door
    ckpts, results, _, _ = shrunk_checkpoints
    result = results["dcp"]
    assert result["returncode"] == 0, result["stderr"][-4000:]
    assert "before the final ramp step" not in result["stderr"]  # the state says: shrunk at the freeze, final
    assert ckpts["dcp"].is_dir()
    out, in_run = root / "shrunk", root / "fsdp2-x2"
    # the checkpoint's model is already small: exported as it is, the in-run export's weights and config exactly
    expected, weights = load_file(in_run / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(expected)
    assert [k for k, t in expected.items() if not torch.equal(weights[k], t)] == []
    assert json.loads((out / "config.json").read_text()) == json.loads((in_run / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (tiny_lm_dir(root) / "tokenizer.json").read_bytes()
    full = load_file(tiny_lm_dir(root) / "model.safetensors")
    assert sum(t.numel() for t in weights.values()) < 0.8 * sum(t.numel() for t in full.values())  # really cut
    # stock from_pretrained loads it; its logits are the in-run export's and, within 1e-3, one process's
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 11]])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        in_run_logits = AutoModelForCausalLM.from_pretrained(in_run).eval()(ids).logits
        reference = AutoModelForCausalLM.from_pretrained(root / "one-process").eval()(ids).logits
    assert torch.equal(logits, in_run_logits)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-3)  # measured: 1.9e-4 (the weights: 1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_pat_shrink_of_a_full_checkpoint_written_after_the_freeze_with_distillation(
    front_door, launched, shrunk_checkpoints
):
    from lightning_pat import load_pretrained
    from lightning_pat.cli import load_checkpoint
    from lightning_pat.shrink import restore_shrunk
    from tests.integration.workers.mp_shrink_worker import RankTiny, rank_tokens

    root, _ = front_door
    _, out = launched
    ckpts, results, _, _ = shrunk_checkpoints
    result = results["full"]
    assert result["returncode"] == 0, result["stderr"][-4000:]
    assert "before the final ramp step" not in result["stderr"]
    small = load_pretrained(root / "shrunk-full").eval()
    trained = torch.load(out / "full.pt", weights_only=True)  # the sharded run's final weights, gathered
    exported = small.state_dict()
    assert {f"model.{n}": tuple(t.shape) for n, t in exported.items() if f"model.{n}" in trained} == {
        n: tuple(t.shape) for n, t in trained.items()
    }  # the small shapes, every parameter
    assert [n for n, t in trained.items() if not torch.equal(exported[n.removeprefix("model.")], t)] == []
    # independent of the shrink: a fresh module given the saved state's shapes, the trained weights loaded
    reference = RankTiny()
    assert restore_shrunk(reference, load_checkpoint(ckpts["full"]))
    reference.load_state_dict(trained, strict=False)
    x = rank_tokens(0)[:, :-1]
    with torch.no_grad():
        assert torch.equal(small(x), reference.model.eval()(x))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_pat_shrink_never_writes_over_the_checkpoint_it_reads(shrunk_checkpoints):
    ckpts, results, before, after = shrunk_checkpoints
    assert after == before  # the checkpoints, the run's config and the pretrained model: not a byte changed
    dcp, full = ckpts["dcp"], ckpts["full"]
    for job, ckpt, output in (("onto-dcp", dcp, dcp), ("above-full", full, full.parent)):
        result = results[job]
        assert result["returncode"] == 1
        how = "is" if output == ckpt else f"holds {ckpt}, which is"
        assert f"the output directory {output} {how} the checkpoint this export was read from" in result["stderr"]
