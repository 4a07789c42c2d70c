"""Import a script of ``bench/`` as a module (they are scripts, not a package), the way the tests need it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as the module ``bench_<name>``, with ``bench/`` on ``sys.path`` (the scripts import
    each other) and the module in ``sys.modules`` (dataclasses look their module up there); loaded once."""
    key = f"bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module
