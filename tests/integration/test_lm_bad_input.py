"""Issue 39 (audit 2026-12b A5, A8, C1-C3, C5, C9, C10, D3): the ``lm`` front door refuses what it would otherwise
train on silently, and says which option, which split and which files.

References: the tiny LM directories of ``tests/common/tiny_lm.py`` (vocabularies 320 and 600, two different
tokenizers), files written here (UTF-8, Latin-1, random bytes, empty), and the split rule of ``split_by_file``.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_pat.lm import CausalLM, TextFiles
from lightning_pat.lm.data import read_prefix, read_texts
from tests.common.tiny_lm import code_files, tiny_lm_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lms")
    return tiny_lm_dir(root / "small", vocab=320), tiny_lm_dir(root / "big", vocab=600)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAT_CACHE", str(tmp_path / "cache"))


def data(files, **kw) -> TextFiles:
    options = {"seq_len": 16, "batch_size": 2, "val_windows": 2, "train_windows": 8, "english": False, **kw}
    return TextFiles(files=files, **options)


def trainer(**kw) -> pl.Trainer:
    options = {"max_steps": 2, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
               "limit_val_batches": 0, **kw}  # fmt: skip
    return pl.Trainer(**options)


# ------------------------------------------------------------------------------------------ A5: the model's tokenizer
@pytest.mark.parametrize("model_is_big", [True, False], ids=["smaller-tokenizer", "larger-tokenizer"])
def test_a_tokenizer_that_is_not_the_models_is_refused_at_setup_naming_both(tmp_path, lm_dirs, model_is_big):
    small, big = lm_dirs
    model_dir, tok_dir = (big, small) if model_is_big else (small, big)
    module = CausalLM(str(model_dir))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"`tokenizer` .*\((320|600) tokens\) is not the model's tokenizer") as err:
        trainer().fit(module, datamodule=data(code_files(tmp_path / "t"), tokenizer=str(tok_dir)))
    assert str(small) in str(err.value)
    assert str(big) in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())  # refused before any step
    # the model's own tokenizer, passed again (an object or its directory), is accepted
    trainer(max_steps=1).fit(module, datamodule=data(code_files(tmp_path / "t"), tokenizer=str(model_dir)))


def test_a_datamodule_set_up_before_the_fit_is_still_checked_at_the_fit(tmp_path, lm_dirs):
    datamodule = data(code_files(tmp_path / "t"), tokenizer=str(lm_dirs[0]))
    datamodule.setup()  # read and tokenized with no module attached (as before size_clusters)
    with pytest.raises(ValueError, match=r"\(320 tokens\) is not the model's tokenizer .*\(600 tokens\)"):
        trainer().fit(CausalLM(str(lm_dirs[1])), datamodule=datamodule)


def test_token_ids_beyond_the_embedding_are_a_value_error_not_an_index_error(lm_dirs):
    module = CausalLM(str(lm_dirs[0]))
    with pytest.raises(ValueError, match=r"token ids in \[0, 599\], outside the model's embedding of 320 rows"):
        module(torch.tensor([[0, 599]]))


def test_a_module_without_tokenizer_but_a_smaller_vocabulary_is_refused(tmp_path, lm_dirs):
    class Bare(pl.LightningModule):  # no `tokenizer` attribute: only config.vocab_size to compare with
        def __init__(self) -> None:
            super().__init__()
            self.model = CausalLM(str(lm_dirs[0])).model

    datamodule = data(code_files(tmp_path / "t"), tokenizer=str(lm_dirs[1]))
    datamodule.trainer = type("T", (), {"lightning_module": Bare()})()
    with pytest.raises(ValueError, match=r"\(600 tokens\) gives ids up to 599, beyond the model's config.vocab_size"):
        datamodule.setup()


# --------------------------------------------------------------------------------------------- A8: text, not bytes
def mixed_files(root: Path) -> list[str]:
    files = code_files(root)
    Path(files[1]).write_bytes(("Café naïve résumé\n" * 50).encode("latin-1"))
    Path(files[3]).write_bytes(os.urandom(2000))
    Path(files[7]).write_bytes(b"def f():\x00\x00 pass\n" * 40)  # valid UTF-8, but NUL bytes: binary
    return files


def test_files_that_are_not_utf8_text_are_refused_with_a_count_and_their_names(tmp_path, lm_dirs):
    files = mixed_files(tmp_path / "t")
    with pytest.raises(ValueError, match=r"3 of the files read are not UTF-8 text") as err:
        data(files, tokenizer=str(lm_dirs[0])).setup()
    assert all(files[i] in str(err.value) for i in (1, 3, 7))
    assert "bad_files: skip" in str(err.value)


def test_bad_files_skip_leaves_them_out_with_a_warning_and_keeps_the_split(tmp_path, lm_dirs):
    from transformers import AutoTokenizer

    files = mixed_files(tmp_path / "t")
    datamodule = data(files, tokenizer=str(lm_dirs[0]), bad_files="skip")
    with pytest.warns(UserWarning, match=r"left out 3 files that are not UTF-8 text"):
        datamodule.setup()
    tok = AutoTokenizer.from_pretrained(lm_dirs[0])
    kept = [f for i, f in enumerate(files) if i not in (1, 3, 5, 7)]  # 5 is held out, as without the bad files
    expected = tok("\n".join(Path(f).read_text() for f in kept)[:3_000_000])["input_ids"]
    assert datamodule.train.tokens.tolist() == expected
    assert "\ufffd" not in tok.decode(datamodule.train.tokens)
    with pytest.raises(ValueError, match=r"`bad_files` must be 'refuse' or 'skip', got 'ignore'"):
        TextFiles(bad_files="ignore")


# ------------------------------------------------------------------------------- C10: read only what is needed
def test_files_are_read_only_as_far_as_train_chars_needs(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * 1000 + b"\xff" * 1000)  # not UTF-8 after 1,000 bytes
    assert read_prefix(big, 100) == "a" * 100  # 400 bytes read at most: the bad bytes are never reached
    assert read_prefix(big) is None
    later = tmp_path / "later.bin"
    later.write_bytes(os.urandom(100))
    texts, read, bad = read_texts([big, later], max_chars=50)
    assert (texts, read, bad) == (["a" * 50], [big], [])  # `later` is past the budget: not opened
    utf8 = tmp_path / "utf8.txt"
    utf8.write_text("é" * 10)  # 2 bytes each: the cut at 4 * 3 bytes still decodes
    assert read_prefix(utf8, 3) == "ééé"


def test_cutting_by_chars_reads_the_same_text_as_reading_everything(tmp_path, lm_dirs):
    files = code_files(tmp_path / "t")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm_dirs[0])
    datamodule = data(files, tokenizer=tok, train_chars=2500, cache=False)
    datamodule.setup()
    train = [f for i, f in enumerate(files) if i != 5]
    full = "\n".join(Path(f).read_text() for f in train)[:2500]
    assert datamodule.train.tokens.tolist() == tok(full)["input_ids"]


# ------------------------------------------------------------------------------- C1, C2, D3: which split, which files
def test_a_short_split_names_the_split_and_its_files(tmp_path, lm_dirs):
    files = code_files(tmp_path / "t")
    Path(files[5]).write_text("")  # the one held-out file is empty
    with pytest.raises(ValueError, match=r"the held-out text \(1 files: .*f05\.py\) gives 0 tokens, fewer than"):
        data(files, tokenizer=str(lm_dirs[0])).setup()
    with pytest.raises(ValueError, match=r"the training text \(1 files: .*f00\.py\) gives \d tokens.*`train_chars`"):
        data(code_files(tmp_path / "u"), tokenizer=str(lm_dirs[0]), train_chars=5).setup()


def test_files_as_one_string_is_one_pattern_and_a_matched_directory_is_not_a_file(tmp_path):
    files = code_files(tmp_path / "t")
    (tmp_path / "t" / "sub.py").mkdir()  # a directory the glob matches too
    assert [str(p) for p in TextFiles(files=str(tmp_path / "t" / "*.py")).paths()] == files
    with pytest.raises(ValueError, match=r"`files` entry .* is a directory; give its files as a glob pattern"):
        TextFiles(files=str(tmp_path / "t")).paths()


def test_the_file_count_rule_is_holdout_every_half_plus_one(tmp_path, lm_dirs):
    files = code_files(tmp_path / "t", n=6)
    datamodule = data(files, tokenizer=str(lm_dirs[0]))
    datamodule.setup()  # 6 files with holdout_every=10: file 5 is held out, accepted
    assert len(datamodule.val) == 1
    with pytest.raises(ValueError, match=r"5 files give 5 training and 0 held-out files; give at least 6 files"):
        TextFiles(files=files[:5], tokenizer=object()).setup()


# ------------------------------------------------------------------------------------------- C3, C5: the options
@pytest.mark.parametrize(
    ("options", "match"),
    [({"lr": float("inf")}, r"`lr` must be a finite number > 0"), ({"lr": -1}, r"`lr` must be a finite number > 0"),
     ({"warmup_steps": 2.5}, r"`warmup_steps` must be an int >= 0"),
     ({"betas": (1.5, 0.9)}, r"`betas` must be two numbers in \[0, 1\)"),
     ({"weight_decay": float("nan")}, r"`weight_decay` must be a finite number >= 0"),
     ({"dtype": "float8_e4m3fn"}, r"`dtype` must be one of \('float32', 'bfloat16', 'float16', 'float64'\)"),
     ({"pretrained": "/no/such/dir"}, r"`pretrained`: the directory '/no/such/dir' does not exist")],
)  # fmt: skip
def test_causal_lm_refuses_options_at_construction(lm_dirs, options, match):
    with pytest.raises(ValueError, match=match):
        CausalLM(**{"pretrained": str(lm_dirs[0]), **options})


def test_text_files_refuse_a_missing_tokenizer_dir_and_negative_chars(tmp_path):
    with pytest.raises(ValueError, match=r"TextFiles: `tokenizer`: the directory '/nonexistent/tok' does not exist"):
        TextFiles(files=code_files(tmp_path / "t"), tokenizer="/nonexistent/tok").setup()
    for name in ("train_chars", "val_chars"):
        with pytest.raises(ValueError, match=rf"`{name}` must be a positive int or None"):
            TextFiles(**{name: -5})


# --------------------------------------------------------------------------------- C9: train mode; the progress bar
def test_causal_lm_trains_the_model_in_train_mode_and_shows_both_validation_losses(tmp_path, lm_dirs):
    seen = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args) -> None:
            seen.append(pl_module.model.training and all(m.training for m in pl_module.model.modules()))

    module = CausalLM(str(lm_dirs[0]))
    datamodule = data(code_files(tmp_path / "t"), english=True)
    fit = trainer(callbacks=[Record()], limit_val_batches=1, val_check_interval=1, max_steps=2)
    fit.fit(module, datamodule=datamodule)
    assert seen == [True, True]  # also after the validation in between
    assert {"val_loss", "val_loss_english"} <= set(fit.progress_bar_metrics)


def test_shrink_of_a_run_whose_model_directory_moved_says_the_directory_does_not_exist(tmp_path):
    """C3 through ``lightning-pat shrink``'s reading of the run's config (not jsonargparse's union message)."""
    from lightning_pat.cli.checkpoint import model_from_config

    config = tmp_path / "config.yaml"
    config.write_text("model:\n  class_path: lightning_pat.lm.CausalLM\n  init_args: {pretrained: /moved/tiny-lm}\n")
    with pytest.raises(ValueError, match=r"cannot build the model 'lightning_pat.lm.CausalLM' from its init_args "
                                         r"\(ValueError: CausalLM: `pretrained`: the directory '/moved/tiny-lm' does "
                                         r"not exist"):  # fmt: skip
        model_from_config(config)
