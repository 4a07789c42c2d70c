"""The tests mirror the package, both ways, module by module; workers under ``tests/*/workers/``.

* Folders: each subpackage ``lightning_pat/<package>/`` has ``tests/unit/<package>/`` unless :data:`EXEMPT_PACKAGES`
  says which tests cover it instead, and each folder of ``tests/unit/`` mirrors a subpackage.
* Files: a unit test file ``tests/unit/<package>/test_<name>.py`` is named after a module (or a nested subpackage,
  e.g. ``core/spec``) of its package, unless :data:`FEATURE_FILES` says why it is not; the files directly in
  ``tests/unit/`` test the package as a whole or the repository's tooling (:data:`TOP_LEVEL`).
* Modules: each module ``lightning_pat/<package>/[<sub>/]<module>.py`` has ``tests/unit/<package>/test_<module>.py``
  unless :data:`EXEMPT` names the test files that cover it and why (a module tested through its package's public
  entry, behaviour that needs a Trainer or ranks, a package tested as one). Package faces (``__init__.py``,
  ``__main__.py``, ``__about__.py``) are tested through the public surface (``tests/unit/test_public_surface.py``).

Every list is checked both ways: an exempt module that gets its own test file, a feature file named after a module,
or an entry naming a file or module that does not exist fails, with the line to change.

The integration and distributed tests are grouped by kind; the scripts they launch per rank live in their
``workers/`` folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
PACKAGE = ROOT / "lightning_pat"
HERE = "tests/unit/test_tests_layout.py"

#: subpackage -> (the tests that cover it instead of tests/unit/<package>/, why)
EXEMPT_PACKAGES: dict[str, tuple[str, str]] = {
    "parallel": (
        "tests/distributed/",
        "collectives, DTensor and FSDP need real gloo ranks",
    ),
    "cli": ("tests/test_console_script.py", "the console script is run as a user runs it (top-level console tests)"),
}

#: unit test files not named after one module -> why (a feature across the package's modules)
FEATURE_FILES: dict[str, str] = {
    "tests/unit/discovery/test_packed.py": "heads behind packed QKV: the walk, the trial shrink and the shrink's check",
    "tests/unit/discovery/test_presets_traced.py": "discovery against the presets on every family (two floors)",
    "tests/unit/discovery/test_fused_heads.py": "heads behind stack/select/slices/fused QKV of HF LMs (the walk's ops)",
    "tests/unit/export/test_serve_export.py": "the serving formats (GGUF, DeciLM, tokenizer files) as one round trip",
    "tests/unit/presets/test_presets.py": "every family's preset: registry, transformers layouts, chains, detection",
    "tests/unit/shrink/test_batchnorm.py": "BatchNorm on a shrunk axis: the refusal (edits) and the exact shrink",
    "tests/unit/sizing/test_ranked_widths.py": "target_widths='ranked': the floored selection and the solver together",
    "tests/unit/sizing/test_solver_importance.py": "the solver by importance costs, against the engine's selection",
    # owned by the helpers working in these folders at the same time; renames proposed to the lead in issue 40
    "tests/unit/scoring/test_activation_non_finite.py": "non-finite activations (-> into test_activation.py)",
}

#: files directly in tests/unit/ -> why they are not in a package folder
TOP_LEVEL: dict[str, str] = {
    "test_import_layers.py": "the floors of the whole package",
    "test_public_surface.py": "every package's __all__, pinned in public_surface.json",
    "test_tests_layout.py": "this file: the tests' own layout",
    "test_bench_gates.py": "bench/hard_concrete.py, not a module of the package",
    "test_bench_serve_variants.py": "bench/bench_serve.py, not a module of the package",
    "test_torchvision_helper.py": "tests/common/torchvision_zoo.py, the tests' own helper",
}

#: module (relative to lightning_pat/) -> (test files that cover it, why it has no test file of its own)
EXEMPT: dict[str, tuple[tuple[str, ...], str]] = {
    # cli: the console script, run as a user runs it
    "cli/app.py": (("tests/test_cli_errors.py", "tests/test_console_script.py"), "the console script's parser"),
    "cli/checkpoint.py": (
        ("tests/test_console_script.py", "tests/integration/test_untrusted_folders.py"),
        "`lightning-pat shrink` on checkpoints, trusted and not",
    ),
    # core
    "core/masking.py": (("tests/unit/core/test_selection.py",), "zeroing checked with the selections it applies"),
    "core/norms.py": (
        ("tests/unit/core/test_selection.py", "tests/unit/pruning/test_pruner.py"),
        "unit norms against the float64 reference",
    ),
    "core/pruning_warning.py": (("tests/unit/scoring/test_activation_non_finite.py",), "a warning class only"),
    "core/saved_state.py": (
        ("tests/integration/test_resume.py", "tests/integration/test_distill.py"),
        "reading the callback's entry needs a Lightning checkpoint",
    ),
    "core/spec/declaration.py": (("tests/unit/core/test_spec.py",), "the spec package is tested as one"),
    "core/spec/patterns.py": (("tests/unit/core/test_spec.py",), "the spec package is tested as one"),
    "core/spec/resolve.py": (("tests/unit/core/test_spec.py",), "the spec package is tested as one"),
    "core/spec/resolved.py": (("tests/unit/core/test_spec.py",), "the spec package is tested as one"),
    "core/units.py": (("tests/unit/core/test_selection.py",), "unit/channel arithmetic under the selections"),
    # demo
    "demo/model.py": (("tests/unit/presets/test_presets.py",), "TinyGPT: config, causality, its preset"),
    "demo/preset.py": (("tests/unit/presets/test_presets.py",), "the demo's preset, registered on import"),
    "demo/task.py": (("tests/test_readme.py", "tests/integration/test_recipes.py"), "the demo's Lightning task"),
    # discovery: tested through discover()
    "discovery/encoders.py": (
        ("tests/integration/test_lm_more_families.py",),
        "a causal LM's encoders traced on their own inputs: Phi-4-multimodal's",
    ),
    "discovery/labels.py": (("tests/unit/discovery/test_entry.py",), "the labelling of the walk, through discover()"),
    "discovery/nodes.py": (("tests/unit/discovery/test_entry.py",), "fx node queries, through discover()"),
    "discovery/tensor_ops.py": (
        ("tests/unit/discovery/test_entry.py", "tests/unit/discovery/test_conv.py"),
        "the op tables of the walk, through discover()",
    ),
    "discovery/trace.py": (("tests/unit/discovery/test_entry.py",), "torch.export tracing, through discover()"),
    "discovery/trial.py": (
        ("tests/unit/discovery/test_packed.py", "tests/unit/discovery/test_attention.py"),
        "the trial shrink that leaves clusters out",
    ),
    "discovery/walk.py": (("tests/unit/discovery/test_entry.py",), "the graph walk, through discover()"),
    "discovery/weights.py": (
        ("tests/unit/discovery/test_entry.py", "tests/unit/discovery/test_conv.py"),
        "the handlers of weight ops (linear, conv, embedding, norms), through discover()",
    ),
    # export
    "export/decilm.py": (("tests/unit/export/test_serve_export.py",), "DeciLM export read back"),
    "export/decilm_config.py": (("tests/unit/export/test_serve_export.py",), "the shipped DeciLM config class"),
    "export/gguf.py": (("tests/unit/export/test_serve_export.py",), "GGUF read back by transformers and gguf"),
    "export/hf_loader.py": (("tests/integration/test_untrusted_folders.py",), "remote code refused on real folders"),
    "export/llama_layout.py": (("tests/unit/export/test_serve_export.py",), "per-layer widths of the exports"),
    "export/tokenizer_files.py": (
        ("tests/unit/export/test_serve_export.py", "tests/integration/test_export_sources.py"),
        "the tokenizer next to an export",
    ),
    # heads: tested through replace_attention
    "heads/maxvit.py": (("tests/unit/heads/test_replace.py",), "MaxViT attention against torchvision's"),
    "heads/mha.py": (("tests/unit/heads/test_replace.py",), "HeadsMultiheadAttention against nn.MultiheadAttention"),
    "heads/window.py": (("tests/unit/heads/test_replace.py",), "Swin V1/V2 attention against torchvision's"),
    # lm: needs the tokenizer and a Trainer
    "lm/data.py": (
        ("tests/integration/test_lm_front_door.py", "tests/integration/test_lm_bad_input.py"),
        "token streams and windows, with the real tokenizer",
    ),
    "lm/module.py": (
        ("tests/integration/test_lm_front_door.py", "tests/integration/test_shrink_on_freeze_sharded.py"),
        "the LightningModule, fitted",
    ),
    # parallel: real gloo ranks (tests/distributed/)
    "parallel/comm/dcp.py": (
        ("tests/integration/test_resume_distributed.py", "tests/integration/test_distill_model_parallel.py"),
        "distributed checkpoints written and read by a sharded fit",
    ),
    "parallel/comm/dtensor.py": (("tests/distributed/test_model_parallel.py",), "DTensor views on real meshes"),
    "parallel/comm/fsdp2.py": (
        ("tests/distributed/test_placement.py", "tests/integration/test_shrink_on_freeze_sharded.py"),
        "FSDP2 introspection on sharded models",
    ),
    "parallel/comm/ranks.py": (("tests/distributed/test_discovery_broadcast.py",), "broadcasts on gloo ranks"),
    "parallel/comm/reduce.py": (
        ("tests/distributed/test_model_parallel.py", "tests/distributed/test_activation_stats.py"),
        "exact ordered sums on 2-4 ranks",
    ),
    "parallel/executors/base.py": (("tests/distributed/test_sharded.py",), "the executor protocol, via both executors"),
    "parallel/executors/materializing.py": (
        ("tests/distributed/test_model_parallel.py", "tests/distributed/test_explicit_dims.py"),
        "the dense path on sharded parameters",
    ),
    "parallel/executors/routing.py": (("tests/distributed/test_explicit_dims.py",), "routes on real placements"),
    "parallel/executors/sharded.py": (("tests/distributed/test_sharded.py",), "the Shard(0) path, one reduction"),
    "parallel/fsdp1.py": (("tests/integration/test_strategies.py",), "summoned parameters under FSDPStrategy"),
    "parallel/placement.py": (("tests/distributed/test_placement.py",), "layouts against real DTensor placements"),
    "parallel/teacher.py": (("tests/distributed/test_sharded_teacher.py",), "the sharded frozen teacher"),
    # presets
    "presets/chains.py": (("tests/unit/presets/test_presets.py",), "linear_chain in the presets' file"),
    "presets/experts.py": (("tests/integration/test_moe.py",), "MoE layouts on tiny MoE models"),
    "presets/registry.py": (("tests/unit/presets/test_presets.py",), "detection and registration on every family"),
    "presets/transformers.py": (("tests/unit/presets/test_presets.py",), "the family layouts on every family"),
    # pruning (tests/unit/pruning/ is another helper's at the time of issue 40)
    "pruning/declarations.py": (
        ("tests/unit/pruning/test_api.py", "tests/distributed/test_discovery_broadcast.py"),
        "clusters= to declarations, and early discovery",
    ),
    "pruning/tied_widths.py": (
        ("tests/integration/test_lm_tied_widths.py",),
        "widths one stock config field ties, on a tiny Jamba and a hand-made Hugging Face-like model",
    ),
    # scoring (another helper's at the time of issue 40)
    "scoring/hooks.py": (
        ("tests/unit/scoring/test_activation.py", "tests/unit/scoring/test_taylor.py"),
        "the training-forward hooks of the scorers",
    ),
    # shrink: tested through shrink()
    "shrink/attention_checks.py": (("tests/unit/shrink/test_entry.py",), "whole heads and groups, through shrink()"),
    "shrink/cuts.py": (("tests/unit/shrink/test_entry.py",), "the Edit record, through shrink()"),
    "shrink/edits.py": (
        ("tests/unit/shrink/test_entry.py", "tests/unit/shrink/test_batchnorm.py"),
        "edits collected and refused, through shrink()",
    ),
    "shrink/hf_entry.py": (
        ("tests/unit/shrink/test_entry.py", "tests/unit/export/test_pretrained.py"),
        "the shrunk HF config entry, written and read back",
    ),
    "shrink/model_meta.py": (("tests/unit/shrink/test_stock_config.py",), "module kinds and MLP widths"),
    "shrink/optimizer_state.py": (("tests/unit/shrink/test_entry.py",), "slice_optimizer_state next to the shrink"),
    "shrink/plan.py": (
        ("tests/unit/shrink/test_entry.py", "tests/integration/test_trusted_checkpoints.py"),
        "build_plan and the saved-state reader",
    ),
    "shrink/surgery.py": (("tests/unit/shrink/test_entry.py", "tests/unit/shrink/test_experts.py"), "apply_plan"),
    "shrink/verify.py": (("tests/unit/discovery/test_packed.py",), "the example-input check, naming the module"),
    # sizing
    "sizing/targets.py": (
        ("tests/unit/sizing/test_solver.py", "tests/unit/sizing/test_ranked_widths.py"),
        "sized clusters and unit costs, with the solver",
    ),
    # training (another helper's at the time of issue 40); Lightning hooks need a Trainer
    "training/bound.py": (
        ("tests/unit/training/test_collectors.py", "tests/unit/training/test_controller.py"),
        "binding",
    ),
    "training/callback.py": (("tests/integration/test_callback.py",), "the Lightning hooks, fitted"),
    "training/distill/loss.py": (("tests/integration/test_distill.py",), "KL value and gradient"),
    "training/distill/teacher.py": (("tests/integration/test_distill.py",), "the teacher copy, fitted"),
    "training/environment.py": (("tests/integration/test_strategies.py",), "the strategies the callback accepts"),
    "training/metrics.py": (("tests/integration/test_callback.py",), "logged sparsity, fitted"),
    "training/per_step.py": (("tests/unit/training/test_controller.py",), "the step's function, via the controller"),
    "training/recipes.py": (("tests/integration/test_recipes.py",), "OneShotPruningCallback, fitted"),
    "training/resume.py": (
        ("tests/unit/training/test_controller.py", "tests/integration/test_resume.py"),
        "resume, through the controller and a Trainer",
    ),
    "training/shrunk_restore.py": (
        ("tests/integration/test_shrink_on_freeze.py", "tests/integration/test_shrink_on_freeze_sharded.py"),
        "a checkpoint written after the shrink restored into a fresh module, one device and sharded, fitted",
    ),
    "training/trainer_facts.py": (
        ("tests/integration/test_strategies.py", "tests/integration/test_discovery_callback.py"),
        "what the callback reads from a Trainer (strategy, first batch), fitted",
    ),
    "training/views.py": (("tests/integration/test_callback.py",), "the callback's read-only views"),
}


def _report(problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{len(problems)} problem(s):\n" + "\n".join(problems), pytrace=False)


def _folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def _subpackages() -> list[str]:
    return [p.name for p in _folders(PACKAGE) if (p / "__init__.py").is_file()]


def _modules() -> list[str]:
    """Every module of the package, relative to lightning_pat/ (``core/spec/resolve.py``), faces left out."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if not p.name.startswith("__"))


def _own_test(module: str) -> str:
    """``tests/unit/<package>/test_<module>.py`` (``tests/unit/test_<module>.py`` for a top-level module)."""
    parts = module.removesuffix(".py").split("/")
    folder = "tests/unit" if len(parts) == 1 else f"tests/unit/{parts[0]}"
    return f"{folder}/test_{parts[-1]}.py"


def _names(package: str) -> set[str]:
    """What a test file of ``tests/unit/<package>/`` may be named after: its modules and nested subpackages."""
    root = PACKAGE / package
    modules = {p.stem for p in root.rglob("*.py") if not p.name.startswith("__")}
    return modules | {p.parent.name for p in root.rglob("__init__.py") if p.parent != root}


def test_every_unit_folder_mirrors_a_subpackage():
    folders = _folders(TESTS / "unit")
    assert folders, "tests/unit has no package folders"
    for folder in folders:
        package = PACKAGE / folder.name
        assert (package / "__init__.py").is_file(), (
            f"tests/unit/{folder.name}/ mirrors no subpackage: lightning_pat/{folder.name}/ does not exist"
        )
        assert (folder / "__init__.py").is_file(), f"tests/unit/{folder.name}/ has no __init__.py"
        assert list(folder.glob("test_*.py")), f"tests/unit/{folder.name}/ has no test module"


def test_every_subpackage_has_a_unit_folder_or_an_exemption():
    problems = []
    for package in _subpackages():
        has_folder = (TESTS / "unit" / package).is_dir()
        if not has_folder and package not in EXEMPT_PACKAGES:
            problems.append(
                f"lightning_pat/{package}/ has no tests/unit/{package}/: add the folder (with __init__.py and "
                f"test_<module>.py files), or EXEMPT_PACKAGES[{package!r}] = (covering tests, why) in {HERE}"
            )
        if has_folder and package in EXEMPT_PACKAGES:
            problems.append(f"tests/unit/{package}/ exists: delete EXEMPT_PACKAGES[{package!r}] in {HERE}")
    for package, (covering, _) in EXEMPT_PACKAGES.items():
        if package not in _subpackages():
            problems.append(f"EXEMPT_PACKAGES[{package!r}]: lightning_pat/{package}/ does not exist; delete it")
        if not (ROOT / covering).exists():
            problems.append(f"EXEMPT_PACKAGES[{package!r}] names {covering}, which does not exist")
    _report(problems)


def test_every_unit_test_file_is_named_after_a_module_of_its_package():
    problems = []
    for path in sorted((TESTS / "unit").glob("*/**/test_*.py")):
        rel = str(path.relative_to(ROOT))
        package = path.relative_to(TESTS / "unit").parts[0]
        named = path.stem.removeprefix("test_") in _names(package)
        if not named and rel not in FEATURE_FILES:
            problems.append(
                f"{rel} is named after no module of lightning_pat/{package}/: rename it test_<module>.py after the "
                f"module it tests, move a cross-floor test to tests/integration/, or add FEATURE_FILES[{rel!r}] = "
                f"'why' in {HERE}"
            )
        if named and rel in FEATURE_FILES:
            problems.append(f"{rel} is named after a module: delete FEATURE_FILES[{rel!r}] in {HERE}")
    for rel in FEATURE_FILES:
        if not (ROOT / rel).is_file():
            problems.append(f"FEATURE_FILES names {rel}, which does not exist: delete or rename the entry in {HERE}")
    loose = sorted(p.name for p in (TESTS / "unit").glob("test_*.py"))
    for name in sorted(set(loose) - set(TOP_LEVEL)):
        problems.append(
            f"tests/unit/{name} is in no package folder: move it to tests/unit/<package>/test_<module>.py, or add "
            f"TOP_LEVEL[{name!r}] = 'why' in {HERE} if it tests the package as a whole or the repository's tooling"
        )
    for name in sorted(set(TOP_LEVEL) - set(loose)):
        problems.append(f"TOP_LEVEL names tests/unit/{name}, which does not exist: delete the entry in {HERE}")
    _report(problems)


def test_every_module_has_its_test_file_or_a_documented_exemption():
    modules = _modules()
    problems = []
    for module in modules:
        own = _own_test(module)
        if not (ROOT / own).is_file() and module not in EXEMPT:
            problems.append(
                f"lightning_pat/{module} has no {own}: add that file, or this entry to EXEMPT in {HERE}:\n"
                f"    {module!r}: (('tests/<the file that covers it>.py',), '<why it has no test file of its own>'),"
            )
        if (ROOT / own).is_file() and module in EXEMPT:
            problems.append(f"lightning_pat/{module} has its own {own}: delete EXEMPT[{module!r}] in {HERE}")
    for module, (covering, why) in EXEMPT.items():
        if module not in modules:
            problems.append(
                f"EXEMPT[{module!r}]: lightning_pat/{module} does not exist (moved or removed?): re-key or delete the "
                f"entry in {HERE}"
            )
        if not covering or not why.strip():
            problems.append(f"EXEMPT[{module!r}] needs the covering test files and why")
        problems += [
            f"EXEMPT[{module!r}] names {path}, which does not exist: name the file that covers the module now"
            for path in covering
            if not (ROOT / path).is_file()
        ]
    _report(problems)


def test_launched_scripts_live_in_workers_folders():
    for kind in ("integration", "distributed"):
        loose = [
            p.name
            for p in (TESTS / kind).glob("*.py")
            if not p.name.startswith("test_") and p.name not in ("__init__.py", "conftest.py")
        ]
        assert not loose, f"tests/{kind}/ has helper modules outside workers/: {loose}"
        assert (TESTS / kind / "workers" / "__init__.py").is_file()
