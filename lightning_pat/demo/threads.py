"""How many CPU threads the demo, the examples and the notebooks give torch: a count that cannot oversubscribe.

torch starts one intra-op thread per physical core whatever else runs there. On a machine shared with other busy
processes its threads then wait for each other at every parallel op: a 30-step slice of the demo took 63-133 s with
torch's default on a loaded 2-core machine and 14-18 s with one thread. :func:`cpu_threads` picks

1. ``OMP_NUM_THREADS`` when it is set (the user's choice, always respected);
2. else the CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where that does not exist),
   less the load other processes put on them now (the 1-minute load average where the system reports one, less
   the one CPU this process's own start kept busy), at least 1 and at most ``cap``;

and :func:`use_cpu_threads` applies it and returns a line that says what it chose and why (the scripts print it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

#: Above this, the demo's and examples' small matrices gain nothing from more threads.
DEFAULT_CAP = 8


def cpu_threads(*, cap: int = DEFAULT_CAP, processes: int = 1, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The intra-op thread count for this process, and the reason (see the module docstring).

    Args:
        cap: The most threads to use when ``OMP_NUM_THREADS`` is not set.
        processes: How many processes share the CPUs (e.g. the ranks of a multi-process run on one machine).
        env: The environment to read (``os.environ`` by default).

    Returns:
        ``(threads, reason)``.

    Example::

        >>> cpu_threads(env={"OMP_NUM_THREADS": "3"})
        (3, 'OMP_NUM_THREADS=3')
        >>> cpu_threads(env={}, cap=1)[0]
        1
    """
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw), f"OMP_NUM_THREADS={raw}"
    try:
        usable, where = len(os.sched_getaffinity(0)), "CPUs this process may use"
    except AttributeError:  # macOS, Windows
        usable, where = os.cpu_count() or 1, "CPUs"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows, or no load average
        load = 0.0
    others = max(0.0, load - 1.0)  # this process's own start (imports) is about one busy CPU of that average
    threads = max(1, min(cap, math.floor(max(usable - others, 1.0) / max(processes, 1))))
    reason = f"{usable} {where}, 1-minute load {load:.1f}"
    if processes > 1:
        reason += f", shared by {processes} processes"
    return threads, f"{reason}, at most {cap}; set OMP_NUM_THREADS to choose"


def use_cpu_threads(*, cap: int = DEFAULT_CAP, processes: int = 1) -> str:
    """Set torch's intra-op threads to :func:`cpu_threads` and return the line that says so.

    Args:
        cap: As for :func:`cpu_threads`.
        processes: As for :func:`cpu_threads`.

    Returns:
        e.g. ``"torch CPU threads: 1 (2 CPUs this process may use, 1-minute load 3.2, at most 8; ...)"``.
    """
    threads, reason = cpu_threads(cap=cap, processes=processes)
    torch.set_num_threads(threads)
    return f"torch CPU threads: {threads} ({reason})"
