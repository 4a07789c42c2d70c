"""Issue 23 (D3): every Python block of docs/*.md runs as written, or says why it does not.

The blocks of one page run in order in one namespace (a page reads top to bottom, like a notebook), in a scratch
directory, with the demo not imported (``tests/common/isolation.py``): a page that names the ``tiny_gpt`` preset
imports ``lightning_pat.demo`` itself, as a reader's fresh interpreter needs it to. A block that cannot run here is
preceded by ``<!-- not run: <reason> -->`` on the line before its fence (the reason must be given); indented blocks
(inside a list item) are dedented first.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.common.isolation import without_demo

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"(?P<before>[^\n]*)\n(?P<indent>[ ]*)```python\n(?P<code>.*?)\n(?P=indent)```", re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.*?)\s*-->")
pytestmark = pytest.mark.integration


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """(code, reason it is not run or None) of every python block, indented ones dedented."""
    out = []
    for match in FENCE.finditer("\n" + text):
        indent = match["indent"]
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in match["code"].split("\n"))
        marker = NOT_RUN.search(match["before"])
        out.append((textwrap.dedent(code), None if marker is None else marker["reason"]))
    return out


def test_the_block_finder_sees_indented_blocks_and_markers():
    text = (
        "intro\n```python\nx = 1\n```\n- item:\n\n  ```python\n  y = x + 1\n  ```\n"
        "<!-- not run: needs 8 GPUs -->\n```python\nz\n```\n"
    )
    assert python_blocks(text) == [("x = 1", None), ("y = x + 1", None), ("z", "needs 8 GPUs")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_python_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for i, (code, reason) in enumerate(python_blocks(page.read_text())):
        if reason is not None:
            assert reason.strip(), f"{page.name} block {i}: `not run` needs a reason"
            continue
        with without_demo():
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)  # noqa: S102 - our own docs
        ran += 1
    assert ran, f"{page.name}: every block is marked not run"


def test_every_page_with_python_is_covered():
    covered = [p.name for p in PAGES if python_blocks(p.read_text())]
    assert {"size.md", "training.md", "discovery.md"} <= set(covered)
