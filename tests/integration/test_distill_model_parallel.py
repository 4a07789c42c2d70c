"""Distillation under ModelParallelStrategy (gloo on CPU, 2 ranks): FSDP2, and tensor parallel (with FSDP2 over a
data-parallel axis of size 1). See ``mp_distill_worker.py`` for what each rank checks; the reference gradient is
autograd on the blended loss written out by hand in float64 (``tests/common/distill_reference.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.dist import once_per_world, result_records, run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "mp_distill_worker.py"
WARMUP, TOTAL = 2, 7


#: the cases of each (dp, tp) layout, run in sequence in ONE launch of its 2 ranks: "CKPT:STOP[:user|:file]"
CASES = {(2, 1): ["dcp:3", "dcp:0:user", "dcp:4:file"], (1, 2): ["full:5"]}
CASE_TIMEOUT = 400  # seconds per case of a launch


@pytest.fixture(scope="module")
def worlds():
    """``runs(dp, tp, case)``: the 2 ranks' results for that case, from ONE launch per layout running all its cases
    (on first use; a failed launch fails each of its cases with the same report)."""

    def launch(layout: tuple[int, int]) -> list[dict]:
        dp, tp = layout
        cases = CASES[layout]
        return result_records(
            run_rank_scripts(WORKER, 2, args=[str(dp), str(tp), ",".join(cases)], timeout=CASE_TIMEOUT * len(cases))
        )

    launched = once_per_world(launch)

    def runs(dp: int, tp: int, case: str) -> list[dict]:
        results = [r for r in launched((dp, tp)) if r["case"] == CASES[dp, tp].index(case)]
        assert [r["rank"] for r in results] == [0, 1]
        return results

    return runs


@pytest.mark.timeout(450 * 3)  # the first case of a layout runs its launch (up to 3 cases)
@pytest.mark.parametrize(
    ("dp", "tp", "ckpt", "stop"),
    [(2, 1, "dcp", 3), (1, 2, "full", 5)],
    ids=["fsdp2-dcp-resume-mid-ramp", "tp-full-ckpt-resume-final"],
)
def test_sharded_teacher_gradient_frozen_and_resumed_bitwise(worlds, dp, tp, ckpt, stop):
    results = worlds(dp, tp, f"{ckpt}:{stop}")
    for r in results:
        assert r["checked"] == TOTAL - WARMUP  # every step from the pruning start is distilled and checked
        assert r["max_rel_diff"] < 1e-4, r["max_rel_diff"]
        # the default teacher: the model at the warmup end, sharded like it, never updated, one forward per step
        assert r["teacher_is_warmup_end"]
        assert r["teacher_moved"] == []
        assert r["teacher_grads"] == 0
        assert not r["teacher_in_optimizer"]
        assert r["teacher_layout_like_student"]
        assert r["teacher_calls"] == [1] * (TOTAL - WARMUP - 1)
        # its memory, logged per rank: this rank's shards, the student's size, well under the full model's
        assert r["teacher_bytes_logged"] == [r["teacher_bytes_local"]] * (TOTAL - WARMUP)
        assert r["teacher_bytes_local"] == r["student_bytes_local"]
        assert r["teacher_bytes_local"] < 0.6 * r["full_bytes"]
        assert r["resume_mismatches"] == []
    assert results[0]["dropped"] == results[1]["dropped"]
    assert results[0]["teacher_keys_in_ckpt"]  # the checkpoint store: the teacher is in every checkpoint


@pytest.mark.timeout(450 * 3)  # the first case of a layout runs its launch (up to 3 cases)
def test_a_teacher_sharded_by_the_user_is_used_as_is(worlds):
    for r in worlds(2, 1, "dcp:0:user"):
        assert r["teacher_is_user"]
        assert r["checked"] == TOTAL - WARMUP
        assert r["max_rel_diff"] < 1e-4, r["max_rel_diff"]
        assert r["teacher_moved"] == []
        assert r["teacher_grads"] == 0
        assert not r["teacher_in_optimizer"]


@pytest.mark.timeout(450 * 3)  # the first case of a layout runs its launch (up to 3 cases)
def test_file_store_writes_each_ranks_shards_once_and_resumes_bitwise(worlds):
    """``distill_teacher_store="file"`` under FSDP2 with distributed checkpoints: one file per rank, none in the
    checkpoints, and the resumed teacher is bitwise the model at the warmup end (via the uninterrupted run's)."""
    results = worlds(2, 1, "dcp:4:file")
    for r in results:
        assert r["checked"] == TOTAL - WARMUP
        assert r["max_rel_diff"] < 1e-4, r["max_rel_diff"]
        assert r["teacher_is_warmup_end"]
        assert r["resume_mismatches"] == []
        files = r["teacher_files"]
        assert len(files) == 2
        assert [f.rsplit("-", 1)[1] for f in files] == ["rank0of2.safetensors", "rank1of2.safetensors"]
    assert results[0]["teacher_files"] == results[1]["teacher_files"]
    assert results[0]["teacher_keys_in_ckpt"] == []  # no teacher shard and no teacher tensor in the checkpoint
