"""The distillation teacher under FSDP2 / tensor parallelism: a frozen copy sharded like the student, no gather.

Each rank copies only its own shards (same mesh, same placements, fresh storage); the copy's forward equals the
student's; the student's next step does not move the copy; FSDP2's state is not copied.
"""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.distributed.workers.teacher import copy_and_compare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.mark.parametrize(("layout", "world"), [("fsdp2", 2), ("tp", 2), ("tp+fsdp2", 2), ("2x2", 4)])
def test_sharded_frozen_copy_is_laid_out_like_the_student_and_computes_its_forward(layout, world):
    for rank, out in enumerate(run_distributed(copy_and_compare, world, layout, timeout=200)):
        assert out["same_names"], rank
        assert out["layout_mismatch"] == [], (rank, out["layout_mismatch"])
        assert out["value_mismatch"] == [], (rank, out["value_mismatch"])
        assert out["fsdp_modules"] == 0
        assert not out["requires_grad"]
        assert out["nbytes_equal"]
        assert out["nbytes_vs_full"] < 0.75  # every large weight is split in two (norms may be replicated)
        assert out["forward_is_plain"]
        assert out["forward_max_diff"] == 0.0, out["forward_max_diff"]
        assert out["teacher_moved"] == []
        assert out["teacher_grads"] == 0
        assert out["student_moved"]
        assert out["shards_back"]


def test_dtensor_logits_are_refused_with_the_fix():
    from tests.distributed.workers.teacher import dtensor_logits_error

    for message in run_distributed(dtensor_logits_error, 2, timeout=120):
        assert "returned DTensor logits (placements (Shard(dim=1),)); distillation needs plain logits" in message
        assert "use_local_output=True" in message


@pytest.mark.parametrize(
    ("layout", "world", "param_dtype"),
    [("fsdp2", 2, None), ("fsdp2", 3, None), ("tp", 2, None), ("2x2", 4, None), ("fsdp2", 2, "bfloat16")],
    ids=["fsdp2", "fsdp2-uneven", "tp", "2x2", "fsdp2-bf16"],
)
def test_teacher_forward_gathers_each_fsdp_group_once_and_computes_the_students_logits(layout, world, param_dtype):
    from tests.distributed.workers.teacher import teacher_forward_gathers

    for rank, out in enumerate(run_distributed(teacher_forward_gathers, world, layout, param_dtype, timeout=200)):
        gather = [c for c in out["calls"] if c[0] in ("all_gather_single", "all_gather_into_tensor")]
        assert gather == out["calls"], (rank, out["calls"])  # nothing but the packed gathers
        assert len(gather) == out["groups"], (rank, out["calls"], out["groups"])  # one per fully_shard group
        assert out["groups"] == (0 if layout == "tp" else 3)  # 2 blocks + the root (embedding, norm, head)
        assert all(c[1] == out["dp_ranks"] and c[2] == "torch.uint8" for c in gather), (rank, gather)
        assert out["materialized"] == out["student_materialized"]  # no per-parameter redistribute / full_tensor
        assert (out["materialized"] == []) == (layout == "fsdp2")  # (only tensor parallelism's layout hooks)
        dtype = f"torch.{param_dtype or 'float32'}"
        assert out["dtype"] == (dtype, dtype)  # the teacher computes in the student's param_dtype
        assert out["max_diff"] == 0.0, (rank, out["max_diff"])  # the same gathered weights, the same ops
        assert out["shards_back"]


def test_packed_gather_matches_full_tensor_for_mixed_dtypes_uneven_shards_and_2d_layouts():
    from tests.distributed.workers.teacher import packed_gather_matches_full_tensor

    for rank, out in enumerate(run_distributed(packed_gather_matches_full_tensor, 4, timeout=200)):
        assert out["mismatched"] == [], (rank, out["mismatched"])
        dp_group = [rank % 2, rank % 2 + 2]
        assert out["calls"] == [("all_gather_into_tensor", dp_group, "torch.uint8")] or out["calls"] == [
            ("all_gather_single", dp_group, "torch.uint8")
        ], (rank, out["calls"])  # one collective for every packable tensor
        assert out["materialized"] == ["redistribute"]  # only the layout FSDP2 never makes
        assert out["cast_ok"]
