"""Layering from DESIGN.md, checked statically with ``ast`` on every module of lightning_pat/.

* pure modules (spec, schedule, scoring, selection, masking) import only the standard library, torch (not
  torch.distributed) and other pure modules;
* ``torch.distributed`` is imported only by distributed.py; executors/sharded.py and placement.py may import the
  DTensor / placement types from ``torch.distributed.tensor`` (and the mesh type) but call no collectives;
* collectives (all_gather, all_reduce, broadcast, reduce_scatter, all_to_all, barrier and their variants) are
  called only inside distributed.py;
* ``lightning`` is imported only by callback.py, _validation.py, cli.py, demo.py (the demo task's Lightning
  classes) and _imports.py; ``torchmetrics`` only by metrics.py;
* executors never import lightning nor the Trainer-facing modules;
* the shrink modules (shrink.py and what it is built from: shrink_plan.py, surgery.py, surgery_conv.py,
  model_meta.py) import only the stdlib, torch, the pure modules and each other;
* discovery (discovery.py, discovery_trace.py, discovery_walk.py) imports only the stdlib, torch, the pure modules,
  presets and itself;
* export.py adds shrink.py, transformers and safetensors (imported lazily, inside functions), never lightning.

Files that do not exist (yet) are not checked. The checkers are also run on small bad sources so that they are
known to detect what they look for.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parents[2] / "lightning_pat"
PKG = "lightning_pat"

PURE = {f"{PKG}.{n}" for n in ("spec", "schedule", "scoring", "selection", "masking")}
TORCH_DISTRIBUTED_OK = {f"{PKG}.distributed"}
DTENSOR_TYPES_OK = {f"{PKG}.executors.sharded", f"{PKG}.placement"}
DTENSOR_TYPE_MODULES = ("torch.distributed.tensor", "torch.distributed.device_mesh")
LIGHTNING_OK = {f"{PKG}.callback", f"{PKG}.cli", f"{PKG}.demo", f"{PKG}._imports", f"{PKG}._validation"}
LIGHTNING_PACKAGES = {"lightning", "pytorch_lightning", "lightning_fabric"}
TORCHMETRICS_OK = {f"{PKG}.metrics"}
TRAINER_FACING = {
    f"{PKG}.{n}" for n in ("callback", "cli", "metrics", "engine", "presets", "shrink", "_validation", "_state")
}
SHRINK = f"{PKG}.shrink"
#: The shrink and the modules it is built from (plan, surgery, module metadata).
SHRINK_FAMILY = {f"{PKG}.{n}" for n in ("shrink", "shrink_plan", "surgery", "surgery_conv", "model_meta")}
#: Discovery by tracing: the stdlib, torch (no torch.distributed), the pure modules, presets and each other.
DISCOVERY = {f"{PKG}.{n}" for n in ("discovery", "discovery_trace", "discovery_walk")}
EXPORT = f"{PKG}.export"
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "reduce_scatter", "all_to_all", "barrier")
PG_COLLECTIVES = ("allgather", "allreduce", "alltoall", "reduce_scatter_tensor_coalesced")


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def _is_package(rel: str) -> bool:
    return rel.endswith("__init__.py")


def _is_submodule(name: str, known: set[str] | None) -> bool:
    if known is not None:
        return name in known
    rel = name.split(".")[1:]
    path = PKG_DIR.joinpath(*rel)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(rel: str, source: str, known: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything a module imports, lazily or not (``from a import b`` -> a.b)."""
    tree = ast.parse(source)
    this = _module_name(rel)
    package = this if _is_package(rel) else this.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if alias.name == "*":
                    out.append((node.lineno, base))
                elif base.split(".")[0] == PKG:
                    candidate = f"{base}.{alias.name}"
                    out.append((node.lineno, candidate if _is_submodule(candidate, known) else base))
                else:
                    out.append((node.lineno, f"{base}.{alias.name}"))
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value)))
    return out


def _aliases(source: str) -> dict[str, str]:
    """Local name -> dotted module/object it refers to, from import statements."""
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else f"?.{node.attr}"
    return None


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every call that looks like a collective."""
    aliases = _aliases(source)
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
        last = resolved.rsplit(".", 1)[-1]  # through aliases: `from torch.distributed import broadcast as b`
        exact = last in COLLECTIVES or last in PG_COLLECTIVES
        variant = resolved.startswith("torch.distributed.") and last.startswith((*COLLECTIVES, *PG_COLLECTIVES))
        if exact or variant:
            out.append((node.lineno, resolved))
    return out


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name.split(".")[0] == "__future__"


def _is_torch_distributed(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def violations(rel: str, source: str, known: set[str] | None = None) -> list[str]:
    """Every layering rule broken by module ``rel`` (path relative to lightning_pat/)."""
    mod = _module_name(rel)
    errors = []
    for line, name in imported_modules(rel, source, known):
        top = name.split(".")[0]
        where = f"{rel}:{line} imports {name}"
        if mod in PURE:
            torch_ok = top == "torch" and not _is_torch_distributed(name)
            if not (_is_stdlib(name) or torch_ok or name in PURE):
                errors.append(f"{where}: pure modules import only the stdlib, torch and other pure modules")
        dtensor_types = mod in DTENSOR_TYPES_OK and name.startswith(DTENSOR_TYPE_MODULES)
        if _is_torch_distributed(name) and mod not in TORCH_DISTRIBUTED_OK and not dtensor_types:
            errors.append(f"{where}: torch.distributed is imported only by distributed.py")
        if top in LIGHTNING_PACKAGES and mod not in LIGHTNING_OK:
            errors.append(f"{where}: lightning is imported only by callback.py, _validation.py, cli.py, _imports.py")
        if top == "torchmetrics" and mod not in TORCHMETRICS_OK:
            errors.append(f"{where}: torchmetrics is imported only by metrics.py")
        if mod.startswith(f"{PKG}.executors") and (top in LIGHTNING_PACKAGES or name in TRAINER_FACING or name == PKG):
            errors.append(f"{where}: executors never see a Trainer")
        if mod in SHRINK_FAMILY:
            torch_ok = top == "torch" and not _is_torch_distributed(name)
            if not (_is_stdlib(name) or torch_ok or name in PURE or name in SHRINK_FAMILY):
                errors.append(
                    f"{where}: the shrink modules import only the stdlib, torch, the pure modules and each other"
                )
        if mod in DISCOVERY:
            torch_ok = top == "torch" and not _is_torch_distributed(name)
            if not (_is_stdlib(name) or torch_ok or name in PURE or name in DISCOVERY or name == f"{PKG}.presets"):
                errors.append(
                    f"{where}: discovery imports only the stdlib, torch, the pure modules, presets and itself"
                )
        if mod == EXPORT:
            torch_ok = top == "torch" and not _is_torch_distributed(name)
            if not (
                _is_stdlib(name) or torch_ok or name in PURE or name == SHRINK or top in ("transformers", "safetensors")
            ):
                errors.append(
                    f"{where}: export.py imports only the stdlib, torch, transformers, shrink and pure modules"
                )
        if mod == f"{PKG}.distributed" and top == PKG and name not in PURE:
            errors.append(f"{where}: distributed.py sits below everything but the pure modules")
    if mod not in TORCH_DISTRIBUTED_OK:
        errors += [
            f"{rel}:{line} calls {call}: collectives live in distributed.py" for line, call in collective_calls(source)
        ]
    return errors


def _package_files() -> list[str]:
    return sorted(str(p.relative_to(PKG_DIR)) for p in PKG_DIR.rglob("*.py"))


@pytest.mark.parametrize("rel", _package_files())
def test_module_respects_layering(rel):
    source = (PKG_DIR / rel).read_text()
    assert violations(rel, source) == []


def test_core_modules_are_checked():
    files = set(_package_files())
    for rel in (
        "spec.py",
        "schedule.py",
        "scoring.py",
        "selection.py",
        "masking.py",
        "distributed.py",
        "engine.py",
        "executors/materializing.py",
        "shrink.py",
    ):
        assert rel in files


# ---------------------------------------------------------------------------------------------------- the checkers


KNOWN = {
    f"{PKG}.{n}"
    for n in (
        "spec",
        "scoring",
        "distributed",
        "placement",
        "engine",
        "callback",
        "shrink",
        "presets",
        "discovery_trace",
    )
}


@pytest.mark.parametrize(
    ("rel", "source", "needle"),
    [
        ("spec.py", "import numpy\n", "pure modules"),
        ("scoring.py", "from lightning_pat import distributed as D\n", "pure modules"),
        ("scoring.py", "from . import engine\n", "pure modules"),
        ("masking.py", "from lightning_pat import Cluster\n", "pure modules"),  # the package pulls in everything
        ("selection.py", "import torch.distributed as dist\n", "torch.distributed is imported only"),
        ("selection.py", "from torch import distributed\n", "torch.distributed is imported only"),
        ("engine.py", "def f():\n    import torch.distributed\n", "torch.distributed is imported only"),
        ("placement.py", "import torch.distributed as dist\n", "torch.distributed is imported only"),
        ("executors/sharded.py", "from torch.distributed import all_gather\n", "torch.distributed is imported only"),
        ("engine.py", "from torch.distributed.tensor import DTensor\n", "torch.distributed is imported only"),
        ("engine.py", "import lightning.pytorch as pl\n", "lightning is imported only"),
        ("presets.py", "from pytorch_lightning import Trainer\n", "lightning is imported only"),
        ("engine.py", "import importlib\nimportlib.import_module('lightning')\n", "lightning is imported only"),
        ("callback.py", "import torchmetrics\n", "torchmetrics is imported only"),
        ("executors/materializing.py", "from lightning_pat.callback import X\n", "executors never see a Trainer"),
        ("executors/base.py", "from ..engine import Pruner\n", "executors never see a Trainer"),
        ("distributed.py", "from lightning_pat import engine\n", "distributed.py sits below"),
        ("executors/sharded.py", "import torch\ntorch.distributed.all_gather_into_tensor(a, b)\n", "collectives"),
        ("executors/sharded.py", "def f(mesh):\n    mesh.get_group().allreduce(t)\n", "collectives"),
        ("placement.py", "from torch.distributed import broadcast as b\nb(t, 0)\n", "collectives"),
        ("engine.py", "from lightning_pat import distributed as D\nD.barrier()\n", "collectives"),
        ("callback.py", "import torch.distributed as dist\ndist.all_reduce(t)\n", "collectives"),
        ("callback.py", "strategy.barrier()\n", "collectives"),
        ("shrink.py", "from lightning_pat.engine import PruneResult\n", "the shrink modules import only"),
        ("surgery.py", "from lightning_pat.engine import Pruner\n", "the shrink modules import only"),
        ("shrink.py", "import lightning.pytorch as pl\n", "lightning is imported only"),
        ("shrink.py", "import transformers\n", "the shrink modules import only"),
        ("export.py", "import lightning\n", "lightning is imported only"),
        ("export.py", "from lightning_pat import callback\n", "export.py imports only"),
        ("discovery.py", "from lightning_pat.engine import Pruner\n", "discovery imports only"),
        ("discovery_trace.py", "import lightning\n", "lightning is imported only"),
        ("surgery_conv.py", "from lightning_pat.engine import Pruner\n", "the shrink modules import only"),
    ],
)
def test_checkers_detect_violations(rel, source, needle):
    found = violations(rel, source, KNOWN)
    assert any(needle in v for v in found), found


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("spec.py", "import re\nimport torch\nfrom torch import nn\nfrom lightning_pat.scoring import x\n"),
        ("masking.py", "from .scoring import unit_of_channels\nfrom .spec import Member\n"),
        ("distributed.py", "import torch.distributed as dist\ndist.all_gather(a, b)\ndist.barrier()\n"),
        ("placement.py", "from torch.distributed.tensor import Replicate, Shard\n"),
        (
            "executors/sharded.py",
            "from torch.distributed.tensor.placement_types import Placement\n"
            "from lightning_pat import distributed as D\nD.all_gather_stacked(x, group=g)\n",
        ),
        ("callback.py", "import lightning.pytorch as pl\n"),
        ("metrics.py", "from torchmetrics import Metric\n"),
        ("shrink.py", "import math\nimport torch\nfrom lightning_pat.spec import ResolvedCluster\n"),
        ("export.py", "from lightning_pat.shrink import shrink\ndef f():\n    import transformers\n"),
        ("discovery.py", "from lightning_pat import presets\nfrom lightning_pat.discovery_trace import trace\n"),
    ],
)
def test_checkers_accept_allowed_imports(rel, source):
    assert violations(rel, source, KNOWN) == []
