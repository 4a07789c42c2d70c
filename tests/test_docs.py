"""The documentation site builds in strict mode (every docstring, cross-reference and link resolves)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_mkdocs_is_installed_by_make_setup():
    """The docs build is a test like any other: mkdocs is a test extra that `make setup` installs (issue 23, D4)."""
    import importlib.util

    extras = (ROOT / "pyproject.toml").read_text().split("\ntest = [", 1)[1].split("]\n", 1)[0]
    assert '"mkdocs>=' in extras
    assert '"mkdocstrings[python]>=' in extras
    assert '-e ".[test' in (ROOT / "Makefile").read_text()  # make setup installs the test extras
    missing = [m for m in ("mkdocs", "mkdocstrings") if importlib.util.find_spec(m) is None]
    assert not missing, f"{missing} not installed in {sys.executable}: run `make setup` (they are test extras)"


@pytest.mark.timeout(600)
def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (site / "api" / "training" / "index.html").read_text()
    for name in ("PruningController", "CoupledPruningCallback", "PruningOptions", "after_step"):
        assert name in api  # the reference really comes from the docstrings
    assert "Cluster" in (site / "bad-input" / "index.html").read_text()


def test_readme_stays_the_front_door():
    readme = (ROOT / "README.md").read_text()
    for moved in ("## Bad input", "## Resume, a second `fit`", "## Presets", "## How it trains the pruned model"):
        assert moved not in readme, f"{moved} lives in docs/ now"
    for kept in ("## Quickstart", "## Use it from a Trainer", "## Or from a YAML file", "## Features", "## Benchmarks"):
        assert kept in readme
