"""The tokenizer of an export: written next to the model, from a tokenizer object or a directory's tokenizer files.

A served model needs its tokenizer: vLLM and ``AutoTokenizer`` read it from the model directory, and a GGUF file
embeds it. :func:`resolve` turns what the caller gave (``tokenizer=`` of ``save_pretrained``) into a source, checked
before anything is written; :func:`write` puts its files into the export's temporary directory.

* A tokenizer object (anything with ``save_pretrained(directory)``, e.g. a transformers tokenizer): it writes its own
  files; only the known tokenizer file names (:data:`TOKENIZER_FILES`) are kept.
* A directory (``str`` or ``Path``): its known tokenizer files are copied (plain files inside it only; a symlink
  that leads outside is refused).
* ``"auto"``: the tokenizer files of the directory the model was loaded from (``config.name_or_path``), when it is a
  local directory holding a ``tokenizer.json`` or ``tokenizer_config.json``; otherwise no tokenizer.
* ``None``: no tokenizer.

:func:`check_fits` refuses, before anything is written, a tokenizer with more token ids than the model's embedding
rows (it does not belong to the model: ordinary text would index past the embedding), on every format.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lightning_pat.core.safe_io import confined

log = logging.getLogger(__name__)

#: The file names a tokenizer may consist of (what is copied, and what ``overwrite=True`` may replace).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
#: Any one of these makes a directory a tokenizer directory.
_MARKERS = ("tokenizer.json", "tokenizer_config.json")


def is_tokenizer_file(name: str) -> bool:
    """Whether ``name`` is one of :data:`TOKENIZER_FILES`."""
    return name in TOKENIZER_FILES


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizer files come from: a tokenizer object or a directory (exactly one is set)."""

    obj: Any = None
    directory: Path | None = None

    def describe(self) -> str:
        """For log and error messages."""
        return f"the tokenizer files of {self.directory}" if self.directory else f"a {type(self.obj).__name__}"


def _has_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and any((directory / m).is_file() for m in _MARKERS)


def source_directory(model: nn.Module) -> Path | None:
    """The local directory named by ``model.config.name_or_path`` if it holds tokenizer files, else ``None``."""
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    path = Path(name).expanduser()
    return path if _has_tokenizer(path) else None


def resolve(tokenizer: object, model: nn.Module, *, what: str) -> TokenizerSource | None:
    """The tokenizer source for ``tokenizer=`` (see the module docstring), checked before anything is written.

    Args:
        tokenizer: ``"auto"``, ``None``, a tokenizer object, or a directory.
        model: The model being exported (for ``"auto"``).
        what: The caller, for error messages.

    Returns:
        The source, or ``None`` for no tokenizer.

    Raises:
        ValueError: If a path is not a directory holding ``tokenizer.json`` or ``tokenizer_config.json``, or an
            object has no ``save_pretrained``.
    """
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str) and tokenizer == "auto":
        found = source_directory(model)
        if found is None:
            log.info("%s: no tokenizer written (the model's config names no local directory with one)", what)
            return None
        return TokenizerSource(directory=found)
    if isinstance(tokenizer, (str, Path)):
        path = Path(tokenizer).expanduser()
        if not _has_tokenizer(path):
            raise ValueError(
                f"{what}: `tokenizer` {str(tokenizer)!r} is not a directory holding tokenizer.json or "
                "tokenizer_config.json; pass a tokenizer object (e.g. AutoTokenizer.from_pretrained(...)), the "
                "directory the model was loaded from, or tokenizer=None."
            )
        return TokenizerSource(directory=path)
    if callable(getattr(tokenizer, "save_pretrained", None)):
        return TokenizerSource(obj=tokenizer)
    raise ValueError(
        f"{what}: `tokenizer` must be 'auto', None, a directory or an object with save_pretrained(directory); got "
        f"a {type(tokenizer).__name__}."
    )


def _ids_of_file(directory: Path, name: str, *, what: str) -> list[int]:
    """The token ids a tokenizer file names (``tokenizer.json``: vocabulary and added tokens; others: their values)."""
    path = confined(directory, name, what=f"{what}: tokenizer")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{what}: cannot read the tokenizer file {path} ({type(err).__name__}: {err}).") from None
    if name != "tokenizer.json":
        values = list(data.values()) if isinstance(data, dict) else []
    else:
        vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
        values = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))  # Unigram: a list
        added = data.get("added_tokens") if isinstance(data, dict) else None
        values += [t.get("id") for t in added or [] if isinstance(t, dict)]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def token_count(source: TokenizerSource, *, what: str) -> int | None:
    """1 + the largest token id of the tokenizer (``None``: it cannot be told from its files)."""
    ids: list[int] = []
    if source.obj is not None:
        vocab = source.obj.get_vocab() if callable(getattr(source.obj, "get_vocab", None)) else None
        if isinstance(vocab, dict):
            ids = [v for v in vocab.values() if isinstance(v, int)]
        elif callable(getattr(source.obj, "__len__", None)):
            return len(source.obj)
    elif source.directory is not None:
        names = ["tokenizer.json"] if (source.directory / "tokenizer.json").is_file() else ["vocab.json"]
        names += ["added_tokens.json"] if names == ["vocab.json"] else []
        for name in names:
            if (source.directory / name).is_file():
                ids += _ids_of_file(source.directory, name, what=what)
    return max(ids) + 1 if ids else None


def check_fits(source: TokenizerSource, model: nn.Module, *, what: str) -> None:
    """Refuse a tokenizer whose token ids do not all fit the model's input embedding (the GGUF writer's check).

    Raises:
        ValueError: If the tokenizer has more token ids than the embedding has rows (naming both numbers).
    """
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    count = token_count(source, what=what)
    if weight is None or weight.dim() != 2 or count is None:
        return
    rows = int(weight.shape[0])
    if count > rows:
        raise ValueError(
            f"{what}: the tokenizer ({source.describe()}) has {count:,} token ids (up to id {count - 1}), but the "
            f"model's embedding has only {rows:,} rows: the tokenizer does not belong to this model (ordinary text "
            "would index past the embedding). Pass the model's own tokenizer (tokenizer='auto' for the directory the "
            "model was loaded from), or tokenizer=None; nothing was written."
        )


def write(source: TokenizerSource, directory: Path, *, what: str) -> list[str]:
    """Write the tokenizer files of ``source`` into ``directory`` (the export's temporary directory).

    Returns:
        The file names written.

    Raises:
        ValueError: If the source yields no tokenizer file, or a file of a source directory is a symlink leading
            outside it.
    """
    written: list[str] = []
    if source.directory is not None:
        for name in TOKENIZER_FILES:
            if (source.directory / name).is_file():
                path = confined(source.directory, name, what=f"{what}: tokenizer")
                shutil.copyfile(path, directory / name)
                written.append(name)
    else:
        with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=directory) as scratch:
            source.obj.save_pretrained(scratch)
            for child in sorted(Path(scratch).iterdir()):
                if child.is_file() and not child.is_symlink() and is_tokenizer_file(child.name):
                    shutil.move(str(child), directory / child.name)
                    written.append(child.name)
                else:
                    log.info("%s: the tokenizer also wrote %s, which is not kept", what, child.name)
    if not written:
        raise ValueError(f"{what}: {source.describe()} yielded none of the tokenizer files {list(TOKENIZER_FILES)}.")
    log.info("%s: tokenizer written from %s (%s)", what, source.describe(), ", ".join(written))
    return written
