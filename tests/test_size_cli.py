"""``target_params`` and layer units through the installed ``lightning-pat`` console script (or the ``main`` it runs,
in this process): fit, then shrink.

Reference: the shrunk export's own parameter count and layer count, against the achieved count the fit logged.
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


def run(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(SCRIPT), *args], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_console_script_fits_to_a_size_with_layer_units_and_shrinks(tmp_path, capfd, monkeypatch):
    from lightning_pat import load_pretrained

    out = run(
        tmp_path, "fit", f"--config={ROOT / 'examples' / 'configs' / 'demo.yaml'}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks.init_args.warmup_steps=0", "--trainer.callbacks.init_args.ramp_steps=2",
        "--trainer.callbacks.init_args.target_params=60%",
        "--trainer.callbacks.init_args.preset_options={layers: true}",
        # fractions balance depth and widths, so layers go (by importance a layer costs its whole update: widths go)
        "--trainer.callbacks.init_args.target_allocation=fractions",
        "--data.max_bytes=50000", "--data.batch_size=4",
    )  # fmt: skip
    assert "allocated by fractions" in out, out[-2000:]
    match = re.search(r"target_params: ([\d,]+) parameters \(target ([\d,]+), full ([\d,]+)", out)
    assert match, out[-2000:]
    achieved, target, full = (int(g.replace(",", "")) for g in match.groups())
    assert achieved <= target == round(0.6 * full)
    ckpt = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    # the shrink through `lightning_pat.cli:main` (what the script runs) in this process: one launch fewer
    code, shrunk = in_process(
        capfd, monkeypatch, tmp_path, "shrink", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'small'}"
    )
    assert code == 0, shrunk[-3000:]
    small = load_pretrained(tmp_path / "small")
    assert sum(p.numel() for p in small.parameters()) == achieved
    assert len(small.layers) < 4  # demo.yaml's n_layer: layers went, not only widths


def test_console_script_fits_ranked_widths_and_shrinks(tmp_path, capfd, monkeypatch):
    """target_widths=ranked from the command line: the export has per-layer widths summing to the solved total.

    Through `lightning_pat.cli:main` (what the console script runs) in this process: the test above launches it.
    """
    from lightning_pat import load_pretrained

    code, out = in_process(
        capfd, monkeypatch, tmp_path, "fit",
        f"--config={ROOT / 'examples' / 'configs' / 'demo.yaml'}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks.init_args.warmup_steps=0", "--trainer.callbacks.init_args.ramp_steps=2",
        "--trainer.callbacks.init_args.target_params=60%", "--trainer.callbacks.init_args.target_widths=ranked",
        "--trainer.callbacks.init_args.min_kept=0.5", "--data.max_bytes=50000", "--data.batch_size=4",
    )  # fmt: skip
    assert code == 0, out[-3000:]
    match = re.search(r"target_params: ([\d,]+) parameters .*kept: mlp=(\d+)", out)
    assert match, out[-2000:]
    achieved, mlp = int(match[1].replace(",", "")), int(match[2])
    ckpt = tmp_path / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    code, shrunk = in_process(
        capfd, monkeypatch, tmp_path, "shrink", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'small'}"
    )
    assert code == 0, shrunk[-3000:]
    small = load_pretrained(tmp_path / "small")
    assert sum(p.numel() for p in small.parameters()) == achieved
    widths = [layer.mlp.down_proj.in_features for layer in small.layers]
    assert sum(widths) == mlp
    assert min(widths) >= 512 // 2  # demo.yaml's d_ff, min_kept=0.5
