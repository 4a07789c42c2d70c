"""Widths one stock config field sets, found as two declarations, keep one width (issue 37, "stock configs").

Jamba's ``intermediate_size`` is the width of its dense MLPs and of its experts' channels; ``clusters="auto"`` finds
them as two declarations (a discovered MLP, the MoE preset's expert channels, ``multiple_of`` 1 and 8). Cut apart,
a ratio of 0.3 kept 89 and 88 channels and a size target 86 and 72, and stock ``from_pretrained`` refused the export.
The tie is found by structure (``shrink/stock_config.py``'s ``tied_declarations``: one declaration cut alone on a
meta copy, the class built from the config the shrink updated, another declaration's members built at other
shapes) and the tied declarations keep one width. The references: the masked model's logits, and the stock
reload's shapes and logits.
"""

from __future__ import annotations

import logging
import tempfile

import pytest
from torch import nn

from lightning_pat import Cluster, prune_clusters, shrink
from lightning_pat.pruning.declarations import one_shot_declarations
from lightning_pat.pruning.tied_widths import tagged_declaration, tie_widths
from lightning_pat.shrink.stock_config import tied_declarations
from tests.common import lm_zoo

pytest.importorskip("transformers")


CALIBRATION = [lm_zoo.token_ids(seed=s) for s in (2, 3)]


@pytest.fixture(scope="module")
def auto():
    """Tiny Jamba's ``clusters="auto"`` declarations, as ``prune_clusters`` finds them (traced once: the slow part)."""
    return one_shot_declarations(lm_zoo.build("jamba"), "auto", CALIBRATION)


def _cut(declared, **how):
    """A fresh tiny Jamba pruned and shrunk: (the result, the masked logits, the shrunk model, ids, its size)."""
    model = lm_zoo.build("jamba")
    ids = lm_zoo.token_ids()
    res = prune_clusters(model, declared, calibration=CALIBRATION, **how)
    masked = lm_zoo._logits(model, ids)  # noqa: SLF001
    total = sum(p.numel() for p in model.parameters())
    return res, masked, shrink(model, res, example_input=None), ids, total


def _stock(small):
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        small.save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp)


def _widths(model):
    """Layer 0's dense MLP width and layer 1's expert width of a (tiny, two-layer) Jamba."""
    layers = model.model.layers
    return layers[0].feed_forward.down_proj.in_features, layers[1].feed_forward.experts.down_proj.shape[-1]


def test_auto_labels_jambas_dense_mlp_as_its_expert_channels(auto):
    mlp = [(c.name, c.multiple_of, c.writers[0]) for c in auto if c.name == "mlp.{layer}"]
    assert [(name, multiple) for name, multiple, _ in mlp] == [("mlp.{layer}", 8)] * 2  # one label, lcm(1, 8)
    assert sorted("experts" in w for *_, w in mlp) == [False, True]  # the discovered MLP (layer 0), the experts'


def test_jamba_at_a_ratio_keeps_one_intermediate_size_and_reloads_stock(auto):
    res, masked, small, ids, _ = _cut(auto, sparsity=0.3)
    dense, experts = _widths(small)
    assert dense == experts == small.config.intermediate_size == 88  # 128 - 40: a multiple of 8 for both
    assert {"mlp.0", "mlp.1"} <= set(res.num_units)  # the discovered MLP is labelled as the experts' declaration
    assert lm_zoo._rel(lm_zoo._logits(small, ids), masked) < lm_zoo.EXACT  # noqa: SLF001
    stock = _stock(small)
    assert _widths(stock) == (88, 88)
    assert lm_zoo._rel(lm_zoo._logits(stock, ids), masked) < lm_zoo.EXACT  # noqa: SLF001


def test_jamba_with_target_params_keeps_one_intermediate_size_and_reloads_stock(auto):
    model = lm_zoo.build("jamba")
    body, full = lm_zoo.non_embedding_params(model), sum(p.numel() for p in model.parameters())
    target = full - body + int(0.6 * body)  # the zoo bench's target_params column
    res, masked, small, ids, total = _cut(auto, target_params=target)
    dense, experts = _widths(small)
    assert dense == experts == small.config.intermediate_size < 128
    counted = sum(p.numel() for p in small.parameters())
    assert res.size is not None
    assert counted == res.size.achieved <= target < (res.size.above or total + 1)
    assert lm_zoo._rel(lm_zoo._logits(small, ids), masked) < lm_zoo.EXACT  # noqa: SLF001
    stock = _stock(small)
    assert sum(p.numel() for p in stock.parameters()) == counted
    assert lm_zoo._rel(lm_zoo._logits(stock, ids), masked) < lm_zoo.EXACT  # noqa: SLF001
    small.generation_config.pad_token_id = 0
    assert small.generate(ids[:1, :4], max_new_tokens=2, do_sample=False).shape == (1, 6)


class _Config:
    """A Hugging Face-like config: ``to_dict``, one MLP width for two kinds of block, a shared expert's own width."""

    def __init__(self, intermediate_size: int = 8, shared_expert_intermediate_size: int = 8, last: int = 0) -> None:
        self.hidden_size = 4
        self.intermediate_size = intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.last = last  # if set, a third block of the second kind with this width of its own

    def to_dict(self) -> dict[str, int]:
        return dict(vars(self))


def _pair(width: int) -> nn.Module:
    out = nn.Module()
    out.up_proj, out.down_proj = nn.Linear(4, width, bias=False), nn.Linear(width, 4, bias=False)
    return out


class _Tiny(nn.Module):
    """Block 0: an MLP (``intermediate_size``) and a shared expert (its own field); block 1: another MLP kind."""

    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        first, second = nn.Module(), nn.Module()
        first.mlp, first.shared_expert = _pair(config.intermediate_size), _pair(config.shared_expert_intermediate_size)
        second.ffn = _pair(config.intermediate_size)
        self.blocks = nn.ModuleList([first, second])
        if config.last:
            self.blocks.append(nn.Module())
            self.blocks[2].ffn = _pair(config.last)

    def save_pretrained(self, path: str) -> None:  # pragma: no cover - an HF-like model; never exported here
        raise NotImplementedError(path)


def _mlp(name: str, where: str, multiple_of: int) -> Cluster:
    return Cluster(name, [f"{where}.up_proj.weight"], [f"{where}.down_proj.weight"], multiple_of=multiple_of)


def test_the_tie_is_found_by_structure_and_the_tied_declarations_keep_one_width(caplog):
    model = _Tiny(_Config())
    mlp = _mlp("blocks.0.mlp", "blocks.0.mlp", 2)
    shared = _mlp("blocks.0.shared_expert", "blocks.0.shared_expert", 1)
    ffn = Cluster("ffn.{layer}", [r"re:blocks\.(?P<layer>\d+)\.ffn\.up_proj\.weight"],
                  [r"re:blocks\.(?P<layer>\d+)\.ffn\.down_proj\.weight"], multiple_of=4)  # fmt: skip
    # all three have 8 units; only the MLPs read intermediate_size (the shared expert: a field of its own)
    assert tied_declarations(model, [mlp, shared, ffn]) == [["blocks.0.mlp", "ffn.{layer}"]]
    tied = tie_widths(model, [mlp, shared, ffn])
    assert [(c.name, c.multiple_of) for c in tied] == [("ffn.{layer}", 4), ("blocks.0.shared_expert", 1),
                                                       ("ffn.{layer}", 4)]  # fmt: skip
    from lightning_pat.core.spec import resolve_clusters

    assert [(rc.name, rc.members[0].name) for rc in resolve_clusters(model, tied)] == [
        ("ffn.0", "blocks.0.mlp.up_proj.weight"),
        ("blocks.0.shared_expert", "blocks.0.shared_expert.up_proj.weight"),
        ("ffn.1", "blocks.1.ffn.up_proj.weight"),
    ]
    # the same model held by another module (a LightningModule's `model`, as the callback sees it)
    holder = nn.Module()
    holder.model = _Tiny(_Config())
    pattern = r"re:model\.blocks\.(?P<layer>\d+)\.ffn\.{}_proj\.weight"
    held = [
        _mlp("model.blocks.0.mlp", "model.blocks.0.mlp", 2),
        _mlp("model.blocks.0.shared_expert", "model.blocks.0.shared_expert", 1),
        Cluster("ffn.{layer}", [pattern.format("up")], [pattern.format("down")]),
    ]
    assert tied_declarations(holder, held) == [["model.blocks.0.mlp", "ffn.{layer}"]]
    # the tied declarations differ in their unit counts (a third block of 6): both are left out, with a warning (the
    # one cut would set intermediate_size, and stock from_pretrained would build the other, uncut, at that width)
    model = _Tiny(_Config(last=6))
    assert tied_declarations(model, [mlp, shared, ffn]) == [["blocks.0.mlp", "ffn.{layer}"]]
    with caplog.at_level(logging.WARNING, logger="lightning_pat.pruning.tied_widths"):
        kept = tie_widths(model, [mlp, shared, ffn])
    assert [c.name for c in kept] == ["blocks.0.shared_expert"]
    assert "blocks.0.mlp: one field of the stock config sets its width and that of 'ffn.{layer}'" in caplog.text
    assert "ffn.{layer}: tied to 'blocks.0.mlp', which is not cut" in caplog.text


def test_a_tied_declaration_of_other_names_is_tagged_with_the_leaders_label():
    # HRM's H- and L-module MLPs, and Phi-4-multimodal's vision head MLP beside its encoder layers': no renaming
    # makes them one declaration's, so the other takes the leader's name plus a group `tied` holding its own prefix
    from lightning_pat.core.spec import resolve_clusters
    from lightning_pat.sizing.targets import declaration_labels

    model = _Tiny(_Config())
    mlp = _mlp("blocks.0.mlp", "blocks.0.mlp", 2)  # literal names, no placeholder
    ffn = Cluster("ffn.{layer}", [r"re:blocks\.(?P<layer>\d+)\.ffn\.up_proj\.weight"],
                  [r"re:blocks\.(?P<layer>\d+)\.ffn\.down_proj\.weight@1"], multiple_of=4)  # fmt: skip
    tagged = tagged_declaration(mlp, ffn.name)
    assert tagged is not None
    assert tagged.name == "ffn.{tied}"  # `layer`: no such group in its patterns, dropped
    assert tagged.writers == [r"re:(?P<tied>blocks\.0\.mlp\.)up_proj\.weight"]
    (rc,) = resolve_clusters(model, [tagged])
    assert rc.name == "ffn.blocks.0.mlp."
    assert rc.members == resolve_clusters(model, [mlp])[0].members  # the same members, the same slices
    params = dict(model.named_parameters())
    assert set(declaration_labels(params, [ffn, tagged]).values()) == {"ffn"}  # one label: one width
    regex = tagged_declaration(ffn, "mlp.{layer}")  # a regex with its own group keeps the leader's placeholder
    assert regex is not None
    assert regex.name == "mlp.{layer}.{tied}"
    assert regex.readers == [r"re:(?P<tied>blocks\.)(?P<layer>\d+)\.ffn\.down_proj\.weight@1"]
    assert [r.members for r in resolve_clusters(model, [regex])] == [r.members for r in resolve_clusters(model, [ffn])]
    glob = Cluster("g", ["blocks.*.mlp.up_proj.weight"], ["blocks.0.mlp.down_proj.weight"])
    assert tagged_declaration(glob, "x") is None
