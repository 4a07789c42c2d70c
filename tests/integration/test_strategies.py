"""CoupledPruningCallback under DDP and FSDP1 (`FSDPStrategy`, flat parameters) on CPU, 2 ranks with gloo.

Each rank runs tests/integration/workers/strategy_worker.py with the rank environment set, so Lightning never re-runs
pytest; the harness kills every rank at the deadline, so a hang fails instead of stalling. One world per strategy
fits all of that strategy's cases in sequence (``CASES``); each test asserts on its case's results.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.dist import once_per_world, result_records, run_rank_scripts
from tests.common.lit_models import HIDDEN

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "strategy_worker.py"


#: every case of each strategy, fitted in sequence in ONE world of 2 rank processes per strategy
CASES = {"ddp": ["latent:rms", "direct:rms", "latent:activation"], "fsdp1": ["latent:rms", "direct:rms", "latent:auto"]}
CASE_TIMEOUT = 200  # seconds per case (one fit) of a world


@pytest.fixture(scope="module")
def worlds():
    """``runs(strategy)``: every case of that strategy in one world (2 rank launches instead of 2 per case).

    Run on first use; a failed world fails every case of its strategy with the same report.
    """

    def launch(strategy: str) -> list[dict]:
        cases = CASES[strategy]
        return result_records(
            run_rank_scripts(WORKER, 2, args=[strategy, ",".join(cases)], timeout=CASE_TIMEOUT * len(cases))
        )

    return once_per_world(launch)


@pytest.fixture
def launch(worlds):
    def case(strategy: str, mode: str, score: str = "rms") -> list[dict]:
        assert f"{mode}:{score}" in CASES[strategy]
        results = [r for r in worlds(strategy) if r["case"] == f"{mode}:{score}"]
        assert [r["rank"] for r in results] == [0, 1]
        return results

    return case


def check_pruned(results: list[dict]) -> None:
    first = results[0]
    assert first["step"] == 7
    assert first["routes"] == {"hidden": "materializing"}
    assert len(first["dropped"]["hidden"]) == HIDDEN // 2
    for r in results:
        assert r["disagreements"] == 0  # same step, mask (and DDP weights) on every rank after every batch
        assert r["dropped"] == first["dropped"]
        # the full weights: exactly the dropped rows / columns are zero
        assert r["zero_rows"] == first["dropped"]["hidden"]
        assert r["zero_cols"] == first["dropped"]["hidden"]
        assert r["unit_sparsity"] == pytest.approx(0.5)


@pytest.mark.timeout(240 * 3)  # the first case of a strategy runs its world (3 cases)
@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_ddp_two_ranks_select_the_same_units(launch, mode):
    results = launch("ddp", mode)
    check_pruned(results)
    assert results[0]["flat_shapes"] == [[HIDDEN, 8], [HIDDEN], [4, HIDDEN], [4]]  # replicated, not sharded


@pytest.mark.timeout(240 * 3)  # the first case of a strategy runs its world (3 cases)
@pytest.mark.parametrize("mode", ["latent", "direct"])
def test_fsdp1_materializing_path_prunes_full_params(launch, mode):
    results = launch("fsdp1", mode)
    check_pruned(results)
    # the parameters really were flat shards (FSDP1), and different on the two ranks
    assert all(len(s) == 1 for r in results for s in r["flat_shapes"])
    assert results[0]["flat_shapes"] != results[1]["flat_shapes"]


@pytest.mark.timeout(240 * 3)  # the first case of a strategy runs its world (3 cases)
def test_the_default_auto_score_is_rms_under_fsdp1_and_selects_what_rms_selects(launch):
    auto, rms = launch("fsdp1", "latent", "auto"), launch("fsdp1", "latent")
    check_pruned(auto)
    assert [r["score"] for r in auto] == ["rms", "rms"]  # FSDP1 cannot address the readers' input channels
    assert [r["dropped"] for r in auto] == [r["dropped"] for r in rms]
    assert [r["zero_rows"] for r in auto] == [r["zero_rows"] for r in rms]


@pytest.mark.timeout(240 * 3)  # the first case of a strategy runs its world (3 cases)
def test_ddp_activation_score_selects_the_same_units_from_different_batches(launch):
    results = launch("ddp", "latent", "activation")
    check_pruned(results)  # the same mask on both ranks after every step
    # each rank saw its own half of the data (DistributedSampler), so the ranks' own statistics differ: only their
    # average, taken before each selection, makes the selections agree
    assert results[0]["activation"] != results[1]["activation"]
