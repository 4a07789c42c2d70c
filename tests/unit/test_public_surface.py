"""The public surface, pinned (issue 26): a name added to or dropped from an ``__all__`` is a decision, not an accident.

``tests/unit/public_surface.json`` holds the ``__all__`` of the package and of every subpackage. Changing the surface
means changing that file in the same commit (and the API pages, which ``test_api_docs.py`` checks). The callback's
parameters are PruningOptions' fields, with the same defaults, each with its ``Args:`` line.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path

import pytest

import lightning_pat
from lightning_pat.pruning.options import PruningOptions

PINNED = Path(__file__).with_name("public_surface.json")


def packages() -> list[str]:
    return ["lightning_pat"] + sorted(
        info.name for info in pkgutil.walk_packages(lightning_pat.__path__, "lightning_pat.") if info.ispkg
    )


def test_every_package_declares_all_and_the_pinned_file_lists_exactly_these_packages():
    pinned = json.loads(PINNED.read_text())
    assert sorted(pinned) == packages(), "a package was added or removed: update tests/unit/public_surface.json"
    for name in packages():
        assert isinstance(getattr(importlib.import_module(name), "__all__", None), list), f"{name} has no __all__"


@pytest.mark.parametrize("name", packages())
def test_all_matches_the_pinned_surface_and_every_name_resolves(name):
    module = importlib.import_module(name)
    pinned = json.loads(PINNED.read_text())[name]
    assert sorted(module.__all__) == pinned, (
        f"{name}.__all__ changed: added {sorted(set(module.__all__) - set(pinned))}, removed "
        f"{sorted(set(pinned) - set(module.__all__))}; update tests/unit/public_surface.json if that is intended"
    )
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ lists a name twice"
    for attr in module.__all__:
        assert getattr(module, attr, None) is not None, f"{name}.{attr} is in __all__ but does not resolve"


def _init_params(cls: type) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}


def _field_default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty


def test_the_callbacks_parameters_are_the_options_fields_with_the_same_defaults():
    from lightning_pat import CoupledPruningCallback

    params = _init_params(CoupledPruningCallback)
    fields = {f.name: f for f in dataclasses.fields(PruningOptions) if f.init}
    assert list(params) == list(fields), "the callback's parameters and PruningOptions' fields differ (or their order)"
    for name, param in params.items():
        default = _field_default(fields[name])
        if name == "preset_options":  # None in the signature (no mutable default), {} in the options
            assert (param.default, default) == (None, {})
        else:
            assert param.default == default, f"{name}: callback default {param.default!r}, options {default!r}"
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == list(params)[2:], "every option after clusters and target_sparsity is keyword-only"


def test_every_callback_parameter_has_its_args_line():
    from lightning_pat import CoupledPruningCallback

    doc = (CoupledPruningCallback.__doc__ or "") + (CoupledPruningCallback.__init__.__doc__ or "")
    args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    missing = [n for n in _init_params(CoupledPruningCallback) if not re.search(rf"^\s+{n}( \(.*?\))?:", args, re.M)]
    assert not missing, f"no `Args:` line for {missing}"


@pytest.mark.parametrize("package", packages())
def test_no_public_name_hides_a_module_of_the_package(package):
    """``import a.b.c; a.b.c`` works for every module: no name in ``a.__all__`` rebinds ``a.b`` to something else."""
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__, f"{package}."):
        module = importlib.import_module(info.name)
        attr = info.name.rpartition(".")[2]
        assert getattr(pkg, attr) is module, f"{package}.{attr} is not the module {info.name}: a public name hides it"


def test_the_shrink_package_is_the_public_shrink_function(tmp_path):
    import lightning_pat.shrink.entry
    from lightning_pat import shrink as public

    assert public is lightning_pat.shrink
    assert lightning_pat.shrink.entry.__name__ == "lightning_pat.shrink.entry"
    assert inspect.signature(public) == inspect.signature(lightning_pat.shrink.entry.shrink)
    import torch
    from torch import nn

    from lightning_pat import Cluster, prune_clusters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    cluster = Cluster(name="hidden", writers=["0.weight", "0.bias"], readers=["2.weight"])
    result = prune_clusters(model, [cluster], sparsity=0.5, method="hard")
    small = public(model, result, inplace=False)
    assert small[0].out_features == 4
    x = torch.randn(5, 4)
    assert torch.allclose(small(x), model(x), atol=1e-6)
