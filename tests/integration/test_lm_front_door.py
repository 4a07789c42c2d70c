"""The pretrained-LM front door on a tiny LM directory: :class:`TextFiles`, :class:`CausalLM` with the pruning callback
and its export, and the YAML config through the installed ``lightning-pat`` console script.

References: the split rule written here (index 5 modulo 10), the export reloaded with stock ``from_pretrained``
(logits equal to the trained model's), the callback's own size count, and the exit status of the console script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_pat import CoupledPruningCallback
from lightning_pat.lm import CausalLM, TextFiles
from lightning_pat.lm import data as lm_data
from tests.common.tiny_lm import code_files, tiny_lm_dir

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "lightning-pat"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return tiny_lm_dir(tmp_path_factory.mktemp("lm"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def small_data(files: list[str], **kw) -> TextFiles:
    return TextFiles(files=files, seq_len=16, batch_size=2, val_windows=4, train_windows=64, **kw)


# ---------------------------------------------------------------------------------------------------- TextFiles
def test_text_files_hold_out_whole_files_and_cache_their_tokens(tmp_path, cache, lm_dir):
    from transformers import AutoTokenizer

    files = code_files(tmp_path / "texts", n=20)
    data = small_data(files, tokenizer=str(lm_dir))
    train, held = lm_data.split_by_file(data.paths())
    assert [str(p) for p in held] == files[5::10]  # index 5 modulo 10, as bench/ and the demo hold out
    assert not set(train) & set(held)
    data.setup()
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (2, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    code, english = data.val_dataloader()
    assert len(code.dataset) == len(english.dataset) == 4
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    held_text = "\n".join(Path(p).read_text() for p in files[5::10])
    assert torch.equal(code.dataset.tokens, torch.tensor(tokenizer(held_text)["input_ids"]))
    cached = sorted((cache / "tokens").glob("*.safetensors"))
    assert len(cached) == 3  # train, held-out code, held-out English
    again = small_data(files, tokenizer=tokenizer)
    again.setup()
    assert torch.equal(again.val[0].stacked(), data.val[0].stacked())
    assert sorted((cache / "tokens").glob("*.safetensors")) == cached  # read, not written again


def test_text_files_refuse_bad_options_and_a_missing_tokenizer(tmp_path, cache):
    with pytest.raises(ValueError, match=r"`holdout_every` must be an int >= 2"):
        TextFiles(holdout_every=1)
    with pytest.raises(ValueError, match=r"`seq_len` must be a positive int, got 0"):
        TextFiles(seq_len=0)
    with pytest.raises(ValueError, match=r"`files` entry .*nothing\*\.txt.* names no file"):
        TextFiles(files=[str(tmp_path / "nothing*.txt")]).paths()
    with pytest.raises(ValueError, match=r"no tokenizer: pass `tokenizer=`"):
        TextFiles(files=code_files(tmp_path / "t", n=20)).setup()
    with pytest.raises(ValueError, match=r"give at least 6 files \(file 5 of every `holdout_every`=10 is held out\)"):
        TextFiles(files=code_files(tmp_path / "few", n=3), tokenizer=object()).setup()


# ---------------------------------------------------------------------------------------------------- CausalLM
def fit(lm_dir: Path, files: list[str], export: Path, *, max_steps: int = 8, overwrite: bool = False):
    module = CausalLM(str(lm_dir), lr=1e-3, warmup_steps=2, export=str(export), export_overwrite=overwrite)
    pruning = CoupledPruningCallback(
        "llama", target_params=0.8, preset_options={"query_heads": True}, warmup_steps=2, ramp_steps=2,
        distill_alpha=0.5, shrink_on_freeze=True,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=max_steps, limit_val_batches=2,
        callbacks=[pruning],
    )  # fmt: skip
    trainer.fit(module, datamodule=small_data(files))
    return module, pruning, trainer


def test_causal_lm_prunes_heals_and_exports_a_stock_model_with_its_tokenizer(tmp_path, cache, lm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = code_files(tmp_path / "texts", n=20)
    export = tmp_path / "export"
    module, pruning, trainer = fit(lm_dir, files, export)
    assert module.tokenizer is not None
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_loss_english"} <= set(metrics)
    assert all(torch.isfinite(metrics[k]) for k in ("val_loss", "val_loss_english"))
    heads = [v for k, v in pruning.dropped.items() if k.startswith("heads")]
    assert heads
    assert all(len(v) % 2 == 0 for v in heads)
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert sum(p.numel() for p in reloaded.parameters()) == pruning.size.achieved
    assert reloaded.config.num_key_value_heads == 2
    ids = tokenizer("def f(x):\n", return_tensors="pt").input_ids
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, module.model(ids).logits, rtol=1e-5, atol=1e-5)
    out = reloaded.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 4)
    # a second fit into the same directory: refused before any step without export_overwrite, replaced with it
    with pytest.raises(FileExistsError, match=r"not empty"):
        fit(lm_dir, files, export)
    fit(lm_dir, files, export, max_steps=6, overwrite=True)
    assert (export / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_yaml_config_runs_through_the_console_script(tmp_path, cache, lm_dir):
    code_files(tmp_path / "texts", n=20)  # C2: passed below as one glob string (not a list), as a YAML user writes it
    export = tmp_path / "export"
    proc = subprocess.run(
        [str(SCRIPT), "fit", "--config", str(ROOT / "examples/configs/smollm2.yaml"),
         f"--model.init_args.pretrained={lm_dir}", f"--model.init_args.export={export}",
         f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.max_steps=8", "--trainer.val_check_interval=8",
         "--trainer.limit_val_batches=1", "--trainer.callbacks.init_args.target_params=0.8",
         "--trainer.callbacks.init_args.warmup_steps=2", "--trainer.callbacks.init_args.ramp_steps=2",
         f"--data.init_args.files={tmp_path / 'texts'}/*.py", "--data.init_args.seq_len=16",  # one glob string
         "--data.init_args.val_windows=2", "--data.init_args.train_windows=64"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"and its tokenizer to {export}" in proc.stderr + proc.stdout  # the end of the fit says where it went
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(export)
    full = AutoModelForCausalLM.from_pretrained(lm_dir)
    assert sum(p.numel() for p in reloaded.parameters()) <= 0.8 * sum(p.numel() for p in full.parameters())
    assert (export / "tokenizer.json").is_file()
    # `fit && shrink`: the checkpoint of the run (written after shrink_on_freeze) exports the same model
    (ckpt,) = (tmp_path / "runs").glob("lightning_logs/version_0/checkpoints/*.ckpt")
    proc = subprocess.run(
        [str(SCRIPT), "shrink", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "shrunk")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "shrunk")
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in reloaded.parameters())


def test_size_clusters_then_the_callback_reach_the_solved_size(tmp_path, cache, lm_dir):
    """Size first by calibrated importance (one-shot, nothing mutated), then train with those declarations."""
    from lightning_pat import size_clusters

    files = code_files(tmp_path / "texts", n=20)
    module = CausalLM(str(lm_dir), lr=1e-3)
    data = small_data(files, tokenizer=module.tokenizer)
    data.setup()
    batches = [x for x, _ in list(data.train_dataloader())[:3]]
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    sized = size_clusters(module, "llama", target_params=0.8, calibration=batches)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
    assert sized.size.rule == "importance"
    assert {c.name for c in sized.clusters} == {"mlp.{layer}", "heads.{layer}"}
    assert all(c.target is not None for c in sized.clusters)
    pruning = CoupledPruningCallback(sized.clusters, warmup_steps=1, ramp_steps=1, shrink_on_freeze=True)
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[pruning],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert sum(p.numel() for p in module.model.parameters()) == sized.size.achieved
    with pytest.raises(ValueError, match=r"size_clusters needs `target_params` or `target_flops`, exactly one"):
        size_clusters(module, "llama", calibration=batches)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"schedule": "step"}, r"`schedule` must be one of"), ({"lr": 0.0}, r"`lr` must be a finite number > 0"),
     ({"min_lr_ratio": 2.0}, r"`min_lr_ratio` must be a number in \[0, 1\]"),
     ({"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0"), ({"dtype": "float99"}, r"`dtype` must be one of")],
)  # fmt: skip
def test_causal_lm_refuses_bad_options(lm_dir, options, match):
    with pytest.raises(ValueError, match=match):
        CausalLM(str(lm_dir), **options)
