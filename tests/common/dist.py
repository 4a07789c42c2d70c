"""Spawn gloo worker processes from a test, with a hard deadline so a hang fails instead of stalling CI.

``run_distributed(fn, world_size)`` starts ``world_size`` processes (``spawn`` context), each joining a gloo
process group through a ``FileStore``, runs ``fn(rank, world_size, *args)`` and returns the per-rank results in
rank order. The first failure (an exception on any rank, a dead worker, or the deadline) kills every worker and
fails the test with the rank's traceback.

``run_rank_scripts(script, world_size)`` runs a Python script once per rank as plain subprocesses with the rank
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``) set, which
is how Lightning expects to find already-launched ranks (so it never re-runs pytest).
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, results: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


_PRELOAD = ["torch", "torch.distributed.tensor", "lightning_pat", "tests.common.dist"]


def _context() -> Any:
    """A ``forkserver`` context whose server imports torch and lightning_pat once per test session.

    Each worker is then forked from that clean, single-threaded server: no per-worker import cost (several
    seconds each on a small CI machine), and no fork of the pytest process itself.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, store_path, results, args), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        try:
            while len(out) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"distributed run did not finish within {timeout}s; ranks done: {sorted(out)}")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in out and p.exitcode]
                    if dead:
                        codes = [procs[i].exitcode for i in dead]
                        raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
                    continue
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            _kill(procs)
    return [out[r] for r in range(world_size)]


def run_rank_scripts(
    script: str | Path,
    world_size: int,
    *,
    args: Sequence[str] = (),
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``script`` once per rank with the rank environment set; return each rank's combined output.

    A run that fails because the rendezvous port was taken in the meantime (other test processes on the machine)
    is retried once on a new port.

    Raises:
        TimeoutError: If the ranks do not all finish within ``timeout`` seconds (all are killed).
        RuntimeError: If any rank exits non-zero (its output is included).
    """
    try:
        return _run_rank_scripts_once(script, world_size, args=args, timeout=timeout, env=env)
    except RuntimeError as err:
        if "address already in use" not in str(err).lower():
            raise
        return _run_rank_scripts_once(script, world_size, args=args, timeout=timeout, env=env)


def _run_rank_scripts_once(
    script: str | Path, world_size: int, *, args: Sequence[str], timeout: float, env: dict[str, str] | None
) -> list[str]:
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world_size)]  # noqa: SIM115
        try:
            for rank in range(world_size):
                rank_env = {
                    **os.environ,
                    **(env or {}),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(world_size),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "NODE_RANK": "0",
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    "OMP_NUM_THREADS": "1",
                }
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        cwd=tmp,
                        env=rank_env,
                        stdout=logs[rank],
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait(10)
            texts = []
            for f in logs:
                f.seek(0)
                texts.append(f.read())
                f.close()
        codes = [p.returncode for p in procs]
        if any(c != 0 for c in codes):
            timed_out = time.monotonic() > deadline
            what = f"timed out after {timeout}s" if timed_out else f"exit codes {codes}"
            detail = "\n".join(f"----- rank {r} -----\n{t[-6000:]}" for r, t in enumerate(texts))
            raise (TimeoutError if timed_out else RuntimeError)(f"rank scripts {what}:\n{detail}")
    return texts


def finish_worker() -> None:
    """End a rank script cleanly: sync, tear the process group down, and exit without interpreter teardown.

    gloo's background threads can abort the interpreter at exit ("terminate called without an active exception")
    when the process group is still alive, which would fail a run whose work had succeeded.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)
