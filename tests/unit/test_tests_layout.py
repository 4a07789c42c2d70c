"""The tests mirror the package: ``tests/unit/<package>/`` for each subpackage, workers under ``tests/*/workers/``.

A unit test of ``lightning_pat/<package>/<module>.py`` lives in ``tests/unit/<package>/``; tests of the package as a
whole (its layers, its public surface) and of top-level modules stay in ``tests/unit/``. The integration and
distributed tests are grouped by kind; the scripts they launch per rank live in their ``workers/`` folder.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "lightning_pat"


def _folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


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


def test_launched_scripts_live_in_workers_folders():
    for kind in ("integration", "distributed"):
        loose = [
            p.name
            for p in (TESTS / kind).glob("*.py")
            if not p.name.startswith("test_") and p.name not in ("__init__.py", "conftest.py")
        ]
        assert not loose, f"tests/{kind}/ has helper modules outside workers/: {loose}"
        assert (TESTS / kind / "workers" / "__init__.py").is_file()
