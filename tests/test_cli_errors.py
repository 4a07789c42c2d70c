"""Issue 23 (B5, C12, D2): ``lightning-pat`` through the installed console script, for the errors a user meets first.

A value error in a YAML callback config (``clusters: tinygpt``, ``target_params: 1e999``) and a target the model
cannot reach at fit start each end with our message as the last line (exit status 1), not jsonargparse's dump or
Lightning's traceback; ``--help`` and an invalid subcommand list ``shrink``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "lightning-pat"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_pat.CoupledPruningCallback
      init_args:
        clusters: {clusters}
{extra}
model:
  class_path: tests.common.lit_models.MLPModule
"""
HIDDEN = "[{name: hidden, writers: [fc1.weight, fc1.bias], readers: [fc2.weight]}]"


def run(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


CASES = [
    ("tinygpt", "", r"^lightning-pat fit: error: `clusters`: Unknown preset 'tinygpt'; expected one of \['llama'"),
    (HIDDEN, "        target_params: 1e999", r"^lightning-pat fit: error: `target_params` .*(finite|1e999)"),
    (
        HIDDEN,
        "        target_params: 4B",
        r"^lightning-pat fit: error: CoupledPruningCallback: `target_params` = '4B' \(4,000,000,000 parameters\) "
        r"is above the model's size \(420\).*\[raised on rank 0; all ranks stop here\]$",
    ),
]
IDS = ["preset-typo", "size-1e999", "size-above-model-at-fit-start"]


@pytest.mark.slow
def test_a_configuration_error_is_one_line_with_exit_status_1_from_the_console_script(tmp_path):
    config = tmp_path / "config.yaml"
    clusters, extra, match = CASES[0]
    config.write_text(CONFIG.format(clusters=clusters, extra=extra))
    proc = run(tmp_path, "fit", f"--config={config}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(match, last), last
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Given value" not in proc.stderr


@pytest.mark.parametrize(("clusters", "extra", "match"), CASES, ids=IDS)
def test_a_configuration_error_is_one_line(tmp_path, monkeypatch, capsys, clusters, extra, match):
    """The same entry point in this process (``lightning_pat.cli:main`` is what the console script runs)."""
    from lightning_pat.cli.app import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(clusters=clusters, extra=extra))
    assert main(["fit", f"--config={config}"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(match, last), last
    monkeypatch.setenv("LIGHTNING_PAT_TRACEBACK", "1")  # the traceback when asked for
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(Exception) as raised:  # noqa: PT011 - jsonargparse's ValueError or ours
        main(["fit", f"--config={config}"])
    assert any(isinstance(e, MisconfigurationException) for e in _chain(raised.value))


def _chain(err):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


@pytest.mark.slow
def test_help_and_an_invalid_subcommand_list_shrink(capsys):
    from lightning_pat.cli import main

    with pytest.raises(SystemExit) as exit_info:  # in this process: what the console script runs
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,shrink}" in out
    assert "shrink " in out.split("Available subcommands:")[1]
    # an invalid subcommand, in this process too (the installed script's exit status 2 for an argument error is
    # asserted by tests/test_console_script.py::test_callback_option_typo_names_the_fix_first[command-line])
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "(choose from 'fit', 'validate', 'test', 'predict', 'shrink')" in capsys.readouterr().err
