"""``clusters="auto"`` by tracing under DDP and FSDP2 (ModelParallelStrategy), 2 CPU ranks with gloo: rank 0 alone
traces (rank 1 never does) and sends the declarations; every rank ends up with the clusters a single process
discovers (names and fingerprints compared), the ranks agree on the mask, and the dropped units are exactly zero in
the full weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_pat import discover, resolve_clusters
from tests.common.cnn_models import INPUTS, MLP, ConvChain
from tests.common.dist import run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKER = Path(__file__).parent / "workers" / "discovery_worker.py"


def _local_fingerprints(cls) -> list[str]:
    model = cls()
    clusters = discover(model, torch.zeros(INPUTS[cls])).clusters
    return [rc.fingerprint() for rc in resolve_clusters(model, clusters)]


def _launch(strategy: str, model: str) -> list[dict]:
    outputs = run_rank_scripts(WORKER, 2, args=[strategy, model], timeout=200)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert [r["rank"] for r in results] == [0, 1]
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "model", "cls"), [("ddp", "convchain", ConvChain), ("fsdp2", "mlp", MLP)])
def test_discovered_clusters_agree_across_ranks_and_prune(strategy, model, cls):
    results = _launch(strategy, model)
    # the module is wrapped in a LightningModule attribute `model`: same clusters, names with that prefix
    local = discover(cls(), torch.zeros(INPUTS[cls])).clusters
    assert results[0]["names"] == [f"model.{c.name}" for c in local]
    assert [r["traces"] for r in results] == [1, 0]  # discovery runs once, on rank 0
    for r in results:
        assert r["fingerprints"] == results[0]["fingerprints"]
        assert r["dropped"] == results[0]["dropped"]
        assert r["zero_rows"] == sorted(results[0]["dropped"][results[0]["first"]])
    assert all(len(v) > 0 for v in results[0]["dropped"].values())
    if strategy == "fsdp2":
        assert set(results[0]["routes"].values()) == {"sharded"}
