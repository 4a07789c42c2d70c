"""Zamba and Zamba 2 (issue 37): their mixers and their shared transformer, cut exactly, reloaded by stock classes.

One tiny model per cause, each pruned one-shot with the clusters ``clusters="auto"`` adds for it (the mixers'
units found by structure; the shared MLP as discovery finds it, traced on the stock ``Zamba2MLP`` alone: tracing a
whole Zamba model takes the bench's tens of seconds), shrunk, saved and reloaded by stock ``from_pretrained``:

* Zamba's Mamba 1 mixers split into heads (``n_mamba_heads``, each head its own ``x_proj``/``dt_proj``): a head is
  the unit, ``n_mamba_heads`` and ``mamba_expand`` are told;
* Zamba 2's shared MLP (a fused ``gate_up_proj`` plus its LoRA-style ``gate_up_proj_adapter_list``, summed before
  the ``chunk``) and the adapters' rank (``adapter_rank``); the block's output (``down_proj`` rows, the hybrid
  layer's ``linear`` columns) is a hidden width the stock config cannot express, and only that cut is refused;
* Zamba 2's Mamba 2 mixers: one group under the gated norm (the default) has no exact unit and ``mixers`` says why;
  with ``mamba_ngroups=2`` whole groups are cut.

The reference is independent of the library's masking: the dropped units' contributions removed by hand (their
columns of the layer that reads them zeroed: ``out_proj`` for a mixer's heads and groups, ``down_proj`` for MLP
channels, the adapter's second layer for its rank).
"""

from __future__ import annotations

import copy
import logging
import tempfile

import pytest
import torch

from tests.common import lm_zoo

pytest.importorskip("transformers")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _zero_columns(model, dropped, clusters, readers):
    """``model`` with the dropped units' input columns of each cluster's reader ``readers[cluster]`` zeroed."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for c in clusters:
            weight = params[readers[c.name]]
            block = weight.shape[1] // c.num_units
            for unit in dropped.get(c.name, []):
                weight[:, unit * block : (unit + 1) * block] = 0
    return model


def _prune_shrink_reload(model, clusters, readers):
    """One-shot 50% with ``clusters``; the hand reference, the shrunk model and its stock reload (their logits)."""
    from transformers import AutoModelForCausalLM

    from lightning_pat import prune_clusters, save_pretrained, shrink

    ids = lm_zoo.token_ids()
    dense = lm_zoo.non_embedding_params(model)
    original = copy.deepcopy(model)
    result = prune_clusters(model, clusters, 0.5, calibration=[lm_zoo.token_ids(seed=2)])
    reference = _logits(_zero_columns(original, result.dropped, clusters, readers), ids)
    small = shrink(model, result, example_input=None)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(small, tmp, overwrite=True, tokenizer=None)
        stock = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
        assert type(stock) is type(small)
    with torch.no_grad():
        generated = stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)
    cut = 1 - lm_zoo.non_embedding_params(small) / dense
    return result, reference, _logits(small, ids), _logits(stock, ids), small, stock, cut


# ---------------------------------------------------------------------------------------------------- Zamba
@pytest.fixture(scope="module")
def zamba():
    from lightning_pat.presets.ssm import mixers

    model = lm_zoo.build("zamba")  # 4 layers (2 hybrid), 8 mixer heads of 16, hidden 64
    clusters = mixers(model)
    readers = {c.name: c.readers[0] for c in clusters}
    return clusters, _prune_shrink_reload(model, clusters, readers)


def test_zamba_mixer_heads_are_units_the_config_holds(zamba):
    clusters, _ = zamba
    assert [c.name.rsplit(".", 1)[-1] for c in clusters] == ["heads"] * 4  # one cluster per mixer
    assert {(c.num_units, c.multiple_of) for c in clusters} == {(8, 4)}  # 4 heads of 16 = one hidden: expand 1
    writers = set(clusters[0].writers)
    own = ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D", "in_proj.weight", "conv1d.bias")
    assert all(any(w.endswith(p) for w in writers) for p in own)  # the per-head parameters go with the head


def test_zamba_heads_cut_exactly_and_stock_reload_equals(zamba):
    _, (result, reference, shrunk, reloaded, small, stock, cut) = zamba
    assert all(len(result.dropped[c]) == 4 for c in result.dropped if c.endswith(".heads"))
    assert _rel(shrunk, reference) < 1e-4
    assert _rel(reloaded, reference) < 1e-4
    assert (small.config.n_mamba_heads, small.config.mamba_expand, small.config.mamba_dt_rank) == (4, 1, 8)
    mixer = stock.model.layers[0].mamba
    assert (mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.in_proj.out_features) == (4, 16, 128)
    assert cut >= 0.2  # the mixers are two thirds of the tiny model


# ---------------------------------------------------------------------------------------------------- Zamba 2
def _shared_mlp(model):
    """The shared MLP's clusters as discovery finds them, traced on the model's own ``Zamba2MLP`` alone.

    Returns:
        The discovery (names under the MLP), the MLP channels' and the adapter rank's clusters under the model's
        names, and the hybrid layer's index.
    """
    from dataclasses import replace

    from torch import nn

    from lightning_pat import discover

    layer = next(i for i, kind in enumerate(model.config.layers_block_type) if kind == "hybrid")
    prefix = f"model.layers.{layer}.shared_transformer.feed_forward."
    mlp = model.get_submodule(prefix[:-1])

    class Block(nn.Module):  # the MLP as the hybrid layer calls it
        def __init__(self) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x, layer)

    found = discover(Block(), torch.randn(2, 5, model.config.hidden_size))
    named = [
        replace(
            c,
            name=prefix + c.name.removeprefix("mlp."),
            writers=[prefix + w.removeprefix("mlp.") for w in c.writers],
            readers=[prefix + r.removeprefix("mlp.") for r in c.readers],
        )
        for c in found.clusters
    ]
    channels = next(c for c in named if c.name.endswith("gate_up_proj"))
    rank = next(c for c in named if c.name.endswith("adapter_list.0.0"))
    return found, channels, rank, layer


@pytest.fixture(scope="module")
def zamba2():
    from lightning_pat.presets.ssm import mixers

    model = lm_zoo.build("zamba2", mamba_ngroups=2)  # 8 mixer heads of 16 in 2 groups
    found, channels, rank, _ = _shared_mlp(model)
    clusters = [channels, rank, *mixers(model)]
    readers = {c.name: c.readers[0] for c in clusters}
    return found, clusters, _prune_shrink_reload(model, clusters, readers)


def test_zamba2_shared_mlp_is_found_with_its_adapters(zamba2):
    found, (channels, rank, *groups), _ = zamba2
    assert len(found.clusters) == 2, found.table()  # the MLP's channels, the adapter's rank
    assert channels.num_units == 128
    assert [r.rsplit(".", 2)[-2] for r in channels.readers] == ["down_proj"]
    parts = sorted(w.rsplit("feed_forward.", 1)[-1] for w in channels.writers)
    assert parts == [
        "gate_up_proj.weight[0:128]", "gate_up_proj.weight[128:256]",  # gate and up, one unit each
        # the adapter's output, summed with gate_up_proj's before the chunk: the same two halves
        "gate_up_proj_adapter_list.0.1.weight[0:128]", "gate_up_proj_adapter_list.0.1.weight[128:256]",
    ]  # fmt: skip
    assert rank.num_units == 128
    assert rank.readers[0].endswith("adapter_list.0.1.weight")
    assert [g.num_units for g in groups] == [2, 2]  # two mixers, two groups each


def test_zamba2_shared_mlp_adapters_and_groups_cut_exactly_and_reload_stock(zamba2):
    _, clusters, (result, reference, shrunk, reloaded, small, stock, cut) = zamba2
    assert {len(result.dropped[c.name]) for c in clusters[:2]} == {64}
    assert _rel(shrunk, reference) < 1e-4
    assert _rel(reloaded, reference) < 1e-4
    config = small.config
    assert (config.intermediate_size, config.adapter_rank) == (64, 64)
    assert (config.mamba_ngroups, config.n_mamba_heads, config.mamba_expand, config.mamba_headdim) == (1, 4, 1, 16)
    mixer = stock.model.layers[0].mamba
    assert (mixer.n_groups, mixer.num_heads, mixer.norm.group_size) == (1, 4, 64)  # a whole group: no rescale
    assert cut >= 0.2


def test_zamba2_block_output_is_the_one_cut_its_config_cannot_express():
    from lightning_pat import Cluster
    from lightning_pat.shrink.stock_config import stock_refusals

    model = lm_zoo.build("zamba2")
    _, channels, _, layer = _shared_mlp(model)
    down = next(r for r in channels.readers if r.endswith("down_proj.weight"))
    output = Cluster(name="block_output", writers=[down], readers=[f"model.layers.{layer}.linear.weight"])
    refused = stock_refusals(model, [channels, output])
    assert list(refused) == ["block_output"]  # down_proj's columns are the MLP's, its rows the output's
    assert "linear.weight" in refused["block_output"]


def test_zamba2_one_group_under_the_gated_norm_has_no_exact_unit_and_says_why(caplog):
    from lightning_pat.presets.ssm import mixers

    model = lm_zoo.build("zamba2")
    assert model.config.mamba_ngroups == 1  # the family's default
    mixer = model.model.layers[0].mamba
    assert mixer.norm.group_size == mixer.intermediate_size
    assert mixer.norm.variance_epsilon == 1e-5
    with caplog.at_level(logging.WARNING, logger="lightning_pat.presets.ssm"):
        assert mixers(model) == []
    (record,) = [r for r in caplog.records if "Mamba 2 mixers" in r.getMessage()]
    assert "one group" in record.getMessage()
    assert "eps" in record.getMessage()
