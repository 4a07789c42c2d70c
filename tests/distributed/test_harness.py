"""The spawn harness itself (``tests.common.dist.run_distributed``): every rank's failure is reported, a run that
failed only on gloo transport errors is retried once, and any Python error fails at once.

Real gloo process groups, real dead peers: a rank that leaves abruptly (``os._exit``) makes its peer's collective
fail with a genuine gloo transport error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.common.dist import (
    DistributedRunError,
    is_transport_error,
    once_per_world,
    only_transport_errors,
    result_records,
    run_distributed,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _attempt(marker_dir: str, rank: int) -> int:
    """Count this rank's attempts in ``marker_dir``; return the attempt number (1-based)."""
    n = len(list(Path(marker_dir).glob(f"rank{rank}.*"))) + 1
    Path(marker_dir, f"rank{rank}.{n}").touch()
    return n


def _dies_on_first_attempt(rank: int, world: int, marker_dir: str) -> float:
    attempt = _attempt(marker_dir, rank)
    value = torch.tensor([float(rank + 1)])
    dist.barrier()  # both ranks are connected and counted their attempt before rank 1 leaves
    if rank == 1 and attempt == 1:
        os._exit(3)  # leaves without a Python error: the peer sees only a transport failure
    dist.all_reduce(value)
    return value.item()


def _raises_on_rank_1(rank: int, world: int, marker_dir: str) -> float:
    _attempt(marker_dir, rank)
    dist.barrier()
    if rank == 1:
        raise ValueError("rank 1 refuses")
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    return value.item()


def test_transport_failure_is_retried_once_and_reported(tmp_path):
    with pytest.warns(RuntimeWarning, match="retrying after a gloo transport failure"):
        out = run_distributed(_dies_on_first_attempt, 2, str(tmp_path), timeout=60)
    assert out == [3.0, 3.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.1", "rank0.2", "rank1.1", "rank1.2"]


def test_python_error_fails_at_once_with_every_rank_reported(tmp_path):
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raises_on_rank_1, 2, str(tmp_path), timeout=60)
    assert not info.value.transport_only
    assert "ValueError: rank 1 refuses" in str(info.value)
    assert "failed ranks: [0, 1]" in str(info.value) or "failed ranks: [1]" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.1", "rank1.1"]  # not retried


def test_transport_error_classifier():
    assert is_transport_error("x\nRuntimeError: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer [::1]:5")
    assert not is_transport_error("x\nRuntimeError: Connection reset by peer")  # not gloo's
    assert not is_transport_error("Traceback ...\nValueError: bad cluster")
    assert not is_transport_error("")


def test_rank_script_output_classifier():
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9: Connection reset by peer"
    assert only_transport_errors(f"----- rank 0 -----\nTraceback\n{gloo}\n----- rank 1 -----\n{gloo}\n")
    assert not only_transport_errors(f"----- rank 0 -----\n{gloo}\n----- rank 1 -----\nValueError: cluster 'mlp'\n")
    assert not only_transport_errors("----- rank 0 -----\nKilled\n")


def test_a_world_launches_once_and_its_failure_fails_every_case_that_asks():
    calls: list[str] = []

    def launch(world: str) -> list[dict]:
        calls.append(world)
        if world == "bad":
            raise DistributedRunError("rank 1 died", transport_only=False)
        return result_records(['noise\nRESULT {"case": 0, "rank": 0}\n', 'RESULT {"case": 0, "rank": 1}\nRESULTS x\n'])

    runs = once_per_world(launch)
    assert runs("good") == [{"case": 0, "rank": 0}, {"case": 0, "rank": 1}]
    assert runs("good") is runs("good")
    for _ in range(2):
        with pytest.raises(DistributedRunError, match="rank 1 died"):
            runs("bad")
    assert calls == ["good", "bad"]
