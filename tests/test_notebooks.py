"""The notebooks: stored without outputs, and each one executes top to bottom (fast mode, a few seconds each)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
pytestmark = pytest.mark.integration


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names[:3] == ["01_quickstart.ipynb", "02_choosing_clusters.ipynb", "03_shrink_and_export.ipynb"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them before committing"


@pytest.mark.slow  # a kernel process per notebook
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch, tmp_path):
    from nbclient import NotebookClient

    monkeypatch.setenv("LPAT_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("LPAT_NOTEBOOK_OUTPUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} rendered no inline plot"
