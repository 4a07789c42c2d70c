"""shrink_on_freeze under FSDP2 (and FSDP2 x TP): the model cut and sharded again at its new size, with its optimizer.

A tiny GQA Llama, sharded per decoder layer then at the root, trained two AdamW steps on the same batch on every
rank; the same model on one device (same values, the sharded run's own, gathered) is shrunk with
``shrink_for_training``. After ``shrink_sharded``: the parameters and the Adam state equal the one-device ones
exactly (bitwise), the logits too (rel < 1e-5), one more step gives the same parameters, every rank holds exactly its
share of the small model (uneven where a kept count does not divide the world size), each ``fully_shard`` group is
gathered one kind of tensor at a time (its parameters, then each Adam moment: one all-gather of that group's size
each, never the whole model), and FSDP2's settings are the same.
"""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.distributed.workers.sharded_shrink import DROPPED, shrink_and_compare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ALL = tuple(DROPPED)


@pytest.mark.parametrize(
    ("layout", "world", "keys", "tied"),
    [
        ("fsdp2", 2, ALL, True),  # heads, MLP and the residual; kept counts 1/3, 27/40, 43/48: uneven shards
        ("fsdp2", 2, ("heads.0", "heads.1", "mlp.0", "mlp.1"), False),  # the root group is not cut; lm_head untied
        ("fsdp2", 3, ALL, True),
        ("2x2", 4, ALL, True),  # FSDP2 x tensor parallel: every kept count along a split dim divides by 2
    ],
    ids=["fsdp2-all", "fsdp2-untied-no-residual", "fsdp2-world3", "fsdp2xtp-2x2"],
)
def test_sharded_model_is_cut_and_sharded_again_like_the_one_device_shrink(layout, world, keys, tied):
    outs = run_distributed(shrink_and_compare, world, layout, keys, tied, timeout=280)
    for rank, out in enumerate(outs):
        assert out["names_equal"], rank
        assert all(got == want for got, want in out["shapes"].values()), (rank, out["shapes"])
        assert out["not_dtensor"] == [], rank
        assert out["fsdp_modules"] == 3, rank  # the 2 layers and the root, sharded again
        assert out["settings_kept"], rank  # the same mesh, reshard_after_forward and MixedPrecisionPolicy
        assert out["config_equal"], rank
        # (a), (b): bitwise the one-device shrink's parameters and Adam state; the logits of the small model
        assert out["param_rel"] == 0.0, (rank, out["param_rel"])
        assert out["state_rel"] == 0.0, (rank, out["state_rel"])
        assert out["steps_equal"], rank
        assert out["in_groups"], rank
        assert out["optimizer_params"], rank
        assert out["logits_rel"] < 1e-5, (rank, out["logits_rel"])
        # (c) one more step on both
        assert out["step_rel"] < 1e-5, (rank, out["step_rel"])
        assert out["logits_rel_after_step"] < 1e-5, (rank, out["logits_rel_after_step"])
        # (d) this rank's share of the small model, its Adam moments laid out the same way
        assert out["bytes_got"] == out["bytes_want"], (rank, out["bytes_got"], out["bytes_want"])
        assert out["state_bytes"] == out["bytes_got"], rank
        assert out["bytes_got"] < out["bytes_full"], rank
        # per fully_shard group one packed all-gather of its parameters, then one per Adam moment, over the
        # data-parallel ranks only, each of that group's bytes only: never the whole model
        dp = world // (2 if layout == "2x2" else 1)
        assert [c[0] for c in out["calls"]] in (["all_gather_single"] * 9, ["all_gather_into_tensor"] * 9), out["calls"]
        assert all(c[1] == list(range(rank % (world // dp), world, world // dp)) for c in out["calls"]), out["calls"]
        if layout == "fsdp2":
            want = sorted(3 * out["group_slot_bytes"])  # the parameters, exp_avg, exp_avg_sq
            assert sorted(out["gather_bytes"]) == want, (rank, out["gather_bytes"], want)
    sizes = {tuple(out["shapes"]["model.layers.0.mlp.gate_proj.weight"][0]) for out in outs}
    assert len(sizes) == 1  # the same global shapes on every rank


def test_a_kept_count_tensor_parallelism_cannot_split_is_refused_with_the_numbers_and_nothing_changes():
    from tests.distributed.workers.sharded_shrink import refused_under_tensor_parallel

    for message, unchanged in run_distributed(refused_under_tensor_parallel, 2, timeout=200):
        assert "cluster 'heads.0' keeps 3 of 4 units" in message, message
        assert "over mesh axis 'tensor_parallel' of 2 ranks" in message, message
        assert "multiple_of=2" in message, message
        assert unchanged


@pytest.mark.parametrize(("layout", "world"), [("fsdp2", 2), ("2x2", 4)])
def test_a_checkpoint_written_after_the_freeze_resumes_bitwise_into_a_fresh_sharded_model(layout, world, tmp_path):
    from tests.distributed.workers.sharded_shrink import resume_after_the_freeze

    for rank, out in enumerate(run_distributed(resume_after_the_freeze, world, layout, str(tmp_path), timeout=280)):
        assert out["shapes_equal"], rank  # the restored model has the checkpoint's (small) shapes before loading
        assert out["restore_calls"] == [], rank  # no communication: the values come from the checkpoint
        assert out["config_equal"], rank
        assert out["layout_equal"], rank
        assert out["params_equal"], rank  # one more step after the load: the same parameters as the run that wrote it
        assert out["state_equal"], rank


def test_a_shard_placement_fn_is_refused_before_anything_changes():
    from tests.distributed.workers.sharded_shrink import refused_shard_placement

    for message, unchanged in run_distributed(refused_shard_placement, 2, timeout=200):
        assert "sharded by fully_shard with a shard_placement_fn" in message, message
        assert "Linear.weight (Shard(dim=1))" in message, message
        assert unchanged
