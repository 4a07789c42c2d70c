"""The pickle-free module format: what it rebuilds (classes, attributes, ties, shared modules) and what it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat.export.module_tree import UnsupportedStateError, describe, rebuild, resolve_class


def round_trip(model: nn.Module) -> nn.Module:
    description, tensors = describe(model)
    return rebuild(description, tensors)


def test_shared_submodule_and_tied_parameters_stay_shared():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 4, bias=False))
    model[3].weight = shared.weight
    again = round_trip(model)
    assert again[0] is again[2]
    assert again[3].weight is again[0].weight
    assert again[3].bias is None
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_torch_modules_with_private_state_rebuild():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "mha": nn.MultiheadAttention(8, 2, batch_first=True),
            "norm": nn.LayerNorm(8, eps=1e-3),
            "emb": nn.Embedding(5, 8, padding_idx=0),
        }
    ).eval()
    again = round_trip(model)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert torch.equal(again["mha"](x, x, x)[0], model["mha"](x, x, x)[0])
        assert torch.equal(again["norm"](x), model["norm"](x))
    assert again["emb"].padding_idx == 0
    assert not again.training


def test_refusals():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.thing = object()

    with pytest.raises(
        UnsupportedStateError, match=r"module \(root\) \(Holder\): attribute 'thing' is a builtins.object"
    ):
        describe(Holder())
    with pytest.raises(ValueError, match="is not an torch.nn.modules.module.Module subclass"):
        resolve_class("torch.nn.modules.activation.ReLU.forward")
    for path in ("torch.nn.functional.relu", "subprocess.Popen"):
        with pytest.raises(ValueError, match="not in a model module lightning_pat imports by itself"):
            resolve_class(path)
    assert resolve_class("torch.nn.modules.linear.Linear") is nn.Linear
