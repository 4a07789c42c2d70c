"""Suite-wide settings of the pytest process.

One intra-op torch thread (issue 26): the tests' models are tiny, so a second thread only spins; on the 2-core CI
machine it also competes with the rank processes and console scripts the tests start. Measured on
tests/integration/test_resume.py (Trainer fits in this process): the same wall time within noise, about 27% less CPU
time (18.5 s instead of 25.8 s, two runs each). Worker processes set their own (``tests.common.dist``: one thread per
rank). ``tests/unit/conftest.py``'s ``single_thread`` fixture stays correct: it restores the count it found.

The processes the tests start (examples, console scripts, notebooks, bench smoke runs) inherit
``OMP_NUM_THREADS=1`` unless the caller set it: with two xdist workers on two cores, each starting processes with a
thread per core, the intra-op threads spin against each other. Measured: two ``examples/cnn_digits.py`` runs side by
side took 37.6 s with the default threads and 15.0 s with one each; the same example inside the suite took 168 s.

The heaviest files run first (``pytest_collection_modifyitems``): files with a ``slow`` or ``distributed`` test, then
files with an ``integration`` test, then the rest, each in collection order. ``make test`` hands whole files to the
xdist workers in this order (``--dist loadfile --no-loadscope-reorder``; xdist's own reorder, by test count, sent
the multi-process files with one or two tests last, so one worker ran them while the other sat idle); the many
short unit files then even out the two workers' ends.

Every test starts from seed 0 (``fixed_seed``, autouse), and a run that leaves a new untracked file in the checkout
fails at its end (``pytest_sessionfinish``: tests write under ``tmp_path``; ignored paths such as caches do not count).
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test starts a process (see the module docstring)
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
_UNTRACKED = pytest.StashKey[set[str]]()


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    """Every test starts from the same random state (torch's default generator and ``random``), whatever ran before
    it on its xdist worker: a test that draws without seeding is reproducible alone and in the suite."""
    random.seed(0)
    torch.manual_seed(0)


#: Scheduling rank of a file by the markers of its tests: the lowest rank of any of its tests.
_RANK = {"slow": 0, "distributed": 0, "integration": 1}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest files first (see the module docstring); the tests of a file stay together and in order."""
    rank: dict[Path, int] = {}
    for item in items:
        marks = [_RANK[m.name] for m in item.iter_markers() if m.name in _RANK]
        rank[item.path] = min(rank.get(item.path, 2), *marks, 2)
    first = {path: i for i, path in reversed(list(enumerate(item.path for item in items)))}
    items.sort(key=lambda item: (rank[item.path], first[item.path]))


def _untracked() -> set[str] | None:
    """The checkout's untracked files outside ignored paths (``.gitignore``: the venv, caches, ``lightning_logs``),
    or ``None`` outside a git checkout (an sdist) or without git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "-z"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {entry[3:] for entry in out.stdout.split("\0") if entry.startswith("?? ")}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remember the untracked files before the run (the controller only, not each xdist worker)."""
    if not hasattr(session.config, "workerinput") and (before := _untracked()) is not None:
        session.config.stash[_UNTRACKED] = before


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No artifacts: a test run leaves no new untracked file in the checkout (tests write under ``tmp_path``).

    Only files that appeared during the run count, so a checkout with work in progress still passes; a file made by
    hand during the run is reported too (run again). The run then exits 1 (pytest's "tests failed").
    """
    before = session.config.stash.get(_UNTRACKED, None)
    if before is None or (after := _untracked()) is None:
        return
    left = sorted(after - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"the test run left {len(left)} new untracked file(s) in the checkout (write under tmp_path, or "
            f"add the path to .gitignore if it is a cache): {left[:20]}"
        )
        if reporter is not None:
            reporter.write_sep("=", "no-artifacts check failed", red=True)
            reporter.write_line(message, red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
