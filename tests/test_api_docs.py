"""Every module of the package is on an API page (issue 26): a module nobody can find in the reference is a defect.

A module counts as documented when a page of ``docs/api/`` renders it (``::: lightning_pat.x.y``) or one of its
names (``::: lightning_pat.x.y.Name``); private modules (``_name``) are exempt. ``tests/test_docs.py`` builds the
pages in strict mode, so what is listed here also renders.
"""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import lightning_pat

ROOT = Path(__file__).resolve().parents[1]


def documented() -> set[str]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "api").glob("*.md")))
    return set(re.findall(r"^:::\s*([\w.]+)", text, re.M))


def modules() -> list[str]:
    found = pkgutil.walk_packages(lightning_pat.__path__, "lightning_pat.")
    return sorted(i.name for i in found if not i.ispkg and not i.name.rsplit(".", 1)[1].startswith("_"))


def test_every_module_is_on_an_api_page():
    refs = documented()
    missing = [m for m in modules() if not any(r == m or r.startswith(m + ".") for r in refs)]
    assert not missing, f"not on any docs/api page: {missing} (add `::: <module>` to the page of its floor)"


def test_every_api_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs" / "api").glob("*.md"))
    assert [p for p in pages if f"api/{p}" not in nav] == []


def test_the_check_sees_a_module_that_no_page_lists():
    assert "lightning_pat.pruning.pruner" in modules()
    assert any(r.startswith("lightning_pat.pruning.pruner") for r in documented())
    assert "lightning_pat.nonexistent" not in documented()
