"""Folders and exports are untrusted input (DESIGN invariant 10): no code from a folder, no CLI started by a file.

Audit 2026-12b, A1 and A2. Each case runs in a fresh process, as a user's script would, with ``y`` waiting on
stdin: the answer transformers' remote-code prompt would take if any loader let it ask. The marker file that the
folder's code writes must never appear, and the refusal must be ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from lightning_pat import load_pretrained, save_pretrained
from tests.common.processes import console_script

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
REFUSAL = "never runs code from a folder"


def evil_folder(root: Path) -> tuple[Path, Path]:
    """A model folder whose config asks for its own code (unknown ``model_type`` + ``auto_map``), and its marker."""
    folder = root / "evil"
    folder.mkdir()
    marker = root / "PWNED"
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.M", "AutoTokenizer": "evil.T"}
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto_map}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "EvilTok", "auto_map": auto_map}))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder, marker


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, ``y`` on stdin, the repository on the path (for ``tests.common``)."""
    return subprocess.run(
        [sys.executable, "-c", code], input="y\ny\n", text=True, capture_output=True, cwd=cwd, timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


LOADERS = {
    "load_pretrained": "from lightning_pat import load_pretrained as f; f({d!r})",
    "CausalLM": "from lightning_pat.lm import CausalLM; CausalLM({d!r})",
    "TextFiles": "from lightning_pat.lm import TextFiles; TextFiles(files=[], tokenizer={d!r})._tokenizer()",
    "shrink's model_from_config": (
        "import yaml, pathlib; p = pathlib.Path({d!r}).parent / 'config.yaml'; "
        "p.write_text(yaml.safe_dump({{'model': {{'class_path': 'lightning_pat.lm.CausalLM', "
        "'init_args': {{'pretrained': {d!r}}}}}}})); "
        "from lightning_pat.cli.checkpoint import model_from_config; model_from_config(p)"
    ),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_folder_asking_for_its_own_code_is_refused_and_its_code_never_runs(tmp_path, loader):
    folder, marker = evil_folder(tmp_path)
    code = "try:\n    " + LOADERS[loader].format(d=str(folder)) + "\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    done = run_python(code, tmp_path)
    assert not marker.exists(), f"{loader} ran the folder's code"
    assert "[y/N]" not in done.stdout + done.stderr, "transformers was allowed to ask"
    assert "REFUSED" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert REFUSAL in done.stdout
    assert "auto_map" in done.stdout
    assert str(folder) in done.stdout


def test_the_console_script_refuses_a_model_folder_that_asks_for_its_own_code(tmp_path):
    folder, marker = evil_folder(tmp_path)
    text = tmp_path / "a.py"
    text.write_text("def f(x):\n    return x\n" * 50)
    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer: {max_steps: 1, logger: false, enable_checkpointing: false}\n"
        f"model: {{class_path: lightning_pat.lm.CausalLM, init_args: {{pretrained: {folder}}}}}\n"
        f"data: {{class_path: lightning_pat.lm.TextFiles, init_args: {{files: [{text}]}}}}\n"
    )
    done = subprocess.run(
        [console_script(), "fit", "--config", str(config)], input="y\ny\n", text=True, capture_output=True,
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert not marker.exists()
    assert REFUSAL in done.stderr, done.stderr[-3000:]


def test_a_model_folder_whose_auto_map_is_an_extra_loads_with_the_built_in_class(tmp_path):
    """Many hub checkpoints of families transformers ships carry an ``auto_map``: those load, without the code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pat.export.hf_loader import load_causal_lm

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    )
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.M"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "evil.py").write_text("raise SystemExit('the folder code ran')\n")
    loaded = load_causal_lm(tmp_path / "m", what="test")
    assert type(loaded) is LlamaForCausalLM
    with pytest.raises(ValueError, match="always False"):
        load_causal_lm(tmp_path / "m", what="test", trust_remote_code=True)


def test_an_export_naming_the_cli_main_module_imports_nothing_and_starts_nothing(tmp_path):
    """A1: the class path ``lightning_pat.cli.__main__.Anything`` used to start LightningCLI inside load_pretrained."""
    save_pretrained(nn.Linear(2, 2), tmp_path / "exp")
    info_file = tmp_path / "exp" / "lightning_pat.json"
    info = json.loads(info_file.read_text())
    info["modules"][0]["class"] = "lightning_pat.cli.__main__.Anything"
    info_file.write_text(json.dumps(info))
    code = (
        "import sys\nfrom lightning_pat import load_pretrained\n"
        f"try:\n    load_pretrained({str(tmp_path / 'exp')!r})\nexcept ValueError as e:\n    print('REFUSED', e)\n"
        "print('IMPORTED' if 'lightning_pat.cli.__main__' in sys.modules else 'NOT IMPORTED')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "fit"], text=True, capture_output=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout
    assert "not in a model module" in done.stdout
    assert "NOT IMPORTED" in done.stdout
    assert "usage:" not in done.stdout + done.stderr


def test_importing_the_cli_main_module_runs_nothing():
    done = subprocess.run(
        [sys.executable, "-c", "import lightning_pat.cli.__main__; print('DONE')", "fit"],
        text=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "DONE"


def test_load_pretrained_imports_no_module_outside_the_model_modules(tmp_path, monkeypatch):
    """Even a real class under an allowed package is refused when its module is not a model module."""
    save_pretrained(nn.Linear(2, 2), tmp_path / "exp")
    info_file = tmp_path / "exp" / "lightning_pat.json"
    info = json.loads(info_file.read_text())
    info["modules"][0]["class"] = "lightning_pat.training.callback.CoupledPruningCallback"
    info_file.write_text(json.dumps(info))
    imported: list[str] = []
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with pytest.raises(ValueError, match="not in a model module"):
        load_pretrained(tmp_path / "exp")
    assert imported == []
