"""Issue 39 (audit 2026-12b A6, A7, C8) through the front doors: ``CausalLM(export=...)`` and the installed
``lightning-pat shrink``.

* A7: ``CausalLM(pretrained=D, export=D, export_overwrite=True)`` is refused at fit start, before any step, and the
  model directory is unchanged; ``lightning-pat shrink --output <the model directory> --overwrite`` likewise (one
  line, exit status 1), before the checkpoint is read.
* A6: ``lightning-pat shrink --tokenizer <a tokenizer of 600 ids>`` for a model of 320 embedding rows: one line
  naming both sizes, exit status 1, nothing written.
* C8: the fit-start message names ``model.init_args.export_overwrite``, the option of ``lightning-pat fit``.
* The shipped ``examples/configs/smollm2.yaml`` (``export_overwrite: true``) still exports for its normal case, an
  export directory apart from the model, twice in a row (the second run replaces the first export).

References: the model directory's sha256 before and after, the exit status and stderr of the console script.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_pat import CoupledPruningCallback
from lightning_pat.lm import CausalLM, TextFiles
from tests.common.tiny_lm import code_files, tiny_lm_dir

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "lightning-pat"


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAT_CACHE", str(tmp_path / "cache"))


def test_causal_lm_refuses_to_export_over_the_model_it_was_loaded_from(tmp_path, cache):
    mine = tiny_lm_dir(tmp_path / "src")
    before = digest(mine)
    lm = CausalLM(str(mine), export=str(mine), export_overwrite=True)
    data = TextFiles(files=code_files(tmp_path / "t"), seq_len=16, val_windows=4, train_windows=16, english=False)
    cb = CoupledPruningCallback("llama", 0.5, warmup_steps=1, ramp_steps=2)
    trainer = pl.Trainer(
        max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"output directory .*tiny-lm is the model this export was read from"):
        trainer.fit(lm, datamodule=data)
    assert trainer.global_step == 0  # refused at fit start, before any step
    assert digest(mine) == before
    # C8: a non-empty export directory names the option as `lightning-pat fit` spells it
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "config.json").write_text("{}")
    lm = CausalLM(str(mine), export=str(tmp_path / "busy"))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(FileExistsError, match=r"pass export_overwrite=True \(.*model\.init_args\.export_overwrite"):
        trainer.fit(lm, datamodule=data)


@pytest.mark.slow
def test_yaml_export_then_shrink_refuses_the_model_directory_and_a_foreign_tokenizer(tmp_path, cache):
    lm_dir, big = tiny_lm_dir(tmp_path / "lm"), tiny_lm_dir(tmp_path / "big", vocab=600)
    before = digest(lm_dir)
    files = code_files(tmp_path / "texts", n=20)
    export = tmp_path / "export"
    fit = [
        "fit", "--config", str(ROOT / "examples/configs/smollm2.yaml"), f"--model.init_args.pretrained={lm_dir}",
        f"--model.init_args.export={export}", f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
        "--trainer.callbacks.init_args.target_params=0.8", "--trainer.callbacks.init_args.warmup_steps=1",
        "--trainer.callbacks.init_args.ramp_steps=2", f"--data.init_args.files=[{', '.join(files)}]",
        "--data.init_args.seq_len=16", "--data.init_args.val_windows=2", "--data.init_args.train_windows=32",
    ]  # fmt: skip
    for _ in range(2):  # the shipped export_overwrite: true replaces the run's own earlier export
        proc = script(*fit, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (export / "tokenizer.json").is_file()
    (ckpt, *_) = sorted((tmp_path / "runs").glob("lightning_logs/version_0/checkpoints/*.ckpt"))
    proc = script("shrink", "--ckpt_path", str(ckpt), "--output", str(lm_dir), "--overwrite", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
    assert "was not written by lightning_pat" in proc.stderr
    assert digest(lm_dir) == before
    out = tmp_path / "shrunk"
    proc = script("shrink", "--ckpt_path", str(ckpt), "--output", str(out), "--tokenizer", str(big), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "has 600 token ids" in proc.stderr
    assert "only 320 rows" in proc.stderr
    assert not out.exists()
    assert not list(tmp_path.glob(".shrunk.partial-*"))
