"""The floors of ARCHITECTURE.md, checked statically with ``ast`` on every module of lightning_pat/.

Every module belongs to exactly one floor (a module that none claims fails the test), and imports only from the
floors listed for its own:

* ``core`` (spec/, schedule, units, norms, selection, masking, and the file helpers of safe_io): the standard library
  and torch (not torch.distributed);
* ``heads`` (attention modules with explicit heads, used by discovery and the shrink): torch only;
* ``parallel`` (comm, placement, fsdp1, teacher, executors): adds core; ``torch.distributed`` is imported only by
  the modules of parallel/comm/ and parallel/fsdp1.py (FSDP1's wrapper), the DTensor and mesh types also by
  parallel/placement.py and parallel/executors/sharded.py;
* ``sizing`` (problem, solver, targets, flops): size targets to per-cluster targets; adds nothing but core;
* ``scoring`` (collector, hooks, activation, taylor, layers): the data-aware scores, collected from forwards and
  gradients; adds core and parallel (the executors' evidence protocol, rank-ordered sums);
* ``pruning`` (the ``pruning`` package: options, declarations, plan, pruner, the one-shot API, allocation; presets/;
  discovery: clusters found by tracing): adds heads, parallel, sizing, scoring, and shrink (discovery returns only
  clusters the shrink can rewrite, checked by the shrink's own validation and a trial shrink);
* ``shrink`` (the cut: entry, plan, edits, surgery, model_meta, hf_entry): core, heads and itself;
* ``export`` (pretrained, checks, module_tree, tokenizer_files, hf_loader, the serving formats): adds the shrink;
  pretrained.py adds transformers and safetensors, hf_loader.py transformers, gguf.py the gguf package,
  decilm_config.py (the config class a DeciLM export carries) transformers;
* ``training`` (the options' users: controller, bound, score_choice, per_step, resume, shrunk_restore, progress, errors,
  collectors, state, latent, metrics, distill, teacher_file, views, environment, callback, recipes, trainer_facts):
  adds scoring, pruning and shrink (not export); ``torchmetrics`` only in training/metrics.py, ``lightning`` only in
  training/callback.py, training/recipes.py (the callback's named subclasses) and training/trainer_facts.py (what the
  callback reads from a Trainer);
* ``cli``, ``demo`` and ``lm`` (pretrained LMs: where a real checkpoint comes from, its Lightning modules; the
  top): anything but each other; they may import lightning; the demo may shard with FSDP2;
* the package face (``__init__``, ``__about__``): the floors below cli and demo.

Collectives are called only inside parallel/comm/. Names that cross modules are public (no
``from lightning_pat.x import _y``) and no module is imported under a one-letter alias. The checkers are also run on
small bad sources so that they are known to detect what they look for.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parents[2] / "lightning_pat"
PKG = "lightning_pat"

#: floor -> the modules (dotted, under lightning_pat.) or packages (ending in ".") it holds
FLOORS: dict[str, tuple[str, ...]] = {
    "core": ("core.",),
    "heads": ("heads.",),
    "parallel": ("parallel.",),
    "sizing": ("sizing.",),
    "scoring": ("scoring.",),
    "pruning": (
        "pruning.",
        "presets.",
        "discovery.",
    ),  # fmt: skip
    "shrink": ("shrink.",),
    "export": ("export.",),
    "training": ("training.",),
    "cli": ("cli.",),
    "demo": ("demo.",),
    "lm": ("lm.",),
    "face": ("", "__about__"),
}
_ALL_BELOW_CLI = {"core", "heads", "parallel", "sizing", "scoring", "pruning", "shrink", "export", "training"}
#: floor -> the floors it may import from
MAY_IMPORT: dict[str, set[str]] = {
    "core": {"core"},
    "heads": {"heads"},
    "parallel": {"core", "parallel"},
    "sizing": {"core", "sizing"},
    "scoring": {"core", "parallel", "scoring"},
    # discovery checks with the shrink and traces with heads
    "pruning": {"core", "heads", "parallel", "sizing", "scoring", "pruning", "shrink"},
    "shrink": {"core", "heads", "shrink"},
    "export": {"core", "heads", "shrink", "export"},
    "training": {"core", "heads", "parallel", "sizing", "scoring", "pruning", "shrink", "training"},
    "cli": _ALL_BELOW_CLI | {"cli", "face"},
    "demo": _ALL_BELOW_CLI | {"demo", "face"},
    "lm": _ALL_BELOW_CLI | {"lm", "face"},
    "face": _ALL_BELOW_CLI | {"face"},
}
#: the package whose modules may import torch.distributed and call collectives (one job per module)
COMM = f"{PKG}.parallel.comm"
TORCH_DISTRIBUTED_OK = {f"{PKG}.parallel.fsdp1", f"{PKG}.demo.task", f"{PKG}.lm.sharding"}
DTENSOR_TYPES_OK = {f"{PKG}.parallel.executors.sharded", f"{PKG}.parallel.placement"}
DTENSOR_TYPE_MODULES = ("torch.distributed.tensor", "torch.distributed.device_mesh")
LIGHTNING_OK_FLOORS = {"cli", "demo", "lm"}
LIGHTNING_OK = {f"{PKG}.training.callback", f"{PKG}.training.recipes", f"{PKG}.training.trainer_facts"}
LIGHTNING_PACKAGES = {"lightning", "pytorch_lightning", "lightning_fabric"}
TORCHMETRICS_OK = {f"{PKG}.training.metrics"}
#: modules of the torch-only floors that may import a third-party package besides torch (imported lazily)
THIRD_PARTY_OK = {
    f"{PKG}.export.pretrained": ("transformers", "safetensors"),
    f"{PKG}.export.gguf": ("gguf",),
    f"{PKG}.export.decilm_config": ("transformers",),
    f"{PKG}.export.hf_loader": ("transformers",),
}
#: the floors whose modules import only the standard library and torch (but THIRD_PARTY_OK)
TORCH_ONLY_FLOORS = ("core", "heads", "shrink", "export")
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "reduce_scatter", "all_to_all", "barrier")
PG_COLLECTIVES = ("allgather", "allreduce", "alltoall", "reduce_scatter_tensor_coalesced")


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def floor_of(mod: str) -> str | None:
    """The floor of dotted module ``mod`` (``lightning_pat`` itself is the face), or ``None`` if none claims it."""
    rel = mod[len(PKG) + 1 :] if mod != PKG else ""
    for floor, members in FLOORS.items():
        for member in members:
            if member.endswith(".") and (rel == member[:-1] or rel.startswith(member)):
                return floor
            if rel == member:
                return floor
    return None


def _is_package(rel: str) -> bool:
    return rel.endswith("__init__.py")


def _is_submodule(name: str, known: set[str] | None) -> bool:
    if known is not None:
        return name in known
    rel = name.split(".")[1:]
    path = PKG_DIR.joinpath(*rel)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(rel: str, source: str, known: set[str] | None = None) -> list[tuple[int, str, str]]:
    """(line, absolute dotted name, alias) of everything a module imports, lazily or not (``from a import b`` -> a.b).

    ``alias`` is the local name for plain and ``from`` imports (``""`` for dynamic imports).
    """
    tree = ast.parse(source)
    this = _module_name(rel)
    package = this if _is_package(rel) else this.rpartition(".")[0]
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, alias.asname or "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                local = alias.asname or ""
                if alias.name == "*":
                    out.append((node.lineno, base, ""))
                elif base.split(".")[0] == PKG:
                    candidate = f"{base}.{alias.name}"
                    out.append((node.lineno, candidate if _is_submodule(candidate, known) else candidate, local))
                else:
                    out.append((node.lineno, f"{base}.{alias.name}", local))
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value), ""))
    return out


def _target_module(name: str, known: set[str] | None) -> str:
    """The module ``name`` refers to: itself if it is a module of the package, else its parent (an imported name)."""
    return name if name == PKG or _is_submodule(name, known) else name.rpartition(".")[0]


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


def _in_comm(mod: str) -> bool:
    """Whether dotted module ``mod`` is parallel/comm/ or one of its modules (where collectives live)."""
    return mod == COMM or mod.startswith(f"{COMM}.")


def _is_torch_distributed(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def violations(rel: str, source: str, known: set[str] | None = None) -> list[str]:
    """Every layering rule broken by module ``rel`` (path relative to lightning_pat/)."""
    mod = _module_name(rel)
    floor = floor_of(mod)
    if floor is None:
        return [f"{rel}: belongs to no floor; add it to FLOORS (and ARCHITECTURE.md)"]
    errors = []
    for line, name, alias in imported_modules(rel, source, known):
        top = name.split(".")[0]
        where = f"{rel}:{line} imports {name}"
        if top == PKG:
            target = _target_module(name, known)
            other = floor_of(target)
            if other is not None and other not in MAY_IMPORT[floor]:
                errors.append(f"{where}: the {floor} floor imports only from {sorted(MAY_IMPORT[floor])}")
            leaf = name.rpartition(".")[2]
            if target != name and leaf.startswith("_") and not leaf.startswith("__"):
                errors.append(f"{where}: a name that crosses modules is public (drop the underscore)")
            if len(alias) == 1:
                errors.append(f"{where} as {alias}: no one-letter module aliases")
            continue
        if floor in TORCH_ONLY_FLOORS and not (_is_stdlib(name) or top == "torch"):
            ok_export = top in THIRD_PARTY_OK.get(mod, ())
            if not ok_export:
                errors.append(f"{where}: the {floor} floor imports only the stdlib and torch")
        dtensor_types = mod in DTENSOR_TYPES_OK and name.startswith(DTENSOR_TYPE_MODULES)
        if _is_torch_distributed(name) and not (_in_comm(mod) or mod in TORCH_DISTRIBUTED_OK or dtensor_types):
            errors.append(f"{where}: torch.distributed is imported only by parallel/comm/ (and fsdp1.py)")
        if top in LIGHTNING_PACKAGES and mod not in LIGHTNING_OK and floor not in LIGHTNING_OK_FLOORS:
            errors.append(f"{where}: lightning is imported only by training/{{callback,trainer_facts}}.py, cli/, demo/")
        if top == "torchmetrics" and mod not in TORCHMETRICS_OK:
            errors.append(f"{where}: torchmetrics is imported only by training/metrics.py")
    if not _in_comm(mod):
        errors += [
            f"{rel}:{line} calls {call}: collectives live in parallel/comm/" for line, call in collective_calls(source)
        ]
    return errors


def _package_files() -> list[str]:
    return sorted(str(p.relative_to(PKG_DIR)) for p in PKG_DIR.rglob("*.py"))


@pytest.mark.parametrize("rel", _package_files())
def test_module_respects_layering(rel):
    source = (PKG_DIR / rel).read_text()
    assert violations(rel, source) == []


def test_every_module_has_a_floor_and_the_floors_exist():
    files = _package_files()
    assert len(files) > 30
    assert all(floor_of(_module_name(rel)) is not None for rel in files)
    for floor, members in FLOORS.items():
        for member in members:
            if member.endswith("."):
                assert (PKG_DIR / member[:-1] / "__init__.py").is_file(), (floor, member)
            elif member:
                assert (PKG_DIR / f"{member}.py").is_file(), (floor, member)


# ---------------------------------------------------------------------------------------------------- the checkers


KNOWN = {
    f"{PKG}.{n}"
    for n in (
        "core", "core.spec", "core.scoring", "core.checks", "parallel", "parallel.comm", "parallel.comm.reduce",
        "parallel.placement", "pruning", "pruning.plan", "pruning.pruner", "pruning.options", "training",
        "training.callback", "training.controller", "training.trainer_facts", "training.views", "training.environment",
        "shrink", "shrink.entry", "demo", "cli",
        "presets", "discovery", "discovery.trace",
    )
}  # fmt: skip


@pytest.mark.parametrize(
    ("rel", "source", "needle"),
    [
        ("core/spec/patterns.py", "import numpy\n", "imports only the stdlib and torch"),
        ("core/norms.py", "from lightning_pat.parallel.comm import reduce\n", "the core floor imports only"),
        ("core/norms.py", "from .. import pruning\n", "the core floor imports only"),
        ("core/checks.py", "from lightning_pat.pruning.options import METHODS\n", "the core floor imports only"),
        ("pruning/options.py", "from lightning_pat.training.environment import X\n", "the pruning floor imports only"),
        ("sizing/targets.py", "from lightning_pat.pruning.plan import Plan\n", "the sizing floor imports only"),
        ("core/masking.py", "from lightning_pat import Cluster\n", "the core floor imports only"),
        ("core/selection.py", "import torch.distributed as dist\n", "torch.distributed is imported only"),
        ("core/selection.py", "from torch import distributed\n", "torch.distributed is imported only"),
        ("pruning/pruner.py", "def f():\n    import torch.distributed\n", "torch.distributed is imported only"),
        ("parallel/placement.py", "import torch.distributed as dist\n", "torch.distributed is imported only"),
        ("parallel/executors/sharded.py", "from torch.distributed import all_gather\n", "torch.distributed is"),
        ("pruning/pruner.py", "from torch.distributed.tensor import DTensor\n", "torch.distributed is imported only"),
        ("pruning/pruner.py", "import lightning.pytorch as pl\n", "lightning is imported only"),
        ("presets/registry.py", "from pytorch_lightning import Trainer\n", "lightning is imported only"),
        ("pruning/pruner.py", "import importlib\nimportlib.import_module('lightning')\n", "lightning is imported only"),
        ("training/controller.py", "import lightning\n", "lightning is imported only"),
        ("training/callback.py", "import torchmetrics\n", "torchmetrics is imported only"),
        ("parallel/executors/base.py", "from lightning_pat.training.callback import X\n", "parallel floor imports"),
        ("parallel/executors/base.py", "from ...pruning.pruner import Pruner\n", "the parallel floor imports only"),
        ("parallel/comm/ranks.py", "from lightning_pat import pruning\n", "the parallel floor imports only"),
        ("pruning/pruner.py", "from lightning_pat.training import controller\n", "the pruning floor imports only"),
        ("pruning/pruner.py", "from lightning_pat.demo import TinyGPT\n", "the pruning floor imports only"),
        ("training/callback.py", "from lightning_pat.cli import main\n", "the training floor imports only"),
        ("shrink/entry.py", "from lightning_pat.pruning.pruner import PruneResult\n", "the shrink floor imports only"),
        ("shrink/surgery.py", "from lightning_pat.parallel.comm import dtensor\n", "the shrink floor imports only"),
        ("shrink/entry.py", "import lightning.pytorch as pl\n", "lightning is imported only"),
        ("shrink/entry.py", "import transformers\n", "imports only the stdlib and torch"),
        ("export/pretrained.py", "import lightning\n", "lightning is imported only"),
        ("cli/app.py", "from lightning_pat.demo import TinyGPT\n", "the cli floor imports only"),
        ("discovery/entry.py", "from lightning_pat.training import controller\n", "the pruning floor imports only"),
        ("discovery/trace.py", "import lightning\n", "lightning is imported only"),
        ("shrink/surgery_conv.py", "from lightning_pat.pruning import pruner\n", "the shrink floor imports only"),
        ("scoring/activation.py", "from lightning_pat.pruning import pruner\n", "the scoring floor imports only"),
        ("scoring/hooks.py", "from lightning_pat.training import controller\n", "the scoring floor imports only"),
        ("shrink/verify.py", "from lightning_pat.scoring.hooks import run_batches\n", "the shrink floor imports only"),
        ("sizing/targets.py", "from lightning_pat.scoring.layers import LayerStats\n", "the sizing floor imports"),
        ("pruning/pruner.py", "from lightning_pat.core.spec import _helper\n", "a name that crosses modules is public"),
        ("pruning/pruner.py", "from lightning_pat.parallel.comm import reduce as R\n", "no one-letter module aliases"),
        ("new_module.py", "import torch\n", "belongs to no floor"),
        ("parallel/executors/sharded.py", "import torch\ntorch.distributed.all_gather_into_tensor(a, b)\n", "collect"),
        ("parallel/executors/sharded.py", "def f(mesh):\n    mesh.get_group().allreduce(t)\n", "collectives"),
        ("parallel/placement.py", "from torch.distributed import broadcast as b\nb(t, 0)\n", "collectives"),
        ("pruning/pruner.py", "from lightning_pat.parallel.comm import ranks\nranks.barrier()\n", "collectives"),
        (
            "parallel/placement.py",
            "import torch.distributed as dist\ndist.all_reduce(t)\n",
            "collectives live in parallel/comm/",
        ),
        ("training/callback.py", "import torch.distributed as dist\ndist.all_reduce(t)\n", "collectives"),
        ("training/callback.py", "strategy.barrier()\n", "collectives"),
    ],
)
def test_checkers_detect_violations(rel, source, needle):
    found = violations(rel, source, KNOWN)
    assert any(needle in v for v in found), found


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        (
            "core/spec/resolve.py",
            "import re\nimport torch\nfrom torch import nn\nfrom lightning_pat.core.norms import x\n",
        ),
        ("core/masking.py", "from .scoring import unit_of_channels\nfrom .spec import Member\n"),
        ("parallel/comm/reduce.py", "import torch.distributed as dist\ndist.all_gather(a, b)\ndist.barrier()\n"),
        ("parallel/comm/__init__.py", "import torch.distributed as dist\n"),
        ("parallel/comm/ranks.py", "from torch.distributed import ProcessGroup\nfrom lightning_pat.core import spec\n"),
        ("parallel/placement.py", "from torch.distributed.tensor import Replicate, Shard\n"),
        (
            "parallel/executors/sharded.py",
            "from torch.distributed.tensor.placement_types import Placement\n"
            "from lightning_pat.parallel.comm import reduce\nreduce.all_gather_packed(x, group=g)\n",
        ),
        ("training/callback.py", "import lightning.pytorch as pl\nfrom lightning_pat.training import controller\n"),
        ("training/controller.py", "from lightning_pat.pruning import plan\nfrom lightning_pat.shrink import entry\n"),
        ("scoring/taylor.py", "from lightning_pat.parallel.comm import dtensor\nfrom lightning_pat.core import spec\n"),
        ("pruning/pruner.py", "from lightning_pat.scoring.activation import ActivationStats\n"),
        ("pruning/options.py", "from lightning_pat.core.checks import check_choice\n"),
        ("training/environment.py", "from lightning_pat.pruning.options import PruningOptions\n"),
        ("training/controller.py", "from lightning_pat.scoring.taylor import TaylorScores\n"),
        ("training/metrics.py", "from torchmetrics import Metric\n"),
        ("shrink/entry.py", "import math\nimport torch\nfrom lightning_pat.core.spec import ResolvedCluster\n"),
        ("export/pretrained.py", "from lightning_pat.shrink import entry\ndef f():\n    import transformers\n"),
        ("discovery/entry.py", "from lightning_pat import presets\nfrom lightning_pat.discovery.trace import trace\n"),
        ("demo/task.py", "import lightning.pytorch as pl\nfrom torch.distributed.fsdp import fully_shard\n"),
        ("cli/app.py", "from lightning.pytorch.cli import LightningCLI\nfrom lightning_pat.training import callback\n"),
    ],
)
def test_checkers_accept_allowed_imports(rel, source):
    assert violations(rel, source, KNOWN) == []
