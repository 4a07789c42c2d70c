"""Depth pruning: layer units zero whole decoder layers, ``shrink`` deletes them and the export reloads stock.

References: the masked model's own logits and greedy ``generate`` (a zeroed pre-norm layer is the identity), the
layer count and ``layer_idx`` read off the shrunk modules, and the parameter count of the shrunk model.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, load_pretrained, presets, prune_clusters, resolve_clusters, save_pretrained, shrink
from lightning_pat.core.layers import LAYER_BUDGET
from lightning_pat.sizing.problem import parse_size
from tests.common.tiny_families import gpt2, llama_like, logits, tiny_gpt, token_ids

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

LLAMA = llama_like("llama", n_head=4, n_kv=2, tied=True, n_layer=4)
QWEN3 = llama_like("qwen3", n_head=4, n_kv=2, bias=True, n_layer=4)
CASES = [LLAMA, QWEN3, gpt2(n_head=4, n_layer=4), tiny_gpt(n_head=4, n_kv=2, n_layer=4)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def eager(model: nn.Module) -> nn.Module:
    if hasattr(model, "config") and hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = "eager"
    return model


def test_preset_declares_one_unit_per_layer_in_the_layers_budget():
    model = LLAMA.fresh()
    decls = presets.llama(model, mlp=False, heads=False, layers=True)
    [rc0, *rest] = resolve_clusters(model, decls)
    assert len(rest) == LLAMA.n_layer - 1
    assert (rc0.name, rc0.num_units, rc0.budget) == ("layer.0", 1, LAYER_BUDGET)
    assert [m.name for m in rc0.members] == [
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    assert {m.dim for m in rc0.members} == {0}
    with pytest.raises(ValueError, match="`layers=True` with `residual=True` is not supported"):
        presets.llama(model, residual=True, layers=True)
    with pytest.raises(ValueError, match="layers=True"):
        presets.linear_chain(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), layers=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("widths", [False, True], ids=["depth", "depth+width"])
def test_shrink_removes_dropped_layers_exactly(case, widths):
    model = case.fresh()
    decls = presets.get(case.preset)(model, mlp=widths, heads=widths, layers=True)
    result = prune_clusters(model, decls, 0.5)
    dropped_layers = [i for i in range(case.n_layer) if result.dropped[f"layer.{i}"]]
    assert len(dropped_layers) == case.n_layer // 2
    ids = token_ids()
    ref = logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not zero" warning: the dropped layers are exact zeros
        small = shrink(model, result, inplace=False)
    layers = small.get_submodule(case.layers)
    assert len(layers) == case.n_layer - len(dropped_layers)
    assert rel(logits(small, ids), ref) < 1e-5
    config = getattr(small, "config", None)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            assert getattr(config, name) == len(layers)
    for new, layer in enumerate(layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                assert module.layer_idx == new


@pytest.mark.parametrize("case", [LLAMA, QWEN3], ids=lambda c: c.id)
def test_depth_export_reloads_with_stock_from_pretrained_and_generates(tmp_path, case):
    model = case.fresh()
    result = prune_clusters(model, presets.llama(model, layers=True), 0.5)
    ids = token_ids()
    masked_gen = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    small = shrink(model, result, inplace=False)
    ref = logits(model, ids)
    save_pretrained(small, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == case.n_layer // 2
    if "layer_types" in config:
        assert len(config["layer_types"]) == case.n_layer // 2
    again = eager(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    assert rel(logits(again, ids), ref) < 1e-5
    assert rel(logits(eager(load_pretrained(tmp_path)), ids), ref) < 1e-5
    for m in (small, again):  # the KV cache follows the renumbered layers
        assert torch.equal(m.generate(ids[:1, :4], max_new_tokens=6, do_sample=False), masked_gen)


def test_target_params_mixes_depth_and_width_and_counts_exactly():
    model = LLAMA.fresh()
    total = sum(p.numel() for p in model.parameters())
    result = prune_clusters(model, presets.llama(model, layers=True), target_params=0.5)
    size = result.size
    assert size is not None
    assert size.dropped_layers >= 1
    assert size.achieved <= parse_size(0.5, total=total) < size.above
    small = shrink(model, result)
    assert sum(p.numel() for p in small.parameters()) == size.achieved
    assert len(small.model.layers) == LLAMA.n_layer - size.dropped_layers


def test_depth_only_target_counts_whole_layers():
    model = LLAMA.fresh()
    total = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    result = prune_clusters(
        model, presets.llama(model, mlp=False, heads=False, layers=True), target_params=total - 2 * per_layer
    )
    assert result.size is not None
    assert (result.size.dropped_layers, result.size.achieved) == (2, total - 2 * per_layer)
    assert result.size.above == total - per_layer
    assert sum(p.numel() for p in shrink(model, result).parameters()) == total - 2 * per_layer


def test_custom_declaration_of_layer_units():
    """The declaration form for custom models: a 1-unit cluster per block in the ``layers`` budget."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(6)
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            return x + self.fc(self.norm(x))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Sequential(*[Block() for _ in range(4)]))
    decl = Cluster("block.{i}", writers=[r"re:1\.(?P<i>\d+)\.fc\.(?:weight|bias)"], num_units=1, budget="layers")
    x = torch.randn(5, 3)
    result = prune_clusters(net, decl, 0.5)
    ref = net(x)
    with pytest.raises(ValueError, match="not an element of an nn.ModuleList"):
        shrink(net, result, inplace=False)  # nn.Sequential is not a ModuleList: refused before any change
    assert torch.equal(net(x), ref)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_target_layers_fixes_the_depth_and_widths_make_up_the_rest(keep):
    model = LLAMA.fresh()
    total = sum(p.numel() for p in model.parameters())
    target = 0.6
    if keep < 3:  # 0.6 of the model needs 3 of 4 layers: fewer cannot reach it, and say the most they hold (issue 23)
        with pytest.raises(ValueError, match=rf"`target_layers={keep}` keeps at most ([\d,]+) parameters") as err:
            prune_clusters(model, presets.llama(model, layers=True), target_params=0.6, target_layers=keep)
        target = int(re.search(r"keeps at most ([\d,]+)", str(err.value))[1].replace(",", ""))
        assert target < parse_size(0.6, total=total)
    result = prune_clusters(model, presets.llama(model, layers=True), target_params=target, target_layers=keep)
    assert result.size is not None
    assert result.size.kept["layers"] == keep
    assert result.size.achieved <= parse_size(target, total=total)
    if keep < 3:
        assert result.size.achieved == target  # the largest reachable count is reachable: every width full
    small = shrink(model, result)
    assert len(small.model.layers) == keep
    assert sum(p.numel() for p in small.parameters()) == result.size.achieved


def test_target_layers_refusals():
    model = LLAMA.fresh()
    with pytest.raises(ValueError, match=r"`target_layers` = 5 layers to keep, but the clusters hold 4 .*1 to 4"):
        prune_clusters(model, presets.llama(model, layers=True), target_params=0.6, target_layers=5)
    with pytest.raises(ValueError, match=r"hold 0 layer units; add them with preset_options=\{'layers': True\}"):
        prune_clusters(model, presets.llama(model), target_params=0.6, target_layers=2)
    with pytest.raises(ValueError, match="set `target_params` too"):
        prune_clusters(model, presets.llama(model, layers=True), 0.5, target_layers=2)
    assert all(bool(p.ne(0).any()) for p in model.parameters())


def test_target_params_never_empties_a_one_unit_cluster():
    """MQA (one KV head): `target_sparsity` would empty the heads clusters and is refused; a size target keeps them."""
    case = llama_like("llama", n_head=4, n_kv=1, n_layer=2)
    model = case.fresh()
    with pytest.raises(ValueError, match="would remove every unit"):
        prune_clusters(case.fresh(), presets.llama(model), 0.5)
    result = prune_clusters(model, presets.llama(model), target_params=0.7)
    assert result.size is not None
    assert result.size.kept["heads"] == 1
    assert not any(result.dropped[f"heads.{i}"] for i in range(2))
    assert sum(p.numel() for p in shrink(model, result).parameters()) == result.size.achieved
