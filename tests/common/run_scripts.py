"""Run several scripts one after another in ONE process, each as ``python <script> <args>`` would run it.

``python tests/common/run_scripts.py '<json list of [script, arg, ...]>'`` runs each script with ``runpy`` under
``__name__ == "__main__"`` and its own ``sys.argv``, its stdout and stderr captured, and prints one JSON line per
script, after the prefix ``RUN_SCRIPTS`` (other output may reach the real stdout): ``{"script", "returncode",
"stdout", "stderr"}`` (``returncode`` from ``SystemExit``, 1 for an exception,
whose traceback ends its stderr). torch and Lightning are imported once for all of them instead of once per script
(several seconds each on a small CPU). For scripts that do not start processes of themselves by pickling functions
of their ``__main__`` (``multiprocessing`` spawn): run those in their own process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback
from collections.abc import Sequence

#: Starts each result line.
PREFIX = "RUN_SCRIPTS "


def run_as_main(script: str, args: Sequence[str]) -> int:
    """Run ``script`` as ``python script *args`` would in this process: its exit status (1 for an exception, whose
    traceback goes to stderr). ``sys.argv`` and ``sys.path`` (the script's folder first) are restored afterwards."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the script's failure, the caller goes on
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = argv, path


def run_one(script: str, args: list[str]) -> dict[str, object]:
    """``script`` run with ``args`` in this process; its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_as_main(script, args)
    return {"script": script, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    """Run the scripts of ``sys.argv[1]`` (a JSON list of ``[script, arg, ...]``) in order."""
    real_stdout = sys.stdout
    for script, *args in json.loads(sys.argv[1]):
        real_stdout.write(PREFIX + json.dumps(run_one(script, args)) + "\n")
        real_stdout.flush()


if __name__ == "__main__":
    main()
