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
import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

from lightning_pat import save_pretrained
from lightning_pat.export.pretrained import EXPORT_MARKER, check_directory
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


def test_a_source_the_export_is_made_from_is_refused_as_its_output_whatever_overwrite_says(tmp_path):
    marked = tmp_path / "earlier-export"  # an export of ours (replaceable), holding a checkpoint named like its files
    marked.mkdir()
    (marked / EXPORT_MARKER).write_text("{}")
    (marked / "model.pt").write_bytes(b"a checkpoint")
    check_directory(marked, overwrite=True)  # nothing says model.pt is the source: replaceable
    for output in (marked, tmp_path):  # the checkpoint's directory, or one above it
        with pytest.raises(ValueError, match=r"holds .*model\.pt, which is the checkpoint this export was read from"):
            check_directory(output, overwrite=True, sources=[("the checkpoint", marked / "model.pt")])
    with pytest.raises(ValueError, match=r"earlier-export is the run's config this export was read from"):
        check_directory(marked, overwrite=True, sources=[("the run's config", marked), ("none", None)])
    check_directory(marked / "inside", overwrite=False, sources=[("the checkpoint", marked / "model.pt")])  # below it
    assert (marked / "model.pt").read_bytes() == b"a checkpoint"


def test_the_overwrite_option_is_named_as_the_caller_spells_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"pass overwrite=True to replace"):
        check_directory(tmp_path, overwrite=False)
    with pytest.raises(FileExistsError, match=r"pass export_overwrite=True \(.*model.init_args.export_overwrite"):
        check_directory(
            tmp_path, overwrite=False,
            option="export_overwrite=True (under `lightning-pat fit`: model.init_args.export_overwrite: true)",
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- B2
SIZES = "lightning_pat.json"


def _edit_json(file: str, edit):
    def apply(directory: Path) -> None:
        data = json.loads((directory / file).read_text())
        edit(data)
        (directory / file).write_text(json.dumps(data))

    return apply


def _write(file: str, text: str):
    return lambda directory: (directory / file).write_text(text)


def _header(edit):
    """Rewrite model.safetensors' header through ``edit(header_dict) -> bytes | dict``, keeping the data."""

    def apply(directory: Path) -> None:
        raw = (directory / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        new = edit(json.loads(raw[8 : 8 + n]))
        body = json.dumps(new).encode() if isinstance(new, dict) else None
        head = struct.pack("<Q", len(body)) + body if body is not None else new
        (directory / "model.safetensors").write_bytes(head + raw[8 + n :])

    return apply


def _first_tensor(h):
    return next(v for k, v in h.items() if k != "__metadata__")


def _lie_shape(h):
    _first_tensor(h)["shape"] = [4, 5]
    return h


def _block(key, value):
    return _edit_json("config.json", lambda c: c["block_configs"][0]["ffn"].__setitem__(key, value))


def _entry(edit):
    return _edit_json("config.json", lambda c: edit(c["lightning_pat"]))


# (id, source export, edit, message regex): each one ValueError naming the file and the field
B2_CASES = [
    (
        "module-without-class",
        "mod",
        _edit_json(SIZES, lambda i: i["modules"][0].pop("class")),
        r"lightning_pat.json modules\[0\] \(root\) has no `class`",
    ),
    (
        "attributes-a-list",
        "mod",
        _edit_json(SIZES, lambda i: i["modules"][0].__setitem__("attributes", [1])),
        r"lightning_pat.json modules\[0\] \(root\): `attributes` must be a mapping",
    ),
    (
        "parameter-spec-a-string",
        "mod",
        _edit_json(SIZES, lambda i: i["modules"][0].__setitem__("parameters", {"weight": "x"})),
        r"lightning_pat.json modules\[0\] \(root\): `parameters` must be a mapping of names to null or \{'tensor'",
    ),
    (
        "shapes-of-module-a-list",
        "mod",
        _edit_json(SIZES, lambda i: i.__setitem__("shapes", [1])),
        r"lightning_pat.json: `shapes` must be a mapping of parameter names to lists",
    ),
    (
        "module-shape-not-in-the-weights",
        "mod",
        _edit_json(SIZES, lambda i: i["shapes"].__setitem__("weight", [9, 9])),
        r"lightning_pat.json gives weight the shape \[9, 9\], but .*model.safetensors holds \[4, 4\]",
    ),
    ("json-a-list", "mod", _write(SIZES, "[1, 2]"), r"lightning_pat.json must hold a JSON object .*got a list"),
    ("json-not-json", "mod", _write(SIZES, "{not json"), r"lightning_pat.json is not a JSON file"),
    ("config-not-json", "hf", _write("config.json", "{"), r"config.json is not a JSON file"),
    (
        "entry-without-base-config",
        "hf",
        _entry(lambda e: e.pop("base_config")),
        r"config.json's lightning_pat entry: `base_config` must be the config mapping",
    ),
    (
        "entry-shapes-a-list",
        "hf",
        _entry(lambda e: e.__setitem__("shapes", [1])),
        r"config.json's lightning_pat entry: `shapes` must be a mapping of parameter names",
    ),
    (
        "entry-shape-huge",
        "hf",
        _entry(lambda e: e["shapes"].__setitem__("model.norm.weight", [10**12])),
        r"lightning_pat entry gives model.norm.weight the shape \[1000000000000\], but .*model.safetensors holds",
    ),
    (
        "entry-base-config-huge",
        "hf",
        _entry(lambda e: e["base_config"].__setitem__("intermediate_size", 10**12)),
        r"lightning_pat entry: no LlamaForCausalLM can be built from `base_config` \(RuntimeError",
    ),
    (
        "decilm-ffn-1e12",
        "deci",
        _block("intermediate_size", 10**12),
        r"config.json \(DeciLM\) gives model.layers.0.mlp.gate_proj.weight the shape \[1000000000000, 64\], but ",
    ),
    (
        "header-lies-about-a-shape",
        "mod",
        _header(_lie_shape),
        r"model.safetensors: tensor '.*': its header says shape \[4, 5\] \(F32, 80 bytes\) at bytes \[.*\]",
    ),
    (
        "header-length-2-62",
        "mod",
        _header(lambda h: struct.pack("<Q", 2**62) + b"{}"),
        r"model.safetensors is not a safetensors file or is truncated \(its header length 4611686018427387904",
    ),
    (
        "header-not-json",
        "hf",
        _header(lambda h: struct.pack("<Q", 4) + b"nope"),
        r"model.safetensors's safetensors header is not a JSON mapping",
    ),
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pat import presets, prune_clusters, shrink

    root = tmp_path_factory.mktemp("exports")
    save_pretrained(nn.Linear(4, 4), root / "mod")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = shrink(model, prune_clusters(model, presets.llama(model, heads=False), target_params=0.8,
                                             target_widths="ranked"))  # fmt: skip
        save_pretrained(small, root / "hf")
        save_pretrained(small, root / "deci", format="decilm")
    return root


@pytest.mark.parametrize(("source", "edit", "match"), [c[1:] for c in B2_CASES], ids=[c[0] for c in B2_CASES])
def test_a_malformed_export_is_one_value_error_naming_the_file_and_field(tmp_path, exports, source, edit, match):
    from lightning_pat import load_pretrained

    directory = tmp_path / source
    shutil.copytree(exports / source, directory)
    edit(directory)
    with pytest.raises(ValueError, match=match) as caught:
        load_pretrained(directory)
    assert type(caught.value) is ValueError  # not a KeyError, a SafetensorError or an allocator's RuntimeError


def test_a_module_export_is_never_replaced_by_the_model_loaded_from_it(tmp_path):
    from torch import nn

    from lightning_pat import load_pretrained

    out = save_pretrained(nn.Sequential(nn.Linear(3, 4)), tmp_path / "mod")
    before = digest(out)
    again = load_pretrained(out)
    with pytest.raises(ValueError, match=r"mod is the model this export was read from"):
        save_pretrained(again, out, overwrite=True)
    assert digest(out) == before
    elsewhere = save_pretrained(again, tmp_path / "elsewhere")
    assert str(out) not in (elsewhere / SIZES).read_text()  # the loading machine's path is not exported
    assert isinstance(load_pretrained(elsewhere), nn.Sequential)
