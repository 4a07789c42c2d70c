"""Fit-start agreement under DDP (2 ranks): a rank with a different declaration, or one whose declaration does not
resolve, makes every rank raise the same clear error within seconds instead of hanging in a later collective; the
optional selection-hash check catches a divergent selection. See agreement_worker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.common.dist import run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "agreement_worker.py"


@pytest.fixture(scope="module")
def results() -> list[dict]:
    outputs = run_rank_scripts(WORKER, 2, timeout=200)
    out = [json.loads(ln[len("RESULT ") :]) for o in outputs for ln in o.splitlines() if ln.startswith("RESULT ")]
    assert [r["rank"] for r in out] == [0, 1]
    return out


@pytest.mark.timeout(240)
def test_different_declaration_on_one_rank_same_error_everywhere(results):
    errors = {r["declaration"]["error"] for r in results}
    assert len(errors) == 1
    (msg,) = errors
    assert "ranks disagree on ['clusters']" in msg
    assert "ranks [1] differ from rank 0" in msg
    assert all(r["declaration"]["type"] == "MisconfigurationException" for r in results)
    assert all(r["declaration"]["seconds"] < 30 for r in results)


@pytest.mark.timeout(240)
def test_declaration_failing_on_one_rank_raises_on_every_rank(results):
    errors = {r["typo"]["error"] for r in results}
    assert len(errors) == 1
    (msg,) = errors
    assert "Cluster 'hidden': writer pattern 'fc1.wieght' matches no parameter" in msg
    assert "raised on rank 1" in msg
    assert all(r["typo"]["seconds"] < 30 for r in results)


@pytest.mark.timeout(240)
def test_a_target_that_empties_a_cluster_is_refused_on_every_rank_before_any_change(results):
    errors = {r["empties"]["error"] for r in results}
    assert len(errors) == 1
    (msg,) = errors
    assert "'hidden' (target 0.25: ceil(0.25 * 1) = 1 of its 1 unit(s) are dropped)" in msg
    assert "raised on rank 0 (and ranks [1])" in msg
    assert all(r["empties"]["type"] == "MisconfigurationException" for r in results)
    assert all(r["empties"]["unchanged"] for r in results)


@pytest.mark.timeout(240)
def test_debug_selection_check_catches_divergence_and_is_off_by_default(results):
    for r in results:
        assert r["debug"]["type"] == "RuntimeError"
        assert "ranks [1] selected different units than rank 0" in r["debug"]["error"]
        assert r["debug_off"]["error"] is None  # off by default: no collective, no error
