"""``OneShotPruningCallback``: one-shot pruning at the first pruning step, then healing with distillation.

References: the mask and widths are read from the weights themselves (rows of exact zeros), the teacher against a
snapshot of the model taken by an independent callback, each step's gradient against autograd on the blended loss
written out by hand (``assert_blended_gradients`` of test_distill.py), and the recipe against the
``CoupledPruningCallback`` option set it names (same fit, bitwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import CoupledPruningCallback, OneShotPruningCallback
from tests.common.lit_models import HIDDEN, mlp_cluster, quiet_trainer
from tests.integration.test_distill import GradRecorder, StepNet, assert_blended_gradients

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "lightning-pat"
WARMUP, TOTAL = 3, 8


class ZeroRows(pl.Callback):
    """After the pruning callback: the hidden units whose fc1 row and bias are exact zeros, after every step."""

    def __init__(self) -> None:
        self.zeros: dict[int, frozenset[int]] = {}
        self.snapshot: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w, b = pl_module.fc1.weight.detach(), pl_module.fc1.bias.detach()
        rows = ((w == 0).all(dim=1) & (b == 0)).nonzero().flatten().tolist()
        self.zeros[trainer.global_step] = frozenset(rows)
        if trainer.global_step == WARMUP:  # the model when the pruning step starts: the teacher must be this
            self.snapshot = {k: v.clone() for k, v in pl_module.state_dict().items()}


def fit(cb: CoupledPruningCallback) -> tuple[StepNet, GradRecorder, ZeroRows, pl.Trainer]:
    module, rec, zeros = StepNet(lr=0.2), GradRecorder(), ZeroRows()
    trainer = quiet_trainer(max_steps=TOTAL, callbacks=[rec, cb, zeros], log_every_n_steps=1)
    trainer.fit(module)
    return module, rec, zeros, trainer


def test_prunes_once_to_the_full_target_then_heals_distilling_from_the_dense_model():
    cb = OneShotPruningCallback(mlp_cluster(), 0.5, warmup_steps=WARMUP)
    assert (cb.options.ramp_steps, cb.options.heal, cb.options.score) == (1, True, "auto")
    module, rec, zeros, trainer = fit(cb)
    assert cb.score == "activation"  # "auto" on one device

    # dense through the warmup; at the first pruning step (WARMUP + 1) the full target at once, then held unchanged
    assert all(not zeros.zeros[s] for s in range(1, WARMUP + 1))
    cut = zeros.zeros[WARMUP + 1]
    assert len(cut) == HIDDEN // 2
    assert all(zeros.zeros[s] == cut for s in range(WARMUP + 1, TOTAL + 1))
    assert cut == frozenset(cb.dropped["hidden"])
    assert cb.controller.frozen  # healing: the mask is final

    # the teacher is the dense model as it was when the pruning step started, bitwise, and never updated
    teacher = cb.teacher
    assert teacher is not None
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, zeros.snapshot[name]), name
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())

    # every step from the pruning step on (the cut and all the healing) trains on the blended loss with that teacher
    assert sorted(rec.grads) == list(range(TOTAL))
    assert_blended_gradients(module, rec, teacher, start=WARMUP, alpha=0.5, temperature=1.0)
    assert float(trainer.callback_metrics["pruning/distill_kl"]) > 0  # healing: the pruned student differs


def test_is_exactly_the_option_set_it_names():
    recipe, _, recipe_zeros, _ = fit(OneShotPruningCallback(mlp_cluster(), 0.5, warmup_steps=WARMUP))
    plain_cb = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=WARMUP, ramp_steps=1, score="activation", distill_alpha=0.5
    )
    plain, _, plain_zeros, _ = fit(plain_cb)
    assert recipe_zeros.zeros == plain_zeros.zeros
    for name, value in recipe.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name
    # a checkpoint of the recipe is one of the callback (shrink finds it; either class resumes it)
    assert OneShotPruningCallback(mlp_cluster(), 0.5).state_key == plain_cb.state_key


@pytest.mark.parametrize("stop", [WARMUP, WARMUP + 2], ids=["before-the-cut", "healing"])
def test_a_recipe_checkpoint_resumes_with_the_plain_callback_bitwise(tmp_path, stop):
    module = StepNet(lr=0.2, optimizer="adamw")
    save = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    cb = OneShotPruningCallback(mlp_cluster(), 0.5, warmup_steps=WARMUP)
    quiet_trainer(max_steps=TOTAL, callbacks=[cb, save], checkpointing=True).fit(module)
    resumed = StepNet(lr=0.2, optimizer="adamw", seed=99)
    plain = CoupledPruningCallback(
        mlp_cluster(), 0.5, warmup_steps=WARMUP, ramp_steps=1, score="activation", distill_alpha=0.5
    )
    quiet_trainer(max_steps=TOTAL, callbacks=[plain]).fit(resumed, ckpt_path=str(tmp_path / f"step={stop}.ckpt"))
    for name, tensor in module.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    for name, tensor in cb.teacher.state_dict().items():
        assert torch.equal(plain.teacher.state_dict()[name], tensor), name


RECIPE_CASES = [
    ("recipe-ramp", {"ramp_steps": 10}, r"OneShotPruningCallback fixes ramp_steps=1 .*got ramp_steps=10"),
    ("recipe-no-heal", {"heal": False}, r"OneShotPruningCallback fixes heal=True .*got heal=False"),
    ("recipe-option", {"distill_alpha": 2.0}, r"`distill_alpha` must be a number \[0.0, 1.0\], got 2.0"),
]


@pytest.mark.parametrize(("kwargs", "match"), [c[1:] for c in RECIPE_CASES], ids=[c[0] for c in RECIPE_CASES])
def test_bad_input_names_the_fixed_option(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        OneShotPruningCallback(mlp_cluster(), 0.5, **kwargs)


def test_docs_list_the_recipe_cases():
    page = (ROOT / "docs" / "bad-input.md").read_text()
    missing = [c[0] for c in RECIPE_CASES if f"| `{c[0]}` |" not in page]
    assert not missing, f"docs/bad-input.md's table lacks {missing}"


CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true}
    - class_path: lightning_pat.OneShotPruningCallback
      init_args: {clusters: tiny_gpt, target_sparsity: 0.5, warmup_steps: 2}
model:
  class_path: lightning_pat.demo.TinyGPTModule
  init_args: {n_layer: 2, d_model: 32, d_ff: 64}
data:
  class_path: lightning_pat.demo.StdlibText
  init_args: {max_bytes: 50000, batch_size: 4}
"""


def run(cwd: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(SCRIPT), *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_yaml_recipe_through_the_console_script_fits_prints_its_config_and_shrinks(tmp_path):
    from lightning_pat import load_pretrained

    config = tmp_path / "oneshot.yaml"
    config.write_text(CONFIG)
    printed = run(tmp_path, "fit", f"--config={config}", "--print_config")
    assert "class_path: lightning_pat.OneShotPruningCallback" in printed
    assert "ramp_steps: 1" in printed
    assert "score: auto" in printed
    assert "distill_alpha: 0.5" in printed
    (tmp_path / "printed.yaml").write_text(printed)  # a printed config runs again as it is
    run(tmp_path, "fit", f"--config={tmp_path / 'printed.yaml'}", f"--trainer.default_root_dir={tmp_path}")
    ckpt = next((tmp_path / "lightning_logs").rglob("last.ckpt"))
    run(tmp_path, "shrink", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'small'}")
    small = load_pretrained(tmp_path / "small")
    widths = [layer.mlp.up_proj.out_features for layer in small.layers]
    assert widths == [32, 32]  # half of d_ff=64 in every layer, after 2 warmup steps and one cut
