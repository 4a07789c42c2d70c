"""Layer scores ``1 - cos(input, output)`` (lightning_pat.scoring.layers) against a cosine computed by hand.

Reference: the TinyGPT blocks run one by one outside the model, the cosine of every token written out in float64
(``<x, y> / (|x| |y|)``), averaged over all tokens of all batches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pat import presets
from lightning_pat.core.spec import resolve_clusters
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from lightning_pat.demo.preset import tiny_gpt
from lightning_pat.pruning.pruner import Pruner
from lightning_pat.scoring.layers import LayerStats, token_cosines

CFG = TinyGPTConfig(vocab_size=32, n_layer=3, n_head=2, n_kv_head=2, d_model=16, d_ff=24, max_seq_len=8)


def model_and_stats(seed: int = 0) -> tuple[TinyGPT, list, LayerStats]:
    torch.manual_seed(seed)
    model = TinyGPT(dataclasses.replace(CFG))  # a shrink rewrites its model's config
    clusters = resolve_clusters(model, tiny_gpt(model, mlp=False, heads=False, layers=True))
    return model, clusters, LayerStats(model, clusters)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g) for _ in range(n)]


def reference_scores(model: TinyGPT, inputs: list[torch.Tensor]) -> list[float]:
    """Per layer, ``1 - mean cos`` over every token of ``inputs``, by hand in float64."""
    sums, count = [0.0] * len(model.layers), 0
    with torch.no_grad():
        for idx in inputs:
            x = model.embed(idx)
            rope = model.rope[:, : idx.shape[1]]
            for i, block in enumerate(model.layers):
                y = block(x, rope)
                a, b = x.double().reshape(-1, CFG.d_model), y.double().reshape(-1, CFG.d_model)
                cos = (a * b).sum(dim=1) / (a.square().sum(dim=1).sqrt() * b.square().sum(dim=1).sqrt())
                sums[i] += float(cos.sum())
                x = y
            count += idx.numel()
    return [1.0 - s / count for s in sums]


def test_token_cosines_match_torch_cosine_similarity_in_float64():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 7, generator=g), torch.randn(50, 7, generator=g)
    cos, finite = token_cosines(x, y)
    torch.testing.assert_close(cos, F.cosine_similarity(x.double(), y.double(), dim=1), rtol=1e-6, atol=1e-7)
    assert finite.all()
    assert torch.equal(token_cosines(x, x)[0], torch.ones(50, dtype=torch.float64))  # exactly 1, not 1 - 1e-8
    z = torch.zeros(3, 7)
    z[2] = float("nan")
    w = torch.zeros(3, 7)
    w[1, 0] = 1.0
    cos, finite = token_cosines(z, w)
    assert cos.tolist() == [1.0, 0.0, 0.0]  # both zero: unchanged; one zero: orthogonal; NaN: left out
    assert finite.tolist() == [True, True, False]


def test_training_forwards_give_the_hand_computed_scores():
    model, _, stats = model_and_stats()
    stats.attach()
    inputs = batches(2)
    model.train()
    for idx in inputs:
        model(idx).sum().backward()
    with torch.no_grad():  # eval and no-grad forwards are not training forwards: not counted
        model(inputs[0])
    model.eval()
    model(inputs[1])
    assert stats.seen() == {f"layer.{i}": 2 * inputs[0].numel() for i in range(CFG.n_layer)}
    scores = stats.summed_scores()
    expected = reference_scores(model, inputs)
    assert [float(scores[f"layer.{i}"]) for i in range(CFG.n_layer)] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert stats.seen() == {}  # the selection consumed the sums
    assert stats.summed_scores() is None  # nothing seen since: the caller falls back to the weight score


def test_an_identity_layer_scores_exactly_zero_and_is_dropped_first():
    model, clusters, stats = model_and_stats()
    with torch.no_grad():  # layer 1 adds nothing to the residual stream
        model.layers[1].attn.o_proj.weight.zero_()
        model.layers[1].mlp.down_proj.weight.zero_()
        for i in (0, 2):  # the others: small output projections, so the weight score would drop them first
            model.layers[i].attn.o_proj.weight.mul_(1e-3)
            model.layers[i].mlp.down_proj.weight.mul_(1e-3)
    stats.attach()
    model.train()
    model(batches(1)[0]).sum().backward()
    scores = stats.summed_scores()
    assert float(scores["layer.1"]) == 0.0
    assert min(float(scores["layer.0"]), float(scores["layer.2"])) > 0.0
    pruner = Pruner(model, clusters)
    targets = dict.fromkeys((rc.name for rc in clusters), 1 / 3)
    assert pruner.step(targets, scores=scores).dropped == {"layer.0": [], "layer.1": [0], "layer.2": []}


def test_a_layer_that_changes_little_is_dropped_although_its_weights_are_large():
    """The cosine score, not the weight norm, decides: layer 2's input is scaled to almost nothing."""
    model, clusters, stats = model_and_stats()
    with torch.no_grad():
        model.layers[2].attn_norm.weight.fill_(1e-4)
        model.layers[2].mlp_norm.weight.fill_(1e-4)
        model.layers[2].attn.o_proj.weight.mul_(10.0)
        model.layers[2].mlp.down_proj.weight.mul_(10.0)
    stats.attach()
    model.train()
    model(batches(1)[0]).sum().backward()
    targets = dict.fromkeys((rc.name for rc in clusters), 1 / 3)
    by_cosine = Pruner(model, clusters).select(targets, scores=stats.summed_scores())
    by_weight = Pruner(model, clusters).select(targets)
    assert [k for k, a in by_cosine.items() if a.dropped.numel()] == ["layer.2"]
    assert [k for k, a in by_weight.items() if a.dropped.numel()] != ["layer.2"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_batch_once(reentrant):
    model, _, stats = model_and_stats()
    stats.attach()
    idx = batches(1)[0]
    x = model.embed(idx)
    rope = model.rope[:, : idx.shape[1]]
    model.train()
    for block in model.layers:  # each block's forward runs again inside the backward
        x = checkpoint(block, x, rope, use_reentrant=reentrant)
    x.sum().backward()
    assert stats.seen() == {f"layer.{i}": idx.numel() for i in range(CFG.n_layer)}
    scores = stats.summed_scores()
    expected = reference_scores(model, [idx])
    assert [float(scores[f"layer.{i}"]) for i in range(CFG.n_layer)] == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_state_dict_restores_the_sums_exactly():
    model, _, stats = model_and_stats()
    stats.attach()
    model.train()
    model(batches(1)[0]).sum().backward()
    saved = stats.state_dict()
    _, _, other = model_and_stats()
    other.load_state_dict(saved)
    assert torch.equal(other.stacked(), stats.stacked())
    assert other.state_dict() == saved
    assert {k: float(v) for k, v in other.summed_scores().items()} == {
        k: float(v) for k, v in stats.summed_scores().items()
    }


class DictLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": x + self.attn(x) + self.mlp(x)}


def test_a_layer_whose_output_is_not_the_hidden_state_is_refused_with_the_fix():
    from lightning_pat import Cluster

    net = nn.ModuleDict({"a": DictLayer()})
    rcs = resolve_clusters(
        net, [Cluster("layer.a", writers=["a.attn.weight", "a.mlp.weight"], num_units=1, budget="layers")]
    )
    stats = LayerStats(net, rcs)
    stats.attach()
    net["a"](torch.ones(2, 4))
    with pytest.raises(
        ValueError, match=r"Cluster 'layer.a'.*module 'a' \(DictLayer\).*output dict.*layer_score='weight'"
    ):
        stats.summed_scores()


def test_members_without_a_common_module_are_refused():
    from lightning_pat import Cluster

    net = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    rcs = resolve_clusters(net, [Cluster("odd", writers=["a.weight", "b.weight"], num_units=1, budget="layers")])
    with pytest.raises(ValueError, match=r"Cluster 'odd'.*share no module.*layer_score='weight'"):
        LayerStats(net, rcs)


@pytest.mark.parametrize("case_id", ["llama-h8kv2-bias", "qwen3-h4kv2-bias-tied", "gpt2-h2"])
def test_transformers_layers_are_read_and_an_emptied_layer_scores_zero(case_id):
    """Hugging Face decoder layers (tensor or tuple outputs): the hooks read the model's own hidden states."""
    pytest.importorskip("transformers")
    from tests.common.tiny_families import CASES, token_ids

    case = {c.id: c for c in CASES}[case_id]
    model = case.fresh()
    for module in model.modules():  # deterministic training forwards: the reference comes from the same call
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    options = {"mlp": False, "heads": False, "layers": True}
    clusters = resolve_clusters(model, presets.resolve_preset(case.preset, model, **options))
    params = dict(model.named_parameters())
    with torch.no_grad():  # what a dropped layer unit holds: every member of layer 0 is zero
        for m in next(rc for rc in clusters if rc.name == "layer.0").members:
            params[m.name].zero_()
    stats = LayerStats(model, clusters)
    stats.attach()
    model.train()
    ids = token_ids()
    out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states  # embeddings, then each layer's output (the last one after the final norm)
    assert stats.seen() == {f"layer.{i}": ids.numel() for i in range(case.n_layer)}
    scores = {k: float(v) for k, v in stats.summed_scores().items()}
    assert scores["layer.0"] == 0.0
    for i in range(1, case.n_layer - 1):
        a, b = hidden[i].double().reshape(-1, case.d), hidden[i + 1].double().reshape(-1, case.d)
        cos = (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1))
        assert scores[f"layer.{i}"] == pytest.approx(1.0 - float(cos.mean()), rel=1e-5, abs=1e-7)


def test_one_shot_prune_clusters_ranks_layers_by_calibrated_cosine_and_shrinks_to_size():
    from lightning_pat import prune_clusters, shrink
    from lightning_pat.scoring.layers import calibrate_layers

    def model() -> TinyGPT:
        net, _, _ = model_and_stats()
        with torch.no_grad():  # layer 2 changes almost nothing, but its output projections are the largest
            net.layers[2].attn_norm.weight.fill_(1e-4)
            net.layers[2].mlp_norm.weight.fill_(1e-4)
            net.layers[2].attn.o_proj.weight.mul_(10.0)
            net.layers[2].mlp.down_proj.weight.mul_(10.0)
        return net.eval()

    net = model()
    decls = tiny_gpt(net, layers=True)
    stats = calibrate_layers(net, decls, batches(3))
    assert stats.seen() == {f"layer.{i}": 3 * batches(1)[0].numel() for i in range(CFG.n_layer)}
    expected = reference_scores(net, batches(3))
    got = [float(stats.scores()[f"layer.{i}"]) for i in range(CFG.n_layer)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)  # float32 dot products: ~1e-7 in cos
    result = prune_clusters(net, decls, target_params=0.65, target_layers=2, layer_stats=stats)  # 2 layers: <= 0.69
    assert [i for i in range(CFG.n_layer) if result.dropped[f"layer.{i}"]] == [2]
    small = shrink(net, result)
    assert sum(p.numel() for p in small.parameters()) == result.size.achieved
    by_weight = prune_clusters(model(), decls, target_params=0.65, target_layers=2, score="rms")
    assert [i for i in range(CFG.n_layer) if by_weight.dropped[f"layer.{i}"]] != [2]
    # calibration= calibrates the layer cosines too (and the widths' activation statistics)
    calibrated = prune_clusters(model(), decls, target_params=0.65, target_layers=2, calibration=batches(3))
    assert [i for i in range(CFG.n_layer) if calibrated.dropped[f"layer.{i}"]] == [2]


def test_calibrate_layers_refuses_clusters_without_layer_units():
    from lightning_pat.scoring.layers import calibrate_layers

    net, _, _ = model_and_stats()
    with pytest.raises(ValueError, match=r"calibrate_layers: the clusters hold no layer unit.*layers=True"):
        calibrate_layers(net, tiny_gpt(net), batches(1))


def test_the_controller_falls_back_to_the_weight_score_with_a_warning_when_no_layer_ran_in_training():
    """A model kept in eval mode during training: no training forward, so the weight RMS ranks the layers."""
    from lightning_pat.pruning.options import PruningOptions
    from lightning_pat.training.controller import PruningController

    def fit(layer_score: str) -> dict:
        net, _, _ = model_and_stats()
        opts = PruningOptions(
            "tiny_gpt", preset_options={"mlp": False, "heads": False, "layers": True}, target_sparsity=1 / 3,
            ramp_steps=1, mode="direct", layer_score=layer_score,
        )  # fmt: skip
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        ctl = PruningController(opts)
        ctl.bind(net, optimizers=[opt])
        ctl.start()
        net.eval()
        net(batches(1)[0]).sum().backward()
        ctl.after_backward(opt)
        opt.step()
        ctl.after_step()
        return ctl.dropped

    with pytest.warns(UserWarning, match=r"no layer saw a training forward before the selection at step 1.*weight"):
        by_fallback = fit("cosine")
    assert by_fallback == fit("weight")
    assert sum(map(bool, by_fallback.values())) == 1
