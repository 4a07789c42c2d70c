"""Examples, LightningCLI configs and the ``lightning-pat`` command run as tests, with tiny step counts."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # subprocesses; slow only on a busy CPU
SMALL_DATA = "--max_bytes=100000"


def run(args: list[str], tmp_path: Path, **env: str) -> str:
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
    return str(ROOT / "examples" / name)


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


@pytest.fixture(scope="module")
def demo_chain(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, list[str]]:
    """ONE tiny `demo.yaml` fit, run as `lightning-pat fit ... && lightning-pat shrink ... && echo CHAIN-OK` in a shell.

    Shared by the chain test (which asserts on the chain), ``test_cli_config[demo.yaml]`` (on the fit's output) and
    ``test_cli_shrink_checkpoint`` (on its checkpoint): one fit process instead of three. Returns the run's folder,
    the shell's result and the shrink command.
    """
    tmp = tmp_path_factory.mktemp("demo_chain")
    exe = console_script()
    ckpt = tmp / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    fit = shlex.join([exe, *tiny_fit_args(tmp, "demo.yaml")])
    shrink = [exe, "shrink", f"--ckpt_path={ckpt}", f"--output={tmp / 'small'}"]
    return tmp, shell(f"{fit} && {shlex.join(shrink)} && echo CHAIN-OK", tmp), shrink


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> tuple[Path, str]:
    """ONE tiny `fsdp2.yaml` fit (2 gloo ranks) through `python -m lightning_pat.cli`, shared by
    ``test_cli_config[fsdp2.yaml]`` and ``test_cli_shrink_model_parallel_distributed_checkpoint``."""
    tmp = tmp_path_factory.mktemp("fsdp2_run")
    return tmp, cli(tmp, *tiny_fit_args(tmp, "fsdp2.yaml"))


@pytest.mark.parametrize("config", ["demo.yaml", "demo_explicit.yaml", "llama.yaml", "fsdp2.yaml"])
def test_cli_config(tmp_path, config, request):
    if config == "demo.yaml":  # the shared run (through the console script, in a shell chain)
        tmp_path, proc, _ = request.getfixturevalue("demo_chain")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout + proc.stderr
    elif config == "fsdp2.yaml":  # the shared run
        tmp_path, out = request.getfixturevalue("fsdp2_run")
    else:
        out = cli(tmp_path, *tiny_fit_args(tmp_path, config))
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out
    assert "pruning/unit_sparsity=0.500" in out  # the step progress bar shows the sparsity
    assert "Epoch" not in out  # ... and no epoch counter
    if config == "fsdp2.yaml":
        assert out.count("sharded (") >= 8  # every cluster routed to the sharded path
    assert list(tmp_path.glob("**/version_0/config.yaml"))  # LightningCLI saved the run's config next to the logs


def test_cli_help_lists_the_callback_options(capsys):
    from lightning_pat.cli import main

    def help_of(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--help"])
        assert exit_info.value.code == 0
        return capsys.readouterr().out

    out = help_of("fit")
    for option in ("target_sparsity", "warmup_steps", "ramp_steps", "every_n_steps", "preset_options", "executor"):
        assert f"\n  {option} " in out
    assert "Optimizer steps of dense training before pruning starts." in out  # from the docstring
    assert "Distill from the dense model during the ramp and healing" in out  # PruningOptions' Args: every option
    per_option = help_of("fit", "--trainer.callbacks.help", "lightning_pat.CoupledPruningCallback")
    flat = " ".join(per_option.split())  # jsonargparse wraps the help text
    for option, help_text in (
        ("warmup_steps", "Optimizer steps of dense training before pruning starts."),
        ("distill_temperature", "The softmax temperature"),
        ("target_layers", "how many layers to keep"),
    ):
        assert f"--trainer.callbacks.{option} " in per_option
        assert help_text in flat, option  # jsonargparse read it from the docstring PruningOptions documents
    top = help_of()
    assert "lightning-pat shrink --help" in top
    assert "{fit,validate,test,predict,shrink}" in top  # shrink is a subcommand like the others
    shrink = help_of("shrink")
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


def console_script() -> str:
    """The installed `lightning-pat` console script (next to this interpreter, else on PATH)."""
    found = Path(sys.executable).parent / "lightning-pat"
    path = str(found) if found.is_file() else shutil.which("lightning-pat")
    assert path, "the lightning-pat console script is not installed (pip install -e .)"
    return path


def shell(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_console_script_fit_and_shrink_chain_in_a_shell(demo_chain, tmp_path):
    """`lightning-pat fit ... && lightning-pat shrink ...`: exit 0 on success, one-line errors with exit 1."""
    run_root, proc, shrink = demo_chain  # the chain itself ran once, in the module's shared fixture
    exe = console_script()
    ckpt = run_root / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "CHAIN-OK"
    assert "PatCLI object" not in proc.stdout + proc.stderr
    assert (run_root / "small" / "model.safetensors").is_file()
    # the same shrink again: the output is not empty -> one line, exit 1; --overwrite replaces it
    again = shell(shlex.join(shrink), tmp_path)
    assert again.returncode == 1
    assert "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1].startswith("lightning-pat shrink: error: save_pretrained: ")
    assert "is not empty" in again.stderr
    assert "--overwrite" in again.stderr
    assert shell(shlex.join([*shrink, "--overwrite"]), tmp_path).returncode == 0
    # a truncated checkpoint: one line naming it, exit 1, no traceback
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    proc = shell(shlex.join([exe, "shrink", f"--ckpt_path={bad}", f"--output={tmp_path / 'bad'}"]), tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"lightning-pat shrink: error: cannot read checkpoint {bad}: not a torch checkpoint or trunc"
    )
    assert not (tmp_path / "bad").exists()


def test_console_script_resumes_a_file_stored_teacher_and_refuses_a_modified_file(tmp_path):
    """`lightning-pat fit` with `distill_teacher_store=file`, then `--ckpt_path` resumes; a modified file stops it."""
    exe = console_script()
    ckpts = tmp_path / "runs" / "demo" / "version_0" / "checkpoints"
    base = [exe, *tiny_fit_args(tmp_path, "demo.yaml")]
    options = [
        "--trainer.callbacks.init_args.warmup_steps=1",  # the teacher is taken before step 2 ...
        "--trainer.callbacks.init_args.distill_alpha=0.5",
        "--trainer.callbacks.init_args.distill_teacher_store=file",
    ]
    first = shell(shlex.join([*base, *options, "--trainer.max_steps=3"]), tmp_path)  # ... and saved after it
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (teacher,) = ckpts.glob("pat-teacher-*.safetensors")
    saved = torch.load(ckpts / "last.ckpt", weights_only=True)
    (state,) = (v for k, v in saved["callbacks"].items() if k.startswith("CoupledPruningCallback"))
    assert [f["name"] for f in state["distill"]["teacher"]["files"]] == [teacher.name]
    resume = [*base, *options, "--trainer.max_steps=5", f"--ckpt_path={ckpts / 'last.ckpt'}"]
    second = shell(shlex.join(resume), tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=5` reached." in second.stdout + second.stderr
    assert list(ckpts.glob("pat-teacher-*.safetensors")) == [teacher]  # the resumed run wrote no second file
    data = bytearray(teacher.read_bytes())
    data[-1] ^= 0xFF
    teacher.write_bytes(bytes(data))
    refused = shell(shlex.join(resume), tmp_path)
    assert refused.returncode != 0
    assert "distill_teacher_store='file'" in refused.stderr
    assert "does not hold the teacher this checkpoint was written with" in refused.stderr
    assert "`Trainer.fit` stopped" not in refused.stdout + refused.stderr


@pytest.mark.parametrize("where", ["command-line", "config-file"])
def test_callback_option_typo_names_the_fix_first(tmp_path, where):
    config = ROOT / "examples" / "configs" / "demo.yaml"
    args = [console_script(), "fit"]
    if where == "config-file":
        typo = tmp_path / "typo.yaml"
        typo.write_text(config.read_text().replace("target_sparsity:", "target_sparsty:"))
        args += [f"--config={typo}"]
    else:
        args += [f"--config={config}", "--trainer.callbacks.init_args.target_sparsty=0.5"]
    proc = shell(shlex.join(args), tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors[0] == (
        "error: trainer.callbacks: `target_sparsty` is not an option of lightning_pat.CoupledPruningCallback; "
        "did you mean `target_sparsity`?"
    )
    assert "usage:" not in proc.stderr  # not buried under 60 lines of usage


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
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"dense", "pruned", "ratio"} <= set(rows)
    ratio = float(rows["ratio"].split("|")[2])
    assert ratio <= 0.8
    assert out.count("  dense:  ") == out.count("  pruned: ") == 2
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in reloaded.parameters()) == int(rows["pruned"].split("|")[2].replace(",", ""))


def _masked_and_shrunk(run_dir: Path, ckpt: dict, export: Path):
    from lightning_pat import load_pretrained
    from lightning_pat.cli import model_from_config

    module = model_from_config(run_dir / "config.yaml")
    module.load_state_dict(ckpt["state_dict"])
    masked = module.model.eval()
    small = load_pretrained(export).eval()
    return masked, small


def _assert_same_outputs(masked, small):
    import torch

    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = masked(x), small(x)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), float((a - b).abs().max())


def test_cli_shrink_checkpoint(demo_chain, tmp_path, monkeypatch):
    import torch

    from lightning_pat import load_pretrained
    from lightning_pat.cli import main

    run_root, fit, _ = demo_chain  # the module's one demo.yaml fit (its checkpoint is only read here)
    assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
    run_dir = run_root / "runs" / "demo" / "version_0"
    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    val = cli(tmp_path, "validate", f"--config={run_dir / 'config.yaml'}", f"--ckpt_path={ckpt_path}")
    assert "val_loss" in val
    out = cli(tmp_path, "shrink", f"--ckpt_path={ckpt_path}", f"--output={tmp_path / 'small'}")
    assert f"shrunk model written to {tmp_path / 'small'}" in out
    masked, small = _masked_and_shrunk(run_dir, torch.load(ckpt_path, weights_only=False), tmp_path / "small")
    assert small.layers[0].mlp.gate_proj.out_features == 256  # half of 512
    assert small.layers[0].attn.k_proj.out_features == 32  # one of two KV heads of 32
    assert sum(p.numel() for p in small.parameters()) < 0.6 * sum(p.numel() for p in masked.parameters())
    _assert_same_outputs(masked, small)
    # without config.yaml: the class path LightningCLI records in the hyperparameters, or an explicit class
    # (`lightning_pat.cli:main`, what the console script runs, in this process; relative --output from the cwd)
    alone = tmp_path / "alone" / "last.ckpt"
    alone.parent.mkdir()
    alone.write_bytes(ckpt_path.read_bytes())
    monkeypatch.chdir(tmp_path)
    for name, extra in (("auto", []), ("explicit", ["--model_class=lightning_pat.demo.TinyGPTModule"])):
        assert main(["shrink", f"--ckpt_path={alone}", f"--output={name}", *extra]) == 0
        _assert_same_outputs(masked, load_pretrained(tmp_path / name))
    # a checkpoint from before the final ramp step, carrying a distributed checkpoint's latent keys: the latent keys
    # are not model weights (dropped), and the shrink says that the mask was not final yet
    from lightning_pat.cli import shrink_checkpoint
    from lightning_pat.training.state import DCP_PREFIX

    ckpt = torch.load(ckpt_path, weights_only=False)
    (key,) = [k for k in ckpt["callbacks"] if k.startswith("CoupledPruningCallback")]
    ckpt["callbacks"][key]["step"] = 1  # the run's ramp ends at step 2
    ckpt["state_dict"][DCP_PREFIX + "model.layers.0.mlp.up_proj.weight"] = torch.zeros(1)
    early = run_dir / "checkpoints" / "early.ckpt"
    torch.save(ckpt, early)
    with pytest.warns(UserWarning, match="before the final ramp step 2"):
        shrink_checkpoint(early, tmp_path / "early")
    _assert_same_outputs(masked, load_pretrained(tmp_path / "early"))


def test_cli_shrink_checkpoint_written_after_shrink_on_freeze(tmp_path):
    """After `shrink_on_freeze=True` the checkpoint holds the small weights: shrink restores shapes, then exports."""
    import torch

    from lightning_pat import load_pretrained
    from lightning_pat.cli import main, model_from_config
    from lightning_pat.shrink import restore_shrunk

    args = tiny_fit_args(tmp_path, "demo.yaml")
    args = [a.replace("--trainer.max_steps=2", "--trainer.max_steps=3") for a in args]
    cli(tmp_path, *args, "--trainer.callbacks.init_args.shrink_on_freeze=true")
    run_dir = tmp_path / "runs" / "demo" / "version_0"
    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["state_dict"]["model.layers.0.mlp.gate_proj.weight"].shape[0] == 256  # saved small
    # the shrink through `lightning_pat.cli:main` (what the console script runs) in this process: one launch fewer
    assert main(["shrink", f"--ckpt_path={ckpt_path}", f"--output={tmp_path / 'small'}"]) == 0
    reference = model_from_config(run_dir / "config.yaml")  # independent: restore shapes, load, no shrink call
    assert restore_shrunk(reference, ckpt)
    reference.load_state_dict(ckpt["state_dict"])
    small = load_pretrained(tmp_path / "small").eval()
    assert small.layers[0].mlp.gate_proj.out_features == 256
    _assert_same_outputs(reference.model.eval(), small)


@pytest.mark.distributed
def test_cli_shrink_model_parallel_distributed_checkpoint(fsdp2_run, tmp_path):
    """A ModelParallelStrategy (FSDP2, 2 gloo processes) run writes a sharded checkpoint directory; shrink reads it."""
    import torch

    from lightning_pat.cli import load_checkpoint, main

    run_root, _ = fsdp2_run  # the module's one fsdp2.yaml fit (test_cli_config[fsdp2.yaml] asserts on its output)
    (ckpt_path,) = run_root.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert ckpt_path.is_dir()  # a distributed checkpoint: one shard file per rank plus meta.pt
    # the shrink through `lightning_pat.cli:main` (what the console script runs) in this process: one launch fewer
    assert main(["shrink", f"--ckpt_path={ckpt_path}", f"--output={tmp_path / 'small'}"]) == 0
    masked, small = _masked_and_shrunk(ckpt_path.parents[1], load_checkpoint(ckpt_path), tmp_path / "small")
    assert not list(run_root.rglob("*.consolidated.pt"))  # read in memory: nothing written next to the checkpoint
    assert not list(tmp_path.rglob("*.consolidated.pt"))
    assert sorted(p.name for p in ckpt_path.parent.iterdir()) == [ckpt_path.name]
    assert small.layers[0].mlp.gate_proj.out_features == 256
    _assert_same_outputs(masked, small)
    assert isinstance(masked.layers[0].mlp.gate_proj.weight, torch.nn.Parameter)
