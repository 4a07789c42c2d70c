"""The `lightning-pat` console script and the LightningCLI configs of `examples/configs` run as tests, tiny steps."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from tests.common.processes import ROOT, cli, console_script, in_process, shell, tiny_fit_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # subprocesses; slow only on a busy CPU


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
def test_cli_config(tmp_path, config, request, capfd, monkeypatch):
    if config == "demo.yaml":  # the shared run (through the console script, in a shell chain)
        tmp_path, proc, _ = request.getfixturevalue("demo_chain")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout + proc.stderr
    elif config == "fsdp2.yaml":  # the shared run
        tmp_path, out = request.getfixturevalue("fsdp2_run")
    else:  # `lightning_pat.cli:main` in this process: the two launches above cover the script and `python -m`
        code, out = in_process(capfd, monkeypatch, tmp_path, *tiny_fit_args(tmp_path, config))
        assert code == 0, out[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out
    assert "pruning/unit_sparsity=0.500" in out  # the step progress bar shows the sparsity
    assert "Epoch" not in out  # ... and no epoch counter
    if config == "fsdp2.yaml":
        routed = re.search(r"routes (\d+) cluster\(s\): all sharded \(", out)  # every cluster: the sharded path
        assert routed is not None, out[-3000:]
        assert int(routed.group(1)) >= 8
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


def test_console_script_fit_and_shrink_chain_in_a_shell(demo_chain, tmp_path, capfd, monkeypatch):
    """`lightning-pat fit ... && lightning-pat shrink ...`: exit 0 on success, one-line errors with exit 1."""
    run_root, proc, shrink = demo_chain  # the chain itself ran once, in the module's shared fixture
    ckpt = run_root / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "CHAIN-OK"
    assert "PatCLI object" not in proc.stdout + proc.stderr
    assert (run_root / "small" / "model.safetensors").is_file()
    # the same shrink again (`lightning_pat.cli:main`, what the script runs, in this process; the chain above
    # proved the script's exit statuses): the output is not empty -> one line, exit 1; --overwrite replaces it
    code, err = in_process(capfd, monkeypatch, tmp_path, *shrink[1:])
    assert code == 1
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("lightning-pat shrink: error: save_pretrained: ")
    assert "is not empty" in err
    assert "--overwrite" in err
    assert in_process(capfd, monkeypatch, tmp_path, *shrink[1:], "--overwrite")[0] == 0
    # a truncated checkpoint: one line naming it, exit 1, no traceback
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    code, err = in_process(capfd, monkeypatch, tmp_path, "shrink", f"--ckpt_path={bad}", f"--output={tmp_path / 'bad'}")
    assert code == 1
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"lightning-pat shrink: error: cannot read checkpoint {bad}: not a torch checkpoint or trunc"
    )
    assert not (tmp_path / "bad").exists()


def test_console_script_resumes_a_file_stored_teacher_and_refuses_a_modified_file(tmp_path, capfd, monkeypatch):
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
    # the refusal through `lightning_pat.cli:main` (what the script runs) in this process: one launch fewer
    code, out = in_process(capfd, monkeypatch, tmp_path, *resume[1:])
    assert code == 1
    assert "distill_teacher_store='file'" in out
    assert "does not hold the teacher this checkpoint was written with" in out
    assert "`Trainer.fit` stopped" not in out


@pytest.mark.parametrize("where", ["command-line", "config-file"])
def test_callback_option_typo_names_the_fix_first(tmp_path, where, capfd, monkeypatch):
    config = ROOT / "examples" / "configs" / "demo.yaml"
    args = [console_script(), "fit"]
    if where == "config-file":
        typo = tmp_path / "typo.yaml"
        typo.write_text(config.read_text().replace("target_sparsity:", "target_sparsty:"))
        args += [f"--config={typo}"]
    else:
        args += [f"--config={config}", "--trainer.callbacks.init_args.target_sparsty=0.5"]
    if where == "command-line":  # the installed script's exit status, once
        proc = shell(shlex.join(args), tmp_path)
        code, err = proc.returncode, proc.stderr
    else:  # `lightning_pat.cli:main` (what the script runs) in this process: one launch fewer
        code, err = in_process(capfd, monkeypatch, tmp_path, *args[1:])
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors[0] == (
        "error: trainer.callbacks: `target_sparsty` is not an option of lightning_pat.CoupledPruningCallback; "
        "did you mean `target_sparsity`?"
    )
    assert "usage:" not in err  # not buried under 60 lines of usage


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


def test_cli_shrink_checkpoint(demo_chain, tmp_path, monkeypatch, capfd):
    import torch

    from lightning_pat import load_pretrained
    from lightning_pat.cli import main

    run_root, fit, _ = demo_chain  # the module's one demo.yaml fit (its checkpoint is only read here)
    assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
    run_dir = run_root / "runs" / "demo" / "version_0"
    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    # `lightning_pat.cli:main` (what the console script runs) in this process: the chain launched the script
    code, val = in_process(capfd, monkeypatch, tmp_path, "validate", f"--config={run_dir / 'config.yaml'}",
                           f"--ckpt_path={ckpt_path}")  # fmt: skip
    assert code == 0, val[-3000:]
    assert "val_loss" in val
    code, out = in_process(capfd, monkeypatch, tmp_path, "shrink", f"--ckpt_path={ckpt_path}",
                           f"--output={tmp_path / 'small'}")  # fmt: skip
    assert code == 0, out[-3000:]
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


def test_cli_shrink_checkpoint_written_after_shrink_on_freeze(tmp_path, capfd, monkeypatch):
    """After `shrink_on_freeze=True` the checkpoint holds the small weights: shrink restores shapes, then exports."""
    import torch

    from lightning_pat import load_pretrained
    from lightning_pat.cli import main, model_from_config
    from lightning_pat.shrink import restore_shrunk

    args = tiny_fit_args(tmp_path, "demo.yaml")
    args = [a.replace("--trainer.max_steps=2", "--trainer.max_steps=3") for a in args]
    code, out = in_process(capfd, monkeypatch, tmp_path, *args, "--trainer.callbacks.init_args.shrink_on_freeze=true")
    assert code == 0, out[-3000:]
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
