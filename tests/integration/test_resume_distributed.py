"""Resume equivalence under DDP (2 ranks), ModelParallelStrategy (FSDP2, 2 ranks; distributed and full
checkpoints): stop at k in warmup, ramp and healing, resume from the checkpoint, and compare
with the uninterrupted run bitwise (whole-model weights, masks and logged sparsity at every step). Each case runs
the uninterrupted fit once and every resume in one process per rank (see resume_worker.py), and one launch of the
2 ranks runs every DDP case in sequence, another every ModelParallelStrategy case; the harness kills the ranks at
the deadline.

FSDP1 (``FSDPStrategy``) is not in the matrix: saving a checkpoint under the test-only CPU FSDP1 strategy crashes
(SIGSEGV in the optimizer-state gather) with or without latent state, so its latent format (every rank's flat
shards, gathered) is covered by the unit test of ``lightning_pat.training.state`` only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.common.dist import once_per_world, result_records, run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "resume_worker.py"


CASES = [
    ("ddp", "latent", "2,4,8", "materializing", "rms"),
    ("ddp", "direct", "4", "materializing", "rms"),
    ("ddp", "latent", "4", "materializing", "activation"),
    ("mp", "latent", "2,4,8", "sharded", "rms"),
    ("mp", "direct", "4", "sharded", "rms"),
    ("mp-full", "latent", "4", "sharded", "rms"),
    ("mp", "latent", "4,8", "sharded", "activation"),
    ("ddp", "direct", "4", "materializing", "taylor"),
    ("mp", "latent", "4", "sharded", "taylor"),
]
CASE_TIMEOUT = 280  # seconds per case (its uninterrupted fit and its resumes) of a world


def world_of(kind: str) -> str:
    """The world a case runs in: DDP cases share one, ModelParallelStrategy cases (both checkpoint formats) another."""
    return "ddp" if kind == "ddp" else "mp"


@pytest.fixture(scope="module")
def worlds():
    """``runs(world)``: the results of every case of that world, keyed by the case, from ONE launch of 2 ranks.

    Run on first use (each rank fits the world's cases in sequence); a failed world fails each of its cases with the
    same report.
    """

    def launch(world: str) -> dict[tuple, list[dict]]:
        cases = [c for c in CASES if world_of(c[0]) == world]
        args = [[kind, mode, [int(k) for k in stops.split(",")], score] for kind, mode, stops, _, score in cases]
        results = result_records(
            run_rank_scripts(WORKER, 2, args=[json.dumps(args)], timeout=CASE_TIMEOUT * len(cases))
        )
        return {case: [r for r in results if r["case"] == i] for i, case in enumerate(cases)}

    return once_per_world(launch)


@pytest.mark.timeout(300 * 5)  # the first case of a world runs the world (up to 5 cases)
@pytest.mark.parametrize(
    ("kind", "mode", "stops", "route", "score"),
    CASES,
    ids=[
        "ddp-latent",
        "ddp-direct",
        "ddp-latent-activation",
        "model-parallel-latent",
        "model-parallel-direct",
        "model-parallel-full-ckpt",
        "model-parallel-latent-activation",
        "ddp-direct-taylor",
        "model-parallel-latent-taylor",
    ],
)
def test_resume_matrix_equals_uninterrupted(worlds, kind, mode, stops, route, score):
    results = worlds(world_of(kind))[kind, mode, stops, route, score]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["routes"] == {"hidden": route}
        assert r["mismatches"] == [], r["mismatches"][:10]
    if mode == "latent" and score == "rms":
        assert results[0]["revived"]  # a unit dropped during the ramp came back: the latent really matters
