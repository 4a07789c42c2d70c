"""Tokenized text for pretrained language models: real text files, a held-out split by file, nothing downloaded.

:class:`TextFiles` is a LightningDataModule over text files (by default the running interpreter's standard library
sources, which every Python installation ships), tokenized with the model's tokenizer. Files are listed in sorted
order and every ``holdout_every``-th file (index ``holdout_every // 2`` modulo ``holdout_every``) is held out, so the
validation loss is measured on files the model never trains on. A second held-out set is English prose: the text of
``pydoc_data.topics`` (the language reference shipped with Python), every 4th topic (index 1 modulo 4) in sorted key
order.

Files are read as UTF-8, and only as far as ``train_chars`` / ``val_chars`` need. A file that is not UTF-8 text (a
binary file, another encoding, NUL bytes) is never trained on as replacement characters: ``bad_files="refuse"`` (the
default) stops with their count and first names; ``bad_files="skip"`` leaves them out with a warning (the split by
file index does not move).

Windows: training batches are windows of ``seq_len + 1`` tokens at seeded random starts (inputs and next tokens);
the held-out windows are ``val_windows`` fixed windows at evenly spaced starts. Token streams are cached in the user
cache (:func:`lightning_pat.lm.smollm2.default_cache_dir`, ``tokens/``) as safetensors, keyed by the sha256 of the
tokenizer's definition and of the text, so a second run does not tokenize again.

Example::

    >>> files = stdlib_files()
    >>> train, held = split_by_file(files)
    >>> len(held) == len(files[5::10]) and not set(train) & set(held)
    True
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_pat.lm.smollm2 import default_cache_dir

log = logging.getLogger(__name__)


def stdlib_files() -> list[Path]:
    """The top-level ``.py`` files of the running interpreter's standard library, sorted by name.

    Raises:
        FileNotFoundError: If the standard library directory holds no ``.py`` files (a zip-only install).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"No .py files in the standard library directory {root}; pass `files=` instead.")
    return files


def split_by_file(items: Sequence[Any], *, holdout_every: int = 10) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)``: item ``i`` is held out when ``i % holdout_every == holdout_every // 2``.

    Raises:
        ValueError: If ``holdout_every`` is below 2.
    """
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(
            f"`holdout_every` must be an int >= 2 (one file in that many is held out), got {holdout_every!r}."
        )
    train: list[Any] = []
    held: list[Any] = []
    for i, item in enumerate(items):
        (held if i % holdout_every == holdout_every // 2 else train).append(item)
    return train, held


def english_topics() -> tuple[list[str], list[str]]:
    """The text of ``pydoc_data.topics`` in sorted key order, split as ``(train, held_out)`` (every 4th held out)."""
    from pydoc_data.topics import topics

    return split_by_file([topics[key] for key in sorted(topics)], holdout_every=4)


def _tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "to_str", None)):
        definition = backend.to_str()
    else:  # a slow tokenizer: its vocabulary stands for it
        definition = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(definition.encode()).hexdigest()


def tokenize(texts: Sequence[str], tokenizer: Any, *, max_chars: int | None = None, cache: bool = True) -> Tensor:
    """The texts joined by newlines (cut to ``max_chars``), as one 1-D ``torch.long`` tensor of token ids.

    Args:
        texts: The texts.
        tokenizer: A Hugging Face tokenizer.
        max_chars: Keep only the first characters of the joined text.
        cache: Read and write the user cache (see the module docs).

    Returns:
        The token ids.
    """
    text = "\n".join(texts)
    text = text[:max_chars] if max_chars is not None else text
    path = None
    if cache:
        key = hashlib.sha256(f"{_tokenizer_digest(tokenizer)}\0{text}".encode()).hexdigest()[:32]
        path = default_cache_dir() / "tokens" / f"{key}.safetensors"
        if path.is_file():
            from safetensors.torch import load_file

            return load_file(str(path))["ids"]
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if path is not None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"ids": ids}, str(tmp))
        os.replace(tmp, path)
    return ids


def read_prefix(path: Path, max_chars: int | None = None) -> str | None:
    """The first ``max_chars`` characters of a UTF-8 text file (all of it for ``None``), or ``None`` if it is not text.

    Reads at most ``4 * max_chars`` bytes (a UTF-8 character is 1 to 4 bytes), so a large file costs what is used.
    Not text: bytes that are not UTF-8 (a binary file, Latin-1, ...) or a NUL character in what is read.
    """
    with path.open("rb") as fh:
        data = fh.read() if max_chars is None else fh.read(4 * max_chars)
    complete = max_chars is None or len(data) < 4 * max_chars
    try:
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=complete)
    except UnicodeDecodeError:
        return None
    if "\x00" in text:
        return None
    return text if max_chars is None else text[:max_chars]


def read_texts(paths: Sequence[Path], *, max_chars: int | None = None) -> tuple[list[str], list[Path], list[Path]]:
    """``(texts, read, not_text)``: the files in order until their newline-joined text reaches ``max_chars``.

    The newline-joined ``texts`` cut to ``max_chars`` equal the joined text of every file cut to ``max_chars``
    (files past it are not opened); ``read`` are the files of ``texts``; the files that are not UTF-8 text
    (:func:`read_prefix`) are left out and listed in ``not_text``.
    """
    texts: list[str] = []
    read: list[Path] = []
    not_text: list[Path] = []
    total = 0  # the length of the newline-joined texts
    for path in paths:
        if max_chars is not None and total >= max_chars:
            break
        text = read_prefix(path, None if max_chars is None else max_chars - total)
        if text is None:
            not_text.append(path)
            continue
        total += len(text) + (1 if texts else 0)
        texts.append(text)
        read.append(path)
    return texts, read, not_text


def _names(paths: Sequence[Path], first: int = 3) -> str:
    shown = ", ".join(str(p) for p in paths[:first])
    return shown + (f", ... ({len(paths) - first} more)" if len(paths) > first else "")


def _check_length(tokens: Tensor, seq_len: int) -> None:
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"A token stream of {tokens.numel()} tokens is shorter than one window of {seq_len + 1}.")


def eval_starts(tokens: Tensor, *, num_windows: int, seq_len: int) -> Tensor:
    """Starts of ``num_windows`` windows of ``seq_len + 1`` tokens, evenly spaced over the stream.

    Raises:
        ValueError: If the stream is shorter than one window.
    """
    _check_length(tokens, seq_len)
    return torch.linspace(0, tokens.numel() - seq_len - 2, num_windows).long()


def random_starts(tokens: Tensor, *, num_windows: int, seq_len: int, seed: int) -> Tensor:
    """Starts of ``num_windows`` windows at random positions drawn from a generator seeded with ``seed``.

    Raises:
        ValueError: If the stream is shorter than one window.
    """
    _check_length(tokens, seq_len)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, tokens.numel() - seq_len - 1, (num_windows,), generator=gen)


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """Windows of a token stream as ``(inputs, next tokens)`` pairs of ``seq_len`` tokens each.

    Args:
        tokens: The 1-D token stream.
        starts: The first position of each window.
        seq_len: Predicted tokens per window.
    """

    def __init__(self, tokens: Tensor, starts: Tensor, seq_len: int) -> None:
        self.tokens, self.starts, self.seq_len = tokens, starts, seq_len

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[i])
        w = self.tokens[start : start + self.seq_len + 1]
        return w[:-1], w[1:]

    def stacked(self) -> Tensor:
        """Every window, ``[N, seq_len + 1]``."""
        return torch.stack([self.tokens[int(s) : int(s) + self.seq_len + 1] for s in self.starts])


class TextFiles(pl.LightningDataModule):
    """Next-token windows of real text files, tokenized with the model's tokenizer, with a held-out split by file.

    Validation holds one loader of held-out files (the module logs ``val_loss``) and, with ``english``, a second one
    of held-out English prose (``val_loss_english``); see the module docs for the splits and the windows.

    Args:
        files: Paths (or glob patterns) of the text files; default: the standard library's top-level ``.py`` files.
        tokenizer: A Hugging Face tokenizer, a directory or model id to load one from (``"smollm2"``:
            :func:`~lightning_pat.lm.smollm2_dir`), or ``None``: the LightningModule's ``tokenizer`` attribute
            (:class:`~lightning_pat.lm.CausalLM` has one).
        seq_len: Predicted tokens per window.
        batch_size: Windows per batch.
        holdout_every: One file in this many is held out (see :func:`split_by_file`).
        val_windows: Fixed held-out windows per validation set.
        train_windows: Training windows per epoch (random starts, seeded).
        train_chars: Keep only the first characters of the training text (``None``: all of it).
        val_chars: Keep only the first characters of the held-out text.
        english: Add the held-out English set (``pydoc_data.topics``).
        seed: Seed of the training windows' starts.
        cache: Cache the token streams in the user cache.
        bad_files: A file that is not UTF-8 text (binary, another encoding, NUL bytes): ``"refuse"`` (stop at
            setup, naming them) or ``"skip"`` (leave it out, with a warning). Only files that are read count (see
            ``train_chars``).

    Raises:
        ValueError: If an option is out of range, a pattern matches no file, fewer than ``holdout_every // 2 + 1``
            files are given, a file is not UTF-8 text (``bad_files="refuse"``), a split is shorter than one window,
            or the tokenizer is not the LightningModule's (another ``tokenizer``, more tokens than the model's
            ``config.vocab_size``; at setup).
    """

    def __init__(
        self,
        files: str | Sequence[str] | None = None,
        tokenizer: Any = None,
        seq_len: int = 128,
        batch_size: int = 2,
        holdout_every: int = 10,
        val_windows: int = 64,
        train_windows: int = 100_000,
        train_chars: int | None = 3_000_000,
        val_chars: int | None = 600_000,
        english: bool = True,
        seed: int = 0,
        cache: bool = True,
        bad_files: Literal["refuse", "skip"] = "refuse",
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("val_windows", val_windows),
                            ("train_windows", train_windows), ("train_chars", train_chars),
                            ("val_chars", val_chars)):  # fmt: skip
            if value is None and name.endswith("_chars"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                none = " or None (all of the text)" if name.endswith("_chars") else ""
                raise ValueError(f"TextFiles: `{name}` must be a positive int{none}, got {value!r}.")
        if bad_files not in ("refuse", "skip"):
            raise ValueError(f"TextFiles: `bad_files` must be 'refuse' or 'skip', got {bad_files!r}.")
        split_by_file([], holdout_every=holdout_every)  # checks the option
        self.files = [files] if isinstance(files, (str, Path)) else files  # one pattern, not its characters
        self.tokenizer, self.bad_files = tokenizer, bad_files
        self.seq_len, self.batch_size, self.holdout_every = seq_len, batch_size, holdout_every
        self.val_windows, self.train_windows = val_windows, train_windows
        self.train_chars, self.val_chars, self.english = train_chars, val_chars, english
        self.seed, self.cache = seed, cache
        self.train: Windows | None = None
        self.val: list[Windows] = []
        self._max_id: int | None = None
        self._used_tokenizer: Any = None
        self._checked: int | None = None  # id() of the module the tokens were last checked against

    def paths(self) -> list[Path]:
        """The text files, sorted (patterns expanded)."""
        if self.files is None:
            return stdlib_files()
        out: list[Path] = []
        for entry in self.files:
            pattern = str(entry)
            if not any(c in pattern for c in "*?["):
                if Path(pattern).is_dir():
                    raise ValueError(f"TextFiles: `files` entry {entry!r} is a directory; give its files as a glob "
                                     f"pattern (e.g. {str(Path(pattern) / '*.txt')!r}).")  # fmt: skip
                matches = [Path(pattern)] if Path(pattern).is_file() else []
            else:  # a glob: its files (a directory it also matches is not text)
                matches = [Path(m) for m in sorted(glob.glob(pattern)) if Path(m).is_file()]
            if not matches:
                raise ValueError(f"TextFiles: `files` entry {entry!r} names no file; give paths or glob patterns.")
            out.extend(matches)
        return sorted(dict.fromkeys(out))

    def _tokenizer(self) -> Any:
        tok = self.tokenizer
        if tok is None:
            module = getattr(getattr(self, "trainer", None), "lightning_module", None)
            tok = getattr(module, "tokenizer", None)
            if tok is None:
                raise ValueError(
                    "TextFiles: no tokenizer: pass `tokenizer=` (a tokenizer, a directory or a model id), or use a "
                    "LightningModule with a `tokenizer` attribute (lightning_pat.lm.CausalLM)."
                )
        if isinstance(tok, (str, Path)):
            from lightning_pat.export.hf_loader import load_tokenizer
            from lightning_pat.lm.module import check_pretrained, resolve_pretrained

            check_pretrained(str(tok), option="TextFiles: `tokenizer`")  # before the Hub's "Repo id must be ..."
            tok = load_tokenizer(resolve_pretrained(str(tok)), what="TextFiles(tokenizer=...)")
        return tok

    def _check_model(self, tokenizer: Any, max_id: int | None = None) -> None:
        """Refuse a tokenizer (or token ids) that is not the attached LightningModule's (A5 of audit 2026-12b)."""
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if module is None or (max_id is not None and self._checked == id(module)):
            return
        own = getattr(module, "tokenizer", None)

        def describe(tok: Any) -> str:
            return f"{getattr(tok, 'name_or_path', '') or type(tok).__name__!r} ({len(tok)} tokens)"

        if own is not None and own is not tokenizer and _tokenizer_digest(own) != _tokenizer_digest(tokenizer):
            raise ValueError(
                f"TextFiles: `tokenizer` {describe(tokenizer)} is not the model's tokenizer {describe(own)}: the "
                "model would train on another token mapping and be exported with its own; leave `tokenizer` unset "
                "(None: the model's) or give the model's."
            )
        config = getattr(getattr(module, "model", module), "config", None)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and (len(tokenizer) > vocab or (max_id is not None and max_id >= vocab)):
            raise ValueError(
                f"TextFiles: `tokenizer` {describe(tokenizer)} gives ids up to {max(len(tokenizer) - 1, max_id or 0)}"
                f", beyond the model's config.vocab_size={vocab}; tokenize with the model's tokenizer (leave "
                "`tokenizer` unset)."
            )
        if max_id is not None:
            self._checked = id(module)

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize the files once (cached); check the tokenizer against the attached LightningModule's."""
        if self.train is not None:  # read already: check a newly attached module (once), reload nothing
            self._check_model(self._used_tokenizer, self._max_id)
            return
        tokenizer = self._used_tokenizer = self._tokenizer()
        self._check_model(tokenizer)
        train_files, held_files = split_by_file(self.paths(), holdout_every=self.holdout_every)
        if not train_files or not held_files:
            first = self.holdout_every // 2
            raise ValueError(
                f"TextFiles: {len(train_files) + len(held_files)} files give {len(train_files)} training and "
                f"{len(held_files)} held-out files; give at least {first + 1} files (file {first} of every "
                f"`holdout_every`={self.holdout_every} is held out), or lower `holdout_every`."
            )
        train_texts, train_read, train_bad = read_texts(train_files, max_chars=self.train_chars)
        held_texts, held_read, held_bad = read_texts(held_files, max_chars=self.val_chars)
        bad = sorted(train_bad + held_bad)
        if bad and self.bad_files == "refuse":
            raise ValueError(
                f"TextFiles: {len(bad)} of the files read are not UTF-8 text (binary, another encoding or NUL bytes): "
                f"{_names(bad)}; remove them from `files` (e.g. a narrower glob), convert them to UTF-8, or pass "
                "`bad_files: skip` to leave them out."
            )
        if bad:
            rank_zero_warn(f"TextFiles: left out {len(bad)} files that are not UTF-8 text: {_names(bad)}")
        seq, n = self.seq_len, self.val_windows

        def stream(texts: list[str], max_chars: int | None, what: str, files: Sequence[Path], option: str) -> Tensor:
            tokens = tokenize(texts, tokenizer, max_chars=max_chars, cache=self.cache)
            if tokens.numel() < seq + 2:
                where = f" ({len(files)} files: {_names(files)})" if files else ""
                raise ValueError(
                    f"TextFiles: the {what}{where} gives {tokens.numel()} tokens, fewer than the `seq_len` + 2 = "
                    f"{seq + 2} one window needs; give longer or more files, raise `{option}` (now {max_chars}), or "
                    "lower `seq_len`."
                )
            return tokens

        train = stream(train_texts, self.train_chars, "training text", train_read, "train_chars")
        held = stream(held_texts, self.val_chars, "held-out text", held_read, "val_chars")
        val = [held]
        if self.english:
            val.append(stream(english_topics()[1], self.val_chars, "held-out English (pydoc_data.topics)", [],
                              "val_chars"))  # fmt: skip
        self._max_id = max(int(t.max()) for t in (train, *val))
        self._check_model(tokenizer, self._max_id)
        self.train = Windows(train, random_starts(train, num_windows=self.train_windows, seq_len=seq, seed=self.seed),
                             seq)  # fmt: skip
        self.val = [Windows(v, eval_starts(v, num_windows=n, seq_len=seq), seq) for v in val]
        log.info(
            "TextFiles: %d training files (%d tokens), %d held-out files (%d tokens)%s",
            len(train_files), train.numel(), len(held_files), held.numel(),
            ", held-out English (pydoc_data.topics)" if self.english else "",
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """The training windows, in their seeded random order."""
        self.setup()
        assert self.train is not None
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> list[DataLoader[tuple[Tensor, Tensor]]]:
        """The held-out code windows, then (with ``english``) the held-out English windows."""
        self.setup()
        return [DataLoader(v, batch_size=self.batch_size) for v in self.val]
