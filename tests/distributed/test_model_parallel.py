"""CoupledPruningCallback under Lightning's ModelParallelStrategy on CPU (gloo): FSDP2 on 2 ranks, and FSDP2 x
tensor parallel on a 2x2 mesh. Each rank is a plain subprocess with its rank environment set (Lightning does not
re-launch anything); see ``workers/model_parallel.py`` for the model and its parallel plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.common.dist import once_per_world, result_records, run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "model_parallel.py"


CASES = [
    (2, 1, "latent", "rms"),
    (2, 2, "latent", "rms"),
    (2, 2, "direct", "rms"),
    (2, 1, "latent", "activation"),
    (2, 2, "direct", "activation"),
    (2, 2, "latent", "taylor"),
]
CASE_TIMEOUT = 240  # seconds per case (two fits: auto and materializing) of one world


@pytest.fixture(scope="module")
def worlds():
    """``runs(dp, tp)``: every case of that mesh fitted in ONE world of ``dp * tp`` rank processes, run on first use.

    Each rank script takes the mesh's cases as a list and fits them in sequence, so a mesh costs one launch per rank
    instead of one per rank per case; the timeout is the per-case one times the cases. A failed world fails every
    case of its mesh with the same report.
    """

    def launch(mesh: tuple[int, int]) -> list[dict]:
        dp, tp = mesh
        cases = [f"{mode}:{score}" for d, t, mode, score in CASES if (d, t) == (dp, tp)]
        return result_records(
            run_rank_scripts(
                WORKER, dp * tp, args=[str(dp), str(tp), ",".join(cases), "auto,materializing"],
                timeout=CASE_TIMEOUT * len(cases),
            )
        )  # fmt: skip

    runs = once_per_world(launch)
    return lambda dp, tp: runs((dp, tp))


@pytest.mark.timeout(300 * 4)  # the first case of a mesh runs the mesh's world (up to 4 cases)
@pytest.mark.parametrize(
    ("dp", "tp", "mode", "score"),
    CASES,
    ids=[
        "fsdp2-2ranks-latent", "fsdp2xtp-2x2-latent", "fsdp2xtp-2x2-direct", "fsdp2-2ranks-latent-activation",
        "fsdp2xtp-2x2-direct-activation", "fsdp2xtp-2x2-latent-taylor",
    ],
)  # fmt: skip
def test_model_parallel_trainer_takes_sharded_path(worlds, dp, tp, mode, score):
    runs = [r for r in worlds(dp, tp) if r["case"] == f"{mode}:{score}"]
    results = [r for r in runs if r["executor"] == "auto"]
    reference = [r for r in runs if r["executor"] == "materializing"]
    assert [r["rank"] for r in results] == list(range(dp * tp))
    assert [r["rank"] for r in reference] == list(range(dp * tp))
    # parity: the same training run on the materializing (reference) path drops the same units at the end and
    # ends with the same weights
    for r, ref in zip(results, reference, strict=True):
        assert set(ref["executors"]) == {"materializing"}
        assert ref["dropped"] == r["dropped"]
        for name, w in r["weights"].items():
            assert w == ref["weights"][name], name  # bitwise: same masks, same updates
    first = results[0]
    assert first["mesh"] == [dp, tp]
    placements = {p for ps in first["placements"].values() for p in ps}
    if tp == 1:
        assert placements == {"Shard(dim=0)"}
    else:  # FSDP2 on top of TP: strided dp shards of colwise weights, (Shard(0), Shard(1)) for rowwise ones
        assert {"_StridedShard(dim=0, sf=2)", "Shard(dim=1)", "Replicate()"} <= placements
    assert first["step"] == 6
    for r in results:
        # routing: every cluster on the sharded path, no materialization at any step
        assert {k: v[0] for k, v in r["routes"].items()} == dict.fromkeys(first["num_units"], "sharded")
        assert r["executors"] == ["sharded"]
        assert r["calls"].get("full_tensor", 0) == 0
        assert r["calls"].get("write_back_", 0) == 0
        # one packed gather per fresh selection (4 ramp steps; every cluster on one gather group here) and one
        # count reduction per logged step (log_every_n_steps=1, 6 steps)
        assert r["calls"]["all_gather_packed"] == 4
        assert r["calls"]["reduce_counts"] == 6
        # target reached; masks identical on every rank; exactly the dropped units are zero in every member
        for name, units in first["num_units"].items():
            assert len(r["dropped"][name]) == math.ceil(0.5 * units), name
        assert r["dropped"] == first["dropped"]
        assert r["all_ranks_equal"]
        assert r["zero_units"] == r["dropped"]
        assert r["unit_sparsity"] == pytest.approx(0.5)
