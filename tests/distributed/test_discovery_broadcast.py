"""Discovery runs once, on rank 0, and reaches every rank: ``broadcast_json`` (2 gloo ranks) and the controller's
``prepare`` with ``clusters="auto"``: rank 1 never traces, gets rank 0's declarations (or rank 0's error, raised on
every rank at ``bind``), identical to what a single process discovers."""

from __future__ import annotations

import pytest
import torch

from lightning_pat import discover, resolve_clusters
from lightning_pat.discovery import entry, outcome_from_json, outcome_to_json
from lightning_pat.parallel.comm import ranks
from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.controller import PruningController
from tests.common.cnn_models import INPUTS, ConvChain, DataDependent
from tests.common.dist import run_distributed

pytestmark = pytest.mark.distributed


def _send(rank: int, world: int) -> object:
    payload = {"clusters": [{"name": "é.{layer}", "writers": ["a[0:4]"], "num_units": 4}], "n": [1.5, None, True]}
    return ranks.broadcast_json(payload if rank == 0 else None, group=ranks.world_group())


@pytest.mark.timeout(120)
def test_broadcast_json_delivers_rank_zeros_object_to_every_rank():
    expected = {"clusters": [{"name": "é.{layer}", "writers": ["a[0:4]"], "num_units": 4}], "n": [1.5, None, True]}
    assert run_distributed(_send, 2) == [expected, expected]


def test_broadcast_json_without_a_process_group_returns_the_object():
    assert ranks.broadcast_json({"a": 1}, group=None) == {"a": 1}


def _prepare_and_bind(rank: int, world: int, which: str) -> tuple[int, list[dict] | str]:
    """``prepare`` then ``bind`` on this rank: the traces it ran and its resolved clusters (or the error ``bind``
    raised), read through the controller's public ``resolved``."""
    traced = []
    real = entry.trace
    entry.trace = lambda *a, **k: traced.append(1) or real(*a, **k)
    torch.manual_seed(0)
    model = ConvChain() if which == "convchain" else DataDependent()
    example = torch.zeros(INPUTS[ConvChain] if which == "convchain" else (2, 4))
    ctl = PruningController(PruningOptions("auto", target_sparsity=0.5))
    ctl.prepare(model, lambda: example)
    try:
        ctl.bind(model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    except ValueError as err:
        return len(traced), str(err)
    return len(traced), [rc.to_dict() for rc in ctl.resolved]


@pytest.mark.timeout(120)
def test_only_rank_zero_traces_and_every_rank_gets_its_clusters():
    results = run_distributed(_prepare_and_bind, 2, "convchain")
    assert [traces for traces, _ in results] == [1, 0]  # bind traces nothing more: it uses prepare's outcome
    model = ConvChain()
    local = resolve_clusters(model, discover(model, torch.zeros(INPUTS[ConvChain])).clusters)
    assert [out for _, out in results] == [[rc.to_dict() for rc in local]] * 2


@pytest.mark.timeout(120)
def test_rank_zeros_discovery_error_reaches_every_rank():
    results = run_distributed(_prepare_and_bind, 2, "datadep")
    assert [traces for traces, _ in results] == [1, 0]
    errors = [out for _, out in results]
    assert all(isinstance(e, str) for e in errors)  # bind raised a ValueError on both ranks
    assert errors[0] == errors[1]
    assert "torch.export could not trace DataDependent" in errors[1]


def test_outcome_json_round_trip_and_bad_data():
    assert outcome_from_json(outcome_to_json(None)) is None
    with pytest.raises(ValueError, match=r"cannot read a discovery outcome"):
        outcome_from_json({"kind": "clusters", "clusters": "x"})
    with pytest.raises(ValueError, match=r"Cannot build a Cluster .* unexpected keyword"):
        outcome_from_json({"kind": "clusters", "clusters": [{"name": "a", "writers": ["w"], "evil": 1}]})
