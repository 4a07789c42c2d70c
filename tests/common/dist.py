"""Spawn gloo worker processes from a test, with a hard deadline so a hang fails instead of stalling CI.

``run_distributed(fn, world_size)`` starts ``world_size`` processes (``spawn`` context), each joining a gloo
process group through a ``FileStore``, runs ``fn(rank, world_size, *args)`` and returns the per-rank results in
rank order. The first failure (an exception on any rank, a dead worker, or the deadline) kills every worker and
fails the test with the rank's traceback.

``run_rank_scripts(script, world_size)`` runs a Python script once per rank, as ``python script`` would run it
(``__name__ == "__main__"``, its own ``sys.argv``, a scratch working directory, stdout and stderr into a log), with
the rank environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``) set,
which is how Lightning expects to find already-launched ranks (so it never re-runs pytest). Each rank is forked
from the same preloaded server as :func:`run_distributed`'s, not started as a new interpreter: torch and Lightning
are imported once per test session, not once per rank of every run.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.common.run_scripts import run_as_main

REPO = Path(__file__).resolve().parents[2]


#: The ports pytest-xdist workers draw rendezvous ports from, below Linux's ephemeral range (32768-60999): worker
#: ``gwN`` of ``n`` owns the N-th of ``n`` equal slices, so two workers' worlds never pick the same port (a rank of one
#: world would join the other's rendezvous) and no outgoing connection's local port takes one.
PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port that was free a moment ago: from this xdist worker's own range, else one the OS picks.

    Example::

        >>> 0 < free_port() < 65536
        True
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) < count:
        span = (PORT_RANGE[1] - PORT_RANGE[0]) // count
        low = PORT_RANGE[0] + int(worker[2:]) * span
        for port in random.Random().sample(range(low, low + span), min(64, span)):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
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


_PRELOAD = ["torch", "torch.distributed.tensor", "lightning_pat", "lightning.pytorch", "tests.common.dist"]


def _context() -> Any:
    """A ``forkserver`` context whose server imports torch, Lightning and lightning_pat once per test session.

    Each worker is then forked from that clean, single-threaded server: no per-worker import cost (several
    seconds each on a small CI machine: ``lightning.pytorch`` alone took ~6 s per rank of every run before it was
    preloaded), and no fork of the pytest process itself. Single-threaded because tests/conftest.py sets
    ``OMP_NUM_THREADS=1`` before any process starts (with more, scipy's BLAS, imported by Lightning via
    torchmetrics, starts a thread pool in the server).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_TRANSPORT_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class DistributedRunError(RuntimeError):
    """A failed :func:`run_distributed` run; ``transport_only`` when every rank's error is a gloo transport error."""

    def __init__(self, message: str, *, transport_only: bool) -> None:
        super().__init__(message)
        self.transport_only = transport_only


def is_transport_error(trace: str) -> bool:
    """Whether a rank's traceback is a gloo TCP transport failure (a peer's socket went away), not a Python error.

    Example::

        >>> is_transport_error("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        True
        >>> is_transport_error("ValueError: cluster 'mlp' has 3 units")
        False
    """
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    return "gloo" in last and any(e in last for e in _TRANSPORT_ERRORS)


def _failure(
    first: tuple[int, str] | None, results: Any, procs: Sequence[Any], grace: float = 5.0
) -> DistributedRunError:
    """Every rank's failure, not only the first to arrive.

    The first traceback is often a consequence (a gloo "connection reset" on a rank whose peer failed or died), so
    the other ranks get ``grace`` seconds to report theirs, and dead workers are named with their exit codes.
    """
    errors = dict([first]) if first else {}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            other, status, value = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for i, p in enumerate(procs) if i not in errors):
                break
            continue
        if status == "error":
            errors[other] = value
    dead = {i: p.exitcode for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)}
    dead = {i: code for i, code in dead.items() if i not in errors}
    head = f"failed ranks: {sorted(errors)}; dead workers without a report (exit codes): {dead or 'none'}"
    if first:
        head = f"rank {first[0]} failed first; " + head
    body = "".join(f"\n----- rank {r} -----\n{t}" for r, t in sorted(errors.items()))
    transport_only = bool(errors) and all(is_transport_error(t) for t in errors.values())
    return DistributedRunError(head + body, transport_only=transport_only)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order.

    A run whose only errors are gloo TCP transport failures (a peer's socket reset, with no Python error on any
    rank: a known, rare gloo flake on loaded machines) is run once more from scratch, with a ``RuntimeWarning``
    that carries the first run's report; any other failure, or a second transport failure, fails the test.

    Raises:
        DistributedRunError: If a rank raises or dies.
        TimeoutError: If the ranks do not all finish within ``timeout`` seconds (each attempt).
    """
    try:
        return _run_distributed_once(fn, world_size, args, timeout)
    except DistributedRunError as err:
        if not err.transport_only:
            raise
        warnings.warn(f"run_distributed: retrying after a gloo transport failure:\n{err}", RuntimeWarning, stacklevel=2)
    return _run_distributed_once(fn, world_size, args, timeout)


def _run_distributed_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
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
                    if any(not p.is_alive() and i not in out and p.exitcode for i, p in enumerate(procs)):
                        raise _failure(None, results, procs) from None
                    continue
                if status == "error":
                    raise _failure((rank, value), results, procs)
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

    A run that fails because the rendezvous port was taken in the meantime (other test processes on the machine),
    or whose only errors are gloo TCP transport failures (see :func:`run_distributed`), is retried once on a new
    port, with a ``RuntimeWarning`` for the latter.

    Raises:
        TimeoutError: If the ranks do not all finish within ``timeout`` seconds (all are killed).
        RuntimeError: If any rank exits non-zero (its output is included).
    """
    try:
        return _run_rank_scripts_once(script, world_size, args=args, timeout=timeout, env=env)
    except RuntimeError as err:  # a TimeoutError is not one: never retried
        port_taken = "address already in use" in str(err).lower()
        if not (port_taken or only_transport_errors(str(err))):
            raise
        if not port_taken:
            warnings.warn(
                f"run_rank_scripts: retrying after a gloo transport failure:\n{err}", RuntimeWarning, stacklevel=2
            )
        return _run_rank_scripts_once(script, world_size, args=args, timeout=timeout, env=env)


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception)): .*$", re.MULTILINE)


def only_transport_errors(output: str) -> bool:
    """Whether the exception lines of the ranks' ``output`` are all gloo transport failures (and there is one)."""
    errors = _EXCEPTION_LINE.findall(output)
    return bool(errors) and all(is_transport_error(e) for e in errors)


def _rank_script(script: str, args: Sequence[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A forked rank: the environment, working directory, ``sys.argv`` and output of ``python script *args``."""
    os.environ.clear()  # exactly the environment the test gave (the server's is from the session's start)
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = run_as_main(script, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown in a forked child (gloo's threads; see finish_worker)


def _run_rank_scripts_once(
    script: str | Path, world_size: int, *, args: Sequence[str], timeout: float, env: dict[str, str] | None
) -> list[str]:
    port = free_port()
    ctx = _context()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
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
                p = ctx.Process(target=_rank_script, args=(str(script), list(args), rank_env, tmp, logs[rank]))
                p.start()
                procs.append(p)
            deadline = time.monotonic() + timeout
            while any(p.exitcode is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            _kill(procs)
            texts = []
            for log in logs:
                try:
                    with open(log) as f:
                        texts.append(f.read())
                except FileNotFoundError:  # the rank died before it opened its log
                    texts.append("")
        codes = [p.exitcode for p in procs]
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


def result_records(outputs: Sequence[str], prefix: str = "RESULT ") -> list[dict[str, Any]]:
    """The JSON records the rank scripts printed on lines starting with ``prefix``, rank by rank, in print order."""
    return [json.loads(line[len(prefix) :]) for out in outputs for line in out.splitlines() if line.startswith(prefix)]


_T = TypeVar("_T")


def once_per_world(launch: Callable[[Any], _T]) -> Callable[[Any], _T]:
    """``launch(world)`` run at most once per ``world`` key (a world of rank processes that runs several cases).

    Every case that asks for the same world gets its result; if the launch failed, each of them re-raises the same
    error (so a failed world fails every case it holds, each with the rank report).
    """
    done: dict[Hashable, Any] = {}

    def runs(world: Any) -> _T:
        if world not in done:
            try:
                done[world] = launch(world)
            except Exception as err:  # noqa: BLE001 - re-raised for every case of the world
                done[world] = err
        got = done[world]
        if isinstance(got, BaseException):
            raise got
        return got

    return runs
