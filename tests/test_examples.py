"""The example scripts run as tests, with tiny step counts (the console script and configs: test_console_script.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.processes import SMALL_DATA, example, run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # subprocesses; slow only on a busy CPU


def test_demo_script(tmp_path):
    out = run(
        [
            example("demo.py"),
            "--max_steps=8",
            "--warmup_steps=2",
            "--ramp_steps=4",
            "--every_n_steps=1",
            "--val_every=4",
            "--val_windows=16",
            "--batch_size=8",
            "--speed_reps=2",
            SMALL_DATA,
            f"--output_dir={tmp_path / 'out'}",
        ],
        tmp_path,
    )
    assert "dense, 8 steps without pruning" in out
    assert "torch CPU threads: " in out  # chosen so that they cannot oversubscribe the CPUs, and said
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
def test_fsdp2_example_takes_sharded_path(tmp_path):
    # Lightning's own launcher starts the second rank by re-running this script (not pytest)
    out = run([example("fsdp2_prune.py"), "--max_steps=6", "--warmup_steps=1", "--ramp_steps=3", SMALL_DATA], tmp_path)
    assert "ranks: 2   steps: 6" in out
    assert "routes: {'mlp.0': 'sharded', 'mlp.1': 'sharded', 'heads.0': 'sharded', 'heads.1': 'sharded'}" in out
    assert "unit sparsity: 0.500" in out


def test_llama_example_shrinks_and_reloads_with_stock_transformers(tmp_path):
    out = run(
        [
            example("llama_from_config.py"),
            "--max_steps=6",
            "--warmup_steps=1",
            "--ramp_steps=3",
            SMALL_DATA,
            f"--output_dir={tmp_path / 'llama'}",
        ],
        tmp_path,
    )
    assert "shrunk: intermediate_size 256, heads 4, kv heads 2" in out
    diff = float(out.split("max |logits - masked logits| = ")[1].split()[0])
    assert diff < 1e-4
    assert '"intermediate_size": 256' in (tmp_path / "llama" / "config.json").read_text()


def test_mlp_digits_example(tmp_path):
    out = run([example("mlp_digits.py"), "--max_steps=30", "--warmup_steps=5", "--ramp_steps=10"], tmp_path)
    assert "hidden widths [64, 64]" in out  # 75% of 256 hidden units cut out of both layers
    assert "shrunk predictions identical to the pruned network's: True" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    acc = {row[0]: float(row[1]) for row in rows if row and row[0] in ("dense", "pruned", "shrunk")}
    assert acc["pruned"] == acc["shrunk"]
    assert acc["dense"] > 0.5  # it learned something in 30 steps (10 classes: chance is 0.1)


def test_cnn_digits_example_discovers_prunes_and_shrinks(tmp_path):
    out = run(
        [example("cnn_digits.py"), "--max_steps=30", "--warmup_steps=5", "--ramp_steps=10", "--speed_reps=2"],
        tmp_path,
    )
    assert "clusters (auto, discovered): ['net.stem', 'net.conv1', 'net.fc1']" in out
    assert "| net.fc2 | 10 |" in out
    assert "left out: reaches the model's output" in out
    assert "widths [32, 32, 128]" in out  # 50% of every discovered cluster cut out
    assert float(out.split("max |logits diff| = ")[1].split()[0]) < 1e-4
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    acc = {row[0]: float(row[1]) for row in rows if row and row[0] in ("dense", "pruned", "shrunk")}
    assert acc["pruned"] == acc["shrunk"]
    assert acc["dense"] > 0.5  # it learned something in 30 steps (10 classes: chance is 0.1)
    params = [int(row[-2].replace(",", "")) for row in rows if row and row[0] in ("dense", "shrunk")]
    assert params[1] < params[0] / 3
    assert "forward, batch 256, CPU" in out


def test_prune_pretrained_example(tmp_path):
    out = run([example("prune_pretrained.py"), "--max_steps=6", "--ramp_steps=3", SMALL_DATA], tmp_path)
    assert "fine-tuned 6 steps while pruning" in out
    assert float(out.split("max |logits diff| = ")[1].split()[0]) < 1e-4
    saved = out.split("\nsaved ")[1].split(" (")[0]
    assert (Path(saved) / "config.json").is_file()


@pytest.mark.parametrize("steps", [0, 3])
def test_prune_smollm2_example_on_a_tiny_lm(tmp_path, steps):
    """The SmolLM2 example's steps on a tiny stand-in directory (the real model runs in tests/integration/)."""
    from tests.common.tiny_lm import tiny_lm_dir

    lm = tiny_lm_dir(tmp_path)
    out = run(
        [example("prune_smollm2.py"), f"--pretrained={lm}", "--size=0.8", f"--max_steps={steps}", "--warmup_steps=1",
         "--seq_len=16", "--calibration_batches=2", "--val_windows=2", "--train_chars=20000", "--new_tokens=3",
         f"--output={tmp_path / 'out'}"],
        tmp_path, LIGHTNING_PAT_CACHE=str(tmp_path / "cache"),
    )  # fmt: skip
    assert "allocated by importance" in out
    assert "torch CPU threads: " in out
    for step in ("the dense model: held-out loss", "sizing to 0.8", "the pruned model"):  # no silent minutes
        assert step in out
    assert "Epoch 0/-2" not in out  # the bar counts steps (StepProgressBar)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"dense", "pruned", "ratio"} <= set(rows)
    ratio = float(rows["ratio"].split("|")[2])
    assert ratio <= 0.8
    assert out.count("  dense:  ") == out.count("  pruned: ") == 2
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in reloaded.parameters()) == int(rows["pruned"].split("|")[2].replace(",", ""))
