"""Examples, LightningCLI configs and the ``lightning-pat`` command run as tests, with tiny step counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration
SMALL_DATA = "--max_bytes=100000"


def run(args: list[str], tmp_path: Path, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,  # examples must not depend on the working directory
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def example(name: str) -> str:
    return str(ROOT / "examples" / name)


def test_demo_script(tmp_path):
    out = run(
        [
            example("demo.py"),
            "--max_steps=10",
            "--warmup_steps=2",
            "--ramp_steps=4",
            "--every_n_steps=1",
            "--val_every=5",
            "--val_windows=32",
            "--speed_reps=3",
            SMALL_DATA,
            f"--output_dir={tmp_path / 'out'}",
        ],
        tmp_path,
    )
    assert "dense, 10 steps without pruning" in out
    assert "pruned, same steps" in out
    for layer in range(4):  # 50% of 512 MLP channels and of 2 KV groups, in every layer
        assert f"layer {layer}: MLP channels  256/512  KV groups 1/2  (query heads 2/4)" in out
    png = tmp_path / "out" / "demo_training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in out


def test_prune_single_device_example(tmp_path):
    out = run(
        [example("prune_single_device.py"), "--max_steps=8", "--warmup_steps=2", "--ramp_steps=3", SMALL_DATA],
        tmp_path,
    )
    assert "steps: 8" in out
    assert "unit sparsity: 0.500" in out
    assert "mlp.1    dropped 128 units" in out
    assert "heads.1  dropped   1 units" in out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp2_example_takes_sharded_path(tmp_path):
    # Lightning's own launcher starts the second rank by re-running this script (not pytest)
    out = run([example("fsdp2_prune.py"), "--max_steps=6", "--warmup_steps=1", "--ramp_steps=3", SMALL_DATA], tmp_path)
    assert "ranks: 2   steps: 6" in out
    assert "routes: {'mlp.0': 'sharded', 'mlp.1': 'sharded', 'heads.0': 'sharded', 'heads.1': 'sharded'}" in out
    assert "unit sparsity: 0.500" in out


def cli(tmp_path: Path, *args: str) -> str:
    return run(["-m", "lightning_pat.cli", *args], tmp_path)


def tiny_fit_args(tmp_path: Path, config: str) -> list[str]:
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", ["demo.yaml", "demo_explicit.yaml", "llama.yaml", "fsdp2.yaml"])
def test_cli_config(tmp_path, config):
    out = cli(tmp_path, *tiny_fit_args(tmp_path, config))
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out
    assert "pruning/unit_sparsity=0.500" in out  # the step progress bar shows the sparsity
    assert "Epoch" not in out  # ... and no epoch counter
    if config == "fsdp2.yaml":
        assert out.count("sharded (") >= 8  # every cluster routed to the sharded path
    assert (tmp_path / "config.yaml").is_file()  # LightningCLI saved the run's config next to the logs


def test_cli_help_lists_the_callback_options(tmp_path):
    out = cli(tmp_path, "fit", "--help")
    for option in ("target_sparsity", "warmup_steps", "ramp_steps", "every_n_steps", "preset_options", "executor"):
        assert f"\n  {option} " in out
    assert "Optimizer steps of dense training before pruning starts." in out  # from the docstring
    top = cli(tmp_path, "--help")
    assert "lightning-pat shrink --help" in top
    assert "{fit,validate,test,predict}" in top
    shrink = cli(tmp_path, "shrink", "--help")
    assert "--ckpt_path" in shrink
    assert "--output" in shrink


def test_console_script_is_declared():
    import re

    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    module, _, func = re.search(r'^lightning-pat = "(.*)"$', scripts, re.M).group(1).partition(":")
    assert module == "lightning_pat.cli"
    assert func == "main"
    from lightning_pat import cli as cli_module

    assert callable(getattr(cli_module, func))
