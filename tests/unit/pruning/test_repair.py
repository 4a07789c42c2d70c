"""The least-squares refit of cut readers (lightning_pat.pruning.repair) against an independent least-squares solve.

The reference stacks every calibration input of the reader in float64 and solves the ridge problem
``min_V ||X_S V^T - X W^T||^2 + lambda ||V||^2`` with ``torch.linalg.lstsq`` on the augmented system
``[X_S; sqrt(lambda) I] V^T = [X W^T; 0]`` (no Gram matrix, no normal equations), with ``lambda`` the library's
relative ridge times the mean of ``diag(X_S^T X_S)``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, prune_clusters, shrink
from lightning_pat.pruning.repair import calibrate_readers, refit_readers

HIDDEN = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
BLOCKS = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"], num_units=4)  # 2 channels per unit


def net(seed: int = 0, hidden: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def batches(seed: int = 1, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(40, 5, generator=g) for _ in range(n)]


def reference(model: nn.Sequential, xs: list[torch.Tensor], dense_w: torch.Tensor, keep: list[int], ridge: float):
    x = torch.cat([torch.relu(model[0](b)).detach().double() for b in xs])  # the reader's inputs (writers unpruned)
    y = x @ dense_w.double().T
    xs_ = x[:, keep]
    lam = ridge * float((xs_ * xs_).sum(0).mean())
    a = torch.cat([xs_, lam**0.5 * torch.eye(len(keep), dtype=torch.float64)])
    b = torch.cat([y, torch.zeros(len(keep), y.shape[1], dtype=torch.float64)])
    v = torch.linalg.lstsq(a, b).solution.T
    out = torch.zeros_like(dense_w, dtype=torch.float64)
    out[:, keep] = v
    return out


@pytest.mark.parametrize("ridge", [0.0, 1e-2])
def test_refit_matches_an_independent_least_squares_solve(ridge):
    model, xs = net(), batches()
    dense = model[2].weight.detach().clone()
    inputs_model = net()  # the same weights: the reader's inputs as the dense writers produce them
    grams = calibrate_readers(model, HIDDEN, xs)
    result = prune_clusters(model, HIDDEN, 0.5)
    keep = [c for c in range(8) if c not in result.dropped["h"]]
    report = refit_readers(model, result, grams, ridge=ridge)
    want = reference(inputs_model, xs, dense, keep, ridge)
    torch.testing.assert_close(model[2].weight.double(), want, rtol=1e-5, atol=1e-6)
    assert (model[2].weight[:, result.dropped["h"]] == 0).all()
    assert report.modules == {"2": (4, 4)}
    before, after = report.error["2"]
    assert 0 <= after < before


def test_refit_maps_unit_blocks_to_their_channels_and_shrinks_exactly():
    model, xs = net(), batches()
    dense = model[2].weight.detach().clone()
    grams = calibrate_readers(model, BLOCKS, xs)
    result = prune_clusters(model, BLOCKS, 0.5)  # 2 of 4 units = 4 of 8 channels
    dropped_ch = sorted(2 * u + i for u in result.dropped["h"] for i in range(2))
    keep = [c for c in range(8) if c not in dropped_ch]
    refit_readers(model, result, grams, ridge=1e-3)
    torch.testing.assert_close(model[2].weight.double(), reference(net(), xs, dense, keep, 1e-3), rtol=1e-5, atol=1e-6)
    x = torch.randn(7, 5)
    masked = model(x)
    small = shrink(model, result)
    assert small[2].in_features == 4
    torch.testing.assert_close(small(x), masked, rtol=1e-5, atol=1e-6)


def test_refit_lowers_the_loss_of_a_tiny_llama_and_skips_what_it_cannot_refit():
    transformers = pytest.importorskip("transformers")
    from lightning_pat import presets

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def loss(m: nn.Module) -> float:
        with torch.no_grad():
            return sum(float(m(b, labels=b).loss) for b in data)

    decls = presets.llama(model, layers=False)
    grams = calibrate_readers(model, decls, data, forward=lambda m, b: m(b))
    plain = transformers.LlamaForCausalLM(cfg).eval()
    plain.load_state_dict(model.state_dict())
    result = prune_clusters(model, decls, 0.5)
    prune_clusters(plain, decls, 0.5)
    report = refit_readers(model, result, grams)
    readers = {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.o_proj")}
    assert set(report.modules) == readers
    assert all(after < before for before, after in report.error.values())
    for name, (kept, dropped) in report.modules.items():
        assert (kept, dropped) == ((24, 24) if "down_proj" in name else (16, 16))
    x = data[0]
    with torch.no_grad():
        masked = model(x).logits
    small = shrink(model, result)
    with torch.no_grad():
        torch.testing.assert_close(small(x).logits, masked, rtol=1e-4, atol=1e-5)
    # dense statistics of a model whose upstream layers were cut too: not guaranteed, but the layer errors above are
    assert loss(small) < loss(plain) + 1.0

    # residual (read by the embedding, no nn.Linear) and layer units are reported, not refit
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    grams = calibrate_readers(fresh, presets.llama(fresh, mlp=False, heads=False, residual=True), data)
    assert "nn.Linear" in grams.skipped["residual"]
    grams = calibrate_readers(fresh, presets.llama(fresh, mlp=False, heads=False, layers=True), data)
    assert len(grams.skipped) == 2
    assert all("layer unit" in why for why in grams.skipped.values())


def test_rows_cut_by_layer_units_stay_zero_so_the_layer_is_removed_exactly():
    transformers = pytest.importorskip("transformers")
    from lightning_pat import presets

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    decls = presets.llama(model, mlp=True, heads=False, layers=True)
    grams = calibrate_readers(model, decls, data)
    result = prune_clusters(model, decls, target_params=0.6)
    gone = [int(n.split(".")[1]) for n, units in result.dropped.items() if n.startswith("layer.") and units]
    assert gone  # the cut removes layers and MLP channels
    refit_readers(model, result, grams)
    for i in gone:
        assert (model.model.layers[i].mlp.down_proj.weight == 0).all()
    x = data[0]
    with torch.no_grad():
        masked = model(x).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shrink warns when a removed layer's output projection is not zero
        small = shrink(model, result)
    assert len(small.model.layers) == 4 - len(gone)
    with torch.no_grad():
        torch.testing.assert_close(small(x).logits, masked, rtol=1e-4, atol=1e-5)


def test_bad_input_raises_before_anything_changes():
    model, xs = net(), batches()
    grams = calibrate_readers(model, HIDDEN, xs)
    result = prune_clusters(model, HIDDEN, 0.5)
    before = model[2].weight.detach().clone()
    for ridge in (-1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="ridge"):
            refit_readers(model, result, grams, ridge=ridge)
    with pytest.raises(ValueError, match="not calibrated for"):
        refit_readers(model, {"other": [0]}, grams)
    torch.testing.assert_close(model[2].weight, before)
    shrink(model, result)
    with pytest.raises(ValueError, match="refit before `shrink`"):
        refit_readers(model, result, grams)
    with pytest.raises(ValueError, match="no batch reached"):
        calibrate_readers(net(), HIDDEN, [])


def test_nothing_dropped_leaves_the_weights_and_says_so():
    model, xs = net(), batches()
    grams = calibrate_readers(model, HIDDEN, xs)
    before = model[2].weight.detach().clone()
    report = refit_readers(model, {"h": []}, grams)
    torch.testing.assert_close(model[2].weight, before)
    assert report.modules == {}
    assert report.skipped == {"h": "nothing dropped"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_calibration_value_is_refused_naming_the_reader_and_the_batch(bad):
    model, xs = net(), batches()
    xs[2][0, 0] = bad
    with pytest.raises(ValueError, match=r"reader '2'.*batch 2.*not finite"):
        calibrate_readers(model, HIDDEN, xs)


def test_large_finite_inputs_do_not_overflow_the_gram():
    # inputs of 1e30 square to 1e60, past float32; the Gram is summed in float64, so the refit equals the one at
    # scale 1 (the least-squares solution does not depend on the inputs' scale)
    model, xs = net(), batches()
    scaled = net()
    scaled[0].weight.data *= 1e30
    scaled[0].bias.data *= 1e30
    grams = calibrate_readers(model, HIDDEN, xs)
    big = calibrate_readers(scaled, HIDDEN, xs)
    assert torch.isfinite(big.gram["2"]).all()
    result = prune_clusters(model, HIDDEN, 0.5)
    refit_readers(model, result, grams)
    report = refit_readers(scaled, result.dropped, big)
    assert torch.isfinite(scaled[2].weight).all()
    torch.testing.assert_close(scaled[2].weight, model[2].weight, rtol=1e-4, atol=1e-6)
    before, after = report.error["2"]
    assert 0.0 < after <= before


def test_gram_overflowing_float64_is_refused():
    model, xs = net(), batches()
    model[0].weight.data *= 1e200
    model[0].bias.data *= 1e200
    with pytest.raises(ValueError, match=r"reader '2'.*not finite"):
        calibrate_readers(model, HIDDEN, xs)


def two_readers() -> tuple[nn.Sequential, list[Cluster]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    clusters = [
        Cluster("a", writers=["0.weight", "0.bias"], readers=["2.weight"]),
        Cluster("b", writers=["2.weight", "2.bias"], readers=["4.weight"]),
    ]
    return model, clusters


def test_a_singular_system_is_refused_before_any_reader_changes():
    # ridge=0 with fewer calibration rows (5) than kept columns (8) of the second reader: the first one (2 kept
    # columns) solves, but nothing is written before every reader has solved
    model, clusters = two_readers()
    grams = calibrate_readers(model, clusters, [torch.randn(5, 6, generator=torch.Generator().manual_seed(0))])
    result = prune_clusters(model, clusters, 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"reader '4'.*5 calibration rows.*8 kept input columns.*ridge > 0"):
        refit_readers(model, result, grams, ridge=0.0)
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    report = refit_readers(model, result, grams)  # the default ridge solves it
    assert set(report.modules) == {"2", "4"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_all_zero_calibration_is_refused_naming_the_reader_and_the_fix():
    model = nn.Sequential(nn.Linear(16, 64, bias=False), nn.ReLU(), nn.Linear(64, 16))
    hidden = Cluster(name="hidden", writers=["0.weight"], readers=["2.weight"])
    grams = calibrate_readers(model, hidden, [torch.zeros(8, 16)])
    result = prune_clusters(model, hidden, 0.5, score="rms")
    before = model[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"reader '2'.*8 calibration rows.*32 kept input columns.*all zero"):
        refit_readers(model, result, grams)
    torch.testing.assert_close(model[2].weight, before, rtol=0, atol=0)
