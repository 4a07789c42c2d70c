"""The distillation teacher under FSDP2 / tensor parallelism: a frozen copy sharded like the student, no gather.

Each rank copies only its own shards (same mesh, same placements, fresh storage); the copy's forward equals the
student's; the student's next step does not move the copy; FSDP2's state is not copied.
"""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.distributed._teacher_workers import copy_and_compare

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
    from tests.distributed._teacher_workers import dtensor_logits_error

    for message in run_distributed(dtensor_logits_error, 2, timeout=120):
        assert "returned DTensor logits (placements (Shard(dim=1),)); distillation needs plain logits" in message
        assert "use_local_output=True" in message
