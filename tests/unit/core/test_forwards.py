"""Tensors inside a forward's inputs and outputs (``core/forwards.py``): nested tuples, lists and mappings.

References written here: the nested values spelled out by hand, and object identity for what is not a tensor.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from lightning_pat.core.forwards import map_tensors, tensors_of


def test_map_tensors_rebuilds_containers_and_keeps_everything_else():
    a, b, c = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])
    cache = object()
    value = (a, [b, {"c": c, "n": 7}], cache, "text")
    out = map_tensors(value, lambda t: t * 10)
    assert (type(out), type(out[1]), type(out[1][1])) == (tuple, list, dict)
    assert [out[0].item(), out[1][0].item(), out[1][1]["c"].item()] == [10.0, 20.0, 30.0]
    assert (out[1][1]["n"], out[2], out[3]) == (7, cache, "text")
    assert a.item() == 1.0  # the input is not changed


def test_a_mapping_output_becomes_a_dict_in_order():
    out = map_tensors(OrderedDict(logits=torch.zeros(1), loss=torch.ones(1)), lambda t: t + 1)
    assert (type(out), list(out)) == (dict, ["logits", "loss"])
    assert [out["logits"].item(), out["loss"].item()] == [1.0, 2.0]


def test_tensors_of_lists_the_tensors_in_order_and_skips_other_objects():
    a, b, c = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])
    value = {"hidden": (a, [b]), "cache": object(), "logits": c, "n": 3}
    assert [t is ref for t, ref in zip(tensors_of(value), (a, b, c), strict=True)] == [True, True, True]
    assert tensors_of(a)[0] is a
    assert tensors_of((None, "x", 1.0)) == []
