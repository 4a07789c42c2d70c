"""``shrink_on_freeze`` of a non-Llama family under tensor parallel 2 from transformers' own plan (issue 38).

One launch of 2 gloo ranks (``workers/mp_tp_family_worker.py``) fits a tiny Qwen3 (per-head ``q_norm``/``k_norm``),
sharded by ``shard_causal_lm`` from its ``base_model_tp_plan`` (FSDP2 over a data-parallel axis of 1), through the
freeze on the MLP channels. The reference is the same recipe on one process, run here:

* ``target_sparsity=0.5``: every rank selects the one process's units, the model is DTensors at the small size from
  the freeze on, and the final weights (gathered) have the one process's shapes and, within 1e-4, its values (the TP
  matmuls' partial sums round apart);
* ``target_params=0.75``: the size solver rounds each MLP width to a
  multiple of the tensor-parallel size by itself, so the run goes through the freeze instead of being refused at fit
  start; its selection and weights are those of the one process with ``multiple_of=2`` declared on the MLP clusters
  (an independent solve of the same problem), the kept widths are even and the achieved count is within the solver's
  granule of the target.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.common.dist import result_records, run_rank_scripts

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).parent / "workers" / "mp_tp_family_worker.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], Path, str]:
    """The 2 ranks' records by run, the folder holding rank 0's final weights, and the ranks' output."""
    out = tmp_path_factory.mktemp("tp_family")
    outputs = run_rank_scripts(WORKER, 2, args=[str(out)], timeout=240)
    runs: dict[str, list[dict]] = {}
    for record in result_records(outputs):
        runs.setdefault(record["run"], []).append(record)
    assert sorted(runs) == ["params", "sparsity"], outputs[0][-4000:]
    return runs, out, "\n".join(outputs)


def one_process(run: str) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], dict]:
    from tests.integration.workers.mp_tp_family_worker import fit

    module, cb, _ = fit(run, devices=1)
    size = cb.controller.run.size
    return cb.dropped, {n: p.detach().clone() for n, p in module.model.named_parameters()}, size and size.to_dict()


def _same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in want.items()}
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-4, msg=name)


@pytest.mark.timeout(400)
def test_a_qwen3_under_its_own_tensor_parallel_plan_heals_small_with_the_one_process_selection(launched):
    runs, out, _ = launched
    dropped, weights, _ = one_process("sparsity")
    assert any(dropped.values())
    for r in runs["sparsity"]:
        assert r["dropped"] == dropped
        assert r["shrunk"]
        assert r["dtensors"]
        assert all(math.isfinite(x) for x in r["losses"])
    _same_model(torch.load(out / "sparsity.pt", weights_only=True), weights)


@pytest.mark.timeout(400)
def test_target_params_under_tensor_parallel_keeps_widths_the_tensor_parallel_size_divides(launched):
    runs, out, logs = launched
    dropped, weights, size = one_process("params")  # multiple_of=2 declared on the MLP clusters
    for r in runs["params"]:
        assert r["dropped"] == dropped
        assert r["shrunk"]  # through the freeze, sharded again: not refused
        assert r["dtensors"]
        assert r["size"] == size
        kept = {name: 128 - len(units) for name, units in r["dropped"].items()}
        assert sorted(kept) == ["mlp.0", "mlp.1"]
        assert set(kept.values()) == {r["intermediate"]}  # one width over the layers, written to the config
        assert r["intermediate"] % 2 == 0
        assert r["intermediate"] < 128
    # within the solver's granule (2 channels in each layer): not above the target, one granule more would be
    assert size["achieved"] <= size["target"] < size["above"], size
    assert size["above"] - size["achieved"] == 2 * 2 * 3 * 64  # 2 channels of gate, up and down in 2 layers
    _same_model(torch.load(out / "params.pt", weights_only=True), weights)
    assert logs.count("kept counts rounded for 2 cluster(s) ('mlp.0', 'mlp.1') to multiples of 2") == 1
