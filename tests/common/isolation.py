"""Run documentation code as a fresh interpreter would see it, without paying for one (a process per block costs
the ~10-20 s of importing torch and Lightning).

What a block can lean on without importing it is process-global state: today the ``tiny_gpt`` preset, which only
``import lightning_pat.demo`` registers. :func:`without_demo` hides the demo (its modules and its registration) for
the duration, so a block that names ``"tiny_gpt"`` without importing the demo fails here as it fails for a user
(audit 2026-12b D4), and a block that imports it registers it again. Everything is put back on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

DEMO = "lightning_pat.demo"


@contextmanager
def without_demo() -> Iterator[None]:
    """Inside: ``lightning_pat.demo`` is not imported and ``tiny_gpt`` is not a preset (restored on exit)."""
    import lightning_pat
    from lightning_pat.presets import registry

    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in sys.modules if n == DEMO or n.startswith(f"{DEMO}.")]:
            patch.delitem(sys.modules, name)
        patch.delattr(lightning_pat, "demo", raising=False)
        patch.delitem(registry.PRESETS, "tiny_gpt", raising=False)
        patch.delitem(registry._LAYOUTS, "tiny_gpt", raising=False)  # noqa: SLF001 - the registry's detection list
        yield
