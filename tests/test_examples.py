"""Examples, LightningCLI configs and notebooks run as tests, with tiny step counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def run(args: list[str], tmp_path: Path, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_demo_script(tmp_path):
    out = run(["examples/demo.py", "--max_steps=8", "--warmup_steps=1", "--ramp_steps=4"], tmp_path)
    assert "unit sparsity: 0.500" in out
    assert "mlp.0" in out
    assert "heads.0" in out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp2_example_takes_sharded_path(tmp_path):
    # Lightning's own launcher starts the second rank by re-running this script (not pytest)
    out = run(["examples/fsdp2_prune.py", "--max_steps=6", "--warmup_steps=1", "--ramp_steps=3"], tmp_path)
    assert "ranks: 2   steps: 6" in out
    assert "routes: {'mlp.0': 'sharded', 'mlp.1': 'sharded', 'heads.0': 'sharded', 'heads.1': 'sharded'}" in out
    assert "unit sparsity: 0.500" in out


@pytest.mark.parametrize("config", ["demo.yaml", "demo_explicit.yaml"])
def test_cli_yaml(tmp_path, config):
    out = run(
        [
            "-m",
            "lightning_pat.cli",
            "fit",
            f"--config=examples/config/{config}",
            "--trainer.max_steps=6",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks.init_args.warmup_steps=1",
            "--trainer.callbacks.init_args.ramp_steps=3",
            "--trainer.callbacks.init_args.every_n_steps=1",
        ],
        tmp_path,
    )
    assert "routes" in out
    assert "mlp.1" in out


def test_quickstart_notebook(tmp_path):
    out = run(["notebooks/quickstart.py"], tmp_path, LPAT_NOTEBOOK_STEPS="8")
    assert "'pruning/unit_sparsity': 0.5" in out


def test_readme_trainer_example_declares_real_clusters():
    """The README's Trainer example is true: its declaration resolves on a real model (the demo's TinyGPT)."""
    import re

    from examples.demo import TinyGPTModule
    from lightning_pat import Cluster, resolve_clusters

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Use it from a Trainer\n\n```python\n(.*?)```", readme, re.S)
    assert code is not None, "README lost its Trainer example"
    head = code.group(1).split("pruning = ")[0]  # imports and the declaration; the rest needs a model and data
    namespace: dict = {}
    exec(head, namespace)  # noqa: S102 - our own README
    mlp = namespace["mlp"]
    assert isinstance(mlp, Cluster)
    resolved = resolve_clusters(TinyGPTModule(), [mlp])
    assert [rc.name for rc in resolved] == ["mlp.0", "mlp.1"]
    assert all(rc.num_units == 256 and len(rc.members) == 3 for rc in resolved)
