"""Layer units through the callback: cosine layer scores, resume, scores and strategies (DDP, FSDP2, TP on 2 ranks).

References: a one-process run on the same global batches (the distributed layouts compute the same math: DDP and
FSDP2 average the gradients of two halves of each batch, sequence-parallel TP splits the tokens), the hand-written
cosine of tests/unit/scoring/test_layers.py, and the shrunk model's ``numel`` and outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pat import CoupledPruningCallback
from tests.common.dist import once_per_world, result_records, run_rank_scripts
from tests.common.lit_models import ends_mid_ramp, quiet_trainer
from tests.integration.workers import layer_worker
from tests.integration.workers.layer_worker import LitLayers

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "layer_worker.py"


@pytest.fixture(scope="module")
def single() -> dict:
    return layer_worker.fit_single()


#: the variants each 2-rank layout fits, in sequence in ONE launch of its 2 ranks
VARIANTS = {"ddp": ["layers", "ranked", "flops"], "fsdp2": ["layers", "ranked", "flops"], "tp": ["layers"]}
VARIANT_TIMEOUT = 360  # seconds per variant (one fit and its shrink) of a launch


@pytest.fixture(scope="module")
def worlds():
    """``runs(kind, variant)``: the 2 ranks' results for that variant, from ONE launch per kind that fits all of the
    kind's variants in sequence (run on first use; a failed launch fails each of its variants with the same report)."""

    def launch(kind: str) -> list[dict]:
        variants = VARIANTS[kind]
        return result_records(
            run_rank_scripts(WORKER, 2, args=[kind, ",".join(variants)], timeout=VARIANT_TIMEOUT * len(variants))
        )

    launched = once_per_world(launch)

    def runs(kind: str, variant: str) -> list[dict]:
        return [r for r in launched(kind) if r["variant"] == variant]

    return runs


@pytest.fixture(scope="module", params=["ranked", "flops"])
def sized(request) -> tuple[str, dict]:
    return request.param, layer_worker.fit_single(request.param)


def test_single_process_drops_layers_by_cosine_and_shrinks_to_the_reported_size(single):
    scores = single["layer_scores"]
    dropped_layers = sorted(int(k.split(".")[1]) for k, v in single["dropped"].items() if k.startswith("layer.") and v)
    assert dropped_layers
    assert single["num_layers"] == layer_worker.CFG.n_layer - len(dropped_layers)
    # a dropped layer is the identity in every later forward: its latest score is exactly 0
    assert all(scores[f"layer.{i}"] == 0.0 for i in dropped_layers)
    assert all(scores[k] > 0.0 for k in scores if int(k.split(".")[1]) not in dropped_layers)
    assert single["shrunk_params"] == single["achieved"]
    assert single["rel"] < 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(400 * 3)  # the first use of a kind runs its launch (up to 3 variants)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "tp"])
def test_two_ranks_select_the_layers_of_the_one_process_run(kind, single, worlds):
    results = worlds(kind, "layers")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["all_ranks_equal"]
        assert r["step"] == layer_worker.MAX_STEPS
        assert r["dropped"] == single["dropped"]  # the same layers and widths as one process on the same batches
        assert r["achieved"] == single["achieved"]
        assert r["layer_scores"] == pytest.approx(single["layer_scores"], rel=1e-4, abs=1e-6)
        assert r["shrunk_params"] == r["achieved"]  # shrink after the distributed fit
        assert r["num_layers"] == single["num_layers"]
        assert r["rel"] < 1e-5
        assert r["checksum"] == pytest.approx(single["checksum"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(400 * 3)  # the first use of a kind runs its launch (up to 3 variants)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_two_ranks_meet_ranked_widths_and_flop_targets_like_one_process(kind, sized, worlds):
    """``target_widths="ranked"`` and ``target_flops`` under DDP and FSDP2: the same units and the same shrunk shapes as
    one process on the same batches, and the shrunk model has exactly the reported size."""
    variant, reference = sized
    results = worlds(kind, variant)
    assert [r["rank"] for r in results] == [0, 1]
    measured = "shrunk_flops" if variant == "flops" else "shrunk_params"
    assert reference[measured] == reference["achieved"]
    for r in results:
        assert r["all_ranks_equal"]
        assert r["dropped"] == reference["dropped"]
        assert r["achieved"] == reference["achieved"]
        assert r[measured] == r["achieved"]
        assert r["widths"] == reference["widths"]
        assert r["rel"] < 1e-5


def _callback(**kwargs) -> CoupledPruningCallback:
    return CoupledPruningCallback(
        "tiny_gpt", preset_options={"layers": True}, target_sparsity=0.5, warmup_steps=1, ramp_steps=4,
        every_n_steps=2, **kwargs,
    )  # fmt: skip


def test_resume_between_selections_restores_the_layer_sums_bitwise(tmp_path):
    """Checkpoint after a hold step (sums of its forwards pending), resume: the next selection sees the same sums."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ref_cb = _callback()
    reference = LitLayers(batch_size=4)
    quiet_trainer(max_steps=6, callbacks=[ref_cb]).fit(reference)

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    first_cb = _callback()
    with ends_mid_ramp():
        quiet_trainer(max_steps=4, callbacks=[first_cb, ckpt], checkpointing=True).fit(LitLayers(batch_size=4))
    assert first_cb.controller.run.collectors.layers.seen()  # the checkpoint holds pending sums
    resumed, cb = LitLayers(batch_size=4), _callback()
    quiet_trainer(max_steps=6, callbacks=[cb]).fit(resumed, ckpt_path=str(next(tmp_path.glob("*.ckpt"))))
    assert cb.controller.run.collectors.layers.last == ref_cb.controller.run.collectors.layers.last  # exact floats
    assert cb.dropped == ref_cb.dropped
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_layer_units_with_the_activation_score_fit_and_shrink():
    from lightning_pat import shrink

    lit, cb = LitLayers(batch_size=4), _callback(score="activation")
    quiet_trainer(max_steps=6, callbacks=[cb]).fit(lit)
    act = cb.controller.run.collectors.act
    assert act is not None
    assert "layer.0" not in {rc.name for rc in act.clusters}  # layers: scored by the cosine
    assert sum(bool(cb.dropped[f"layer.{i}"]) for i in range(4)) == 2
    lit.eval()
    ids = layer_worker.ids()
    ref = lit.model(ids)
    small = shrink(lit, cb)
    assert len(small.model.layers) == 2
    assert float((small.model(ids) - ref).abs().max() / ref.abs().max()) < 1e-5


def test_layer_score_weight_keeps_the_weight_norm_ranking():
    lit, cb = LitLayers(batch_size=4), _callback(layer_score="weight", mode="direct")
    quiet_trainer(max_steps=6, callbacks=[cb]).fit(lit)
    assert cb.controller.run.collectors.layers is None
    assert sum(bool(cb.dropped[f"layer.{i}"]) for i in range(4)) == 2
