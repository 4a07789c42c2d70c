"""Run the examples and the ``lightning-pat`` console script as a user would: in a fresh process, from a temp folder."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL_DATA = "--max_bytes=100000"


def run(args: list[str], tmp_path: Path, **env: str) -> str:
    """Run ``python *args`` in ``tmp_path`` (the repository on PYTHONPATH); assert exit 0; stdout + stderr."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,  # examples must not depend on the working directory
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=600,  # generous: the examples take seconds alone, minutes on a busy shared CPU
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def example(name: str) -> str:
    """The path of ``examples/<name>``."""
    return str(ROOT / "examples" / name)


def cli(tmp_path: Path, *args: str) -> str:
    """``python -m lightning_pat.cli *args`` (see :func:`run`)."""
    return run(["-m", "lightning_pat.cli", *args], tmp_path)


def tiny_fit_args(tmp_path: Path, config: str) -> list[str]:
    """``fit`` with ``examples/configs/<config>``, 2 steps, a 2-step ramp, little data, logs under ``tmp_path``."""
    return [
        "fit",
        f"--config={ROOT / 'examples' / 'configs' / config}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks.init_args.warmup_steps=0",
        "--trainer.callbacks.init_args.ramp_steps=2",
        "--trainer.callbacks.init_args.every_n_steps=1",
        "--data.max_bytes=50000",
        "--data.batch_size=4",
    ]


def console_script() -> str:
    """The installed `lightning-pat` console script (next to this interpreter, else on PATH)."""
    found = Path(sys.executable).parent / "lightning-pat"
    path = str(found) if found.is_file() else shutil.which("lightning-pat")
    assert path, "the lightning-pat console script is not installed (pip install -e .)"
    return path


def shell(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``command`` in bash in ``tmp_path`` (the repository on PYTHONPATH); the result, whatever its exit."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )


#: The loggers a fresh ``lightning-pat`` process prints, from this level: Lightning's own handlers at INFO; ours
#: has none there, so Python's last-resort handler prints its warnings.
LOGGERS = {"lightning.pytorch": logging.INFO, "lightning.fabric": logging.INFO, "lightning_pat": logging.WARNING}


def in_process(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cwd: Path, *args: str
) -> tuple[int, str]:
    """``lightning_pat.cli:main(args)`` (what the console script runs) in this process, from ``cwd``.

    One process start fewer than :func:`cli` (several seconds of imports each). The environment is restored after
    the call (LightningCLI's ``seed_everything`` sets ``PL_GLOBAL_SEED``). Returns the exit status (``main``'s return
    value, or the code of a ``SystemExit``, e.g. 2 for an argument error) and everything written to stdout and
    stderr, at the file descriptor level (Lightning's log handler holds the original stream). Warnings are shown,
    not raised, as in a fresh interpreter (the test session's filters turn them into errors).
    """
    from lightning_pat.cli import main

    monkeypatch.chdir(cwd)
    saved = dict(os.environ)
    # the log lines a fresh process prints (Lightning's and ours at INFO, on stderr), whatever earlier tests in this
    # process did to these loggers and whatever pytest's log capture holds
    handler = logging.StreamHandler(sys.stderr)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    state = [(lg.level, lg.propagate, lg.disabled) for lg in loggers]
    for lg, level in zip(loggers, LOGGERS.values(), strict=True):
        lg.setLevel(level)
        lg.propagate, lg.disabled = False, False
        lg.addHandler(handler)
    capfd.readouterr()
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("default")
            code: int | str | None = main(list(args))
    except SystemExit as exc:
        code = exc.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for lg, (level, propagate, disabled) in zip(loggers, state, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
    out, err = capfd.readouterr()
    return (code if isinstance(code, int) else (0 if code is None else 1)), out + err
