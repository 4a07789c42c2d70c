"""``expert_score="reap_sum"``/``"reap"`` under FSDP2 (``ModelParallelStrategy``, data-parallel size 2, gloo on CPU).

One launch of 2 ranks (``workers/mp_reap_worker.py``) trains a tiny Mixtral (4 experts, top-2) with ``fully_shard``
per decoder layer and on the root (``+experts``: on each layer's experts module too, a group of its own), each rank on
a batch of its own. The experts' forward pre-hook runs where FSDP2 has gathered the experts' weights (inside the
layer's forward; after the experts module's own pre-forward gather): it computes each routed token's expert output
from the whole expert weights as on one device, and the per-rank sums are added in the one collective of the score
vector. Before, the experts module sharded on its own was refused (its weights were DTensors again in a forward
hook).
The reference is the same recipe on one process, on both ranks' batches at once (run here): at every selection the
scores every rank used equal the one process's (the ranks' partial sums and the one process's sum round apart:
rel 1e-7), and every rank drops the one process's experts (and the other clusters' units).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.common.dist import result_records, run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).parent / "workers" / "mp_reap_worker.py"
KINDS = ("reap_sum", "reap", "reap_sum+experts")


@pytest.fixture(scope="module")
def launched() -> dict[str, list[dict]]:
    """The 2 ranks' records by ``expert_score``."""
    runs: dict[str, list[dict]] = {}
    for record in result_records(run_rank_scripts(WORKER, 2, args=list(KINDS), timeout=240)):
        runs.setdefault(record["kind"], []).append(record)
    assert sorted(runs) == sorted(KINDS)
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_reap_under_fsdp2_scores_and_drops_the_experts_of_one_process(launched, kind):
    from tests.integration.workers.mp_reap_worker import fit

    cb, used = fit(kind.partition("+")[0], devices=1)
    assert sorted(used) == [2, 3, 4]  # the selections of the ramp
    for r in launched[kind]:
        assert r["dropped"] == cb.dropped
        assert sorted(map(int, r["used"])) == sorted(used)
        for step, scores in used.items():
            for name, want in scores.items():
                got = torch.tensor(r["used"][str(step)][name], dtype=torch.float64)
                torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-12)
                assert bool((got[[u for u in range(4) if u not in cb.dropped[name]]] > 0).all())  # kept: routed
    assert all(len(cb.dropped[f"experts.{i}"]) == 2 for i in range(2))
