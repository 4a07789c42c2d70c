"""shrink_sharded's refusals that need no process group (the sharded cases are in tests/distributed/)."""

from __future__ import annotations

import pytest

from lightning_pat import presets, resolve_clusters
from lightning_pat.training.sharded_shrink import shrink_sharded
from tests.distributed.workers.sharded_shrink import tiny_llama


def test_a_model_without_fully_shard_is_sent_to_the_one_device_shrink():
    model = tiny_llama()
    clusters = resolve_clusters(model, presets.llama(model, query_heads=False))
    with pytest.raises(ValueError, match="has no fully_shard module; a model on one device shrinks with"):
        shrink_sharded(model, clusters, {"mlp.0": [1]})
    assert model.model.layers[0].mlp.gate_proj.out_features == 40


def test_dropped_layers_are_refused_before_anything_changes():
    model = tiny_llama(layers=3)
    clusters = resolve_clusters(model, presets.llama(model, layers=True, query_heads=False))
    layer = next(rc.name for rc in clusters if rc.name.startswith("layer"))
    with pytest.raises(ValueError, match=r"drops whole layers .* set shrink_on_freeze=False"):
        shrink_sharded(model, clusters, {layer: [0]})
