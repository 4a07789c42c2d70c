"""Issue 39 (audit 2026-12b A6, A7, B2): what ``save_pretrained`` refuses to write and ``load_pretrained`` to read.

* A6: a tokenizer with more token ids than the model's embedding rows, on every format, before anything is written.
* A7: an output that is (or holds) the directory the model or its tokenizer was read from, whatever ``overwrite``
  says; and ``overwrite`` replaces only a directory lightning_pat wrote (its marker file), never a model directory.
* B2: malformed export files end in one ``ValueError`` naming the file and the field.

References: the tiny LM directory of ``tests/common/tiny_lm.py`` (vocab 320 and 600), its files' sha256 before and
after the refused call.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest

from lightning_pat import save_pretrained
from lightning_pat.shrink.export import EXPORT_MARKER, check_directory
from tests.common.tiny_lm import tiny_lm_dir

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lms")
    return tiny_lm_dir(root / "small", vocab=320), tiny_lm_dir(root / "big", vocab=600)


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def load(directory: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(directory)


# ---------------------------------------------------------------------------------------------------- A6
@pytest.mark.parametrize("fmt", ["hf", "decilm", "gguf"])
@pytest.mark.parametrize("kind", ["directory", "object"])
def test_a_tokenizer_of_another_vocabulary_is_refused_on_every_format(tmp_path, lm_dirs, fmt, kind):
    small, big = lm_dirs
    if fmt == "gguf":
        pytest.importorskip("gguf")
    tokenizer = str(big) if kind == "directory" else transformers.AutoTokenizer.from_pretrained(big)
    match = r"the tokenizer .* has 600 token ids .*embedding has only 320 rows.*does not belong to this model"
    with pytest.raises(ValueError, match=match):
        save_pretrained(load(small), tmp_path / "out", tokenizer=tokenizer, format=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no partial folder
    # the model's own tokenizer (and a smaller one: its ids fit) are written
    save_pretrained(load(big), tmp_path / "ok", tokenizer=str(small))
    assert (tmp_path / "ok" / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------------------------------- A7
def test_the_directory_the_model_was_loaded_from_is_never_replaced(tmp_path, lm_dirs):
    small, _ = lm_dirs
    before = digest(small)
    model = load(small)
    source = r"the output directory .*tiny-lm is the model this export was read from.*whatever overwrite says"
    with pytest.raises(ValueError, match=source):
        save_pretrained(model, small, overwrite=True)
    with pytest.raises(ValueError, match=r"the output directory .* holds .*tiny-lm, which is the model"):
        save_pretrained(model, small.parent, overwrite=True)  # a directory holding it
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((small / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"tok is the tokenizer this export was read from"):
        save_pretrained(model, tok, tokenizer=str(tok), overwrite=True)
    assert digest(small) == before


def test_overwrite_replaces_only_a_directory_lightning_pat_wrote(tmp_path, lm_dirs):
    small, _ = lm_dirs
    copy = tmp_path / "copy"  # a model directory the model was *not* loaded from: still not ours to replace
    copy.mkdir()
    for f in small.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = digest(copy)
    model = load(small)
    with pytest.raises(FileExistsError, match=r"copy was not written by lightning_pat .*lightning_pat_export.json"):
        save_pretrained(model, copy, overwrite=True)
    with pytest.raises(FileExistsError, match=r"not written by lightning_pat.*--overwrite only replaces"):
        check_directory(copy, overwrite=True, option="--overwrite")  # each caller names its own option (C8)
    assert digest(copy) == before
    out = save_pretrained(model, tmp_path / "export")
    assert (out / EXPORT_MARKER).is_file()
    save_pretrained(model, out, overwrite=True)  # an export of ours is replaced
    again = load(out)  # an export loaded again is its source: a re-export goes elsewhere
    with pytest.raises(ValueError, match=r"export is the model this export was read from"):
        save_pretrained(again, out, overwrite=True)


def test_the_overwrite_option_is_named_as_the_caller_spells_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"pass overwrite=True to replace"):
        check_directory(tmp_path, overwrite=False)
    with pytest.raises(FileExistsError, match=r"pass export_overwrite=True \(.*model.init_args.export_overwrite"):
        check_directory(
            tmp_path, overwrite=False,
            option="export_overwrite=True (under `lightning-pat fit`: model.init_args.export_overwrite: true)",
        )  # fmt: skip
