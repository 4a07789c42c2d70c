"""Hugging Face loaders that never run code from a folder (DESIGN invariant 10).

Every ``from_pretrained`` that lightning_pat calls goes through :func:`load_causal_lm`, :func:`load_tokenizer` or
:func:`load_hf_class`: each passes ``trust_remote_code=False`` explicitly (transformers then never prompts and never
imports a folder's Python file), and a local directory whose ``config.json`` or ``tokenizer_config.json`` asks for
code that transformers does not ship (an ``auto_map`` to classes of the folder's own ``.py`` files) is refused by
:func:`refuse_remote_code` before transformers opens it, with a message that says so. A folder whose ``auto_map`` is
only an extra (its ``model_type`` is one transformers knows, as many hub checkpoints do) loads with the built-in
class. ``transformers`` is imported only when a loader is called.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The files whose ``auto_map`` names the folder's own code.
CODE_FILES = ("config.json", "tokenizer_config.json")


def remote_code_request(directory: Path) -> str | None:
    """What in ``directory`` asks transformers to run the folder's own code, or ``None``.

    Args:
        directory: A local model or tokenizer directory.

    Returns:
        ``"<file>: auto_map ..."`` for the first file whose ``auto_map`` transformers would need to import code for
        (in ``config.json``: a ``model_type`` that transformers does not know; in ``tokenizer_config.json``: a
        tokenizer class that transformers does not ship), else ``None``.
    """
    for name in CODE_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # transformers reports an unreadable file itself; nothing here can run code
        if not isinstance(data, Mapping) or not data.get("auto_map"):
            continue
        if name == "config.json" and not _known_model_type(data.get("model_type")):
            return f"{name}: auto_map {data['auto_map']!r} with model_type {data.get('model_type')!r}"
        if name == "tokenizer_config.json" and not _known_tokenizer(data.get("tokenizer_class")):
            return f"{name}: auto_map {data['auto_map']!r} with tokenizer_class {data.get('tokenizer_class')!r}"
    return None


def refuse_remote_code(source: str | Path, *, what: str) -> None:
    """Refuse a local directory that asks to run its own code; a model id or a safe folder passes.

    Args:
        source: A directory or a model id (ids are checked by transformers itself, with ``trust_remote_code=False``).
        what: The caller, for the message (e.g. ``"CausalLM(pretrained=...)"``).

    Raises:
        ValueError: If ``source`` is a directory whose files ask for custom code.
    """
    directory = Path(source)
    if not directory.is_dir():
        return
    request = remote_code_request(directory)
    if request is not None:
        raise ValueError(
            f"{what}: {directory} asks to run Python code from the folder ({request}); lightning_pat never runs "
            "code from a folder (trust_remote_code=False on every loader). Use a model of a family transformers "
            "ships; a DeciLM export of lightning_pat loads with lightning_pat.load_pretrained."
        )


def load_causal_lm(source: str | Path, *, what: str, **options: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(source, trust_remote_code=False, **options)`` after the folder check.

    Raises:
        ValueError: If the folder asks for its own code (see :func:`refuse_remote_code`).
    """
    from transformers import AutoModelForCausalLM

    return load_hf_class(AutoModelForCausalLM, source, what=what, **options)


def load_tokenizer(source: str | Path, *, what: str, **options: Any) -> Any:
    """``AutoTokenizer.from_pretrained(source, trust_remote_code=False, **options)`` after the folder check.

    Raises:
        ValueError: If the folder asks for its own code (see :func:`refuse_remote_code`).
    """
    from transformers import AutoTokenizer

    return load_hf_class(AutoTokenizer, source, what=what, **options)


def load_hf_class(cls: Any, source: str | Path, *, what: str, **options: Any) -> Any:
    """``cls.from_pretrained(source, trust_remote_code=False, **options)`` after the folder check.

    Args:
        cls: A transformers class with ``from_pretrained`` (an auto class or a model class).
        source: A directory or a model id.
        what: The caller, for the messages.
        **options: Passed to ``from_pretrained`` (``trust_remote_code`` may not be among them).

    Raises:
        ValueError: If the folder asks for its own code, or transformers refuses a model id that needs it.
    """
    if "trust_remote_code" in options:
        raise ValueError(f"{what}: trust_remote_code is always False in lightning_pat; it cannot be passed.")
    refuse_remote_code(source, what=what)
    try:
        return cls.from_pretrained(source, trust_remote_code=False, **options)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"{what}: {source} needs Python code from its repository (transformers: {err}); lightning_pat never "
            "runs code from a folder or a repository (trust_remote_code=False)."
        ) from err


def _known_model_type(model_type: object) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _known_tokenizer(name: object) -> bool:
    import transformers

    if not isinstance(name, str):
        return False
    return isinstance(getattr(transformers, name, None), type) or isinstance(
        getattr(transformers, name.removesuffix("Fast"), None), type
    )
