"""A tiny pretrained-LM directory for the front door's tests: a random GQA Llama and a byte-level BPE tokenizer
trained here on one standard-library file (no download, a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch


def tiny_lm_dir(root: Path, *, vocab: int = 320, layers: int = 2) -> Path:
    """Write ``root/tiny-lm`` (config, safetensors, tokenizer) once and return it."""
    out = root / "tiny-lm"
    if (out / "config.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator([Path(sysconfig.get_paths()["stdlib"], "abc.py").read_text()], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def code_files(root: Path, n: int = 12) -> list[str]:
    """``n`` small Python files under ``root`` (40 one-line functions each) for ``TextFiles``; their paths."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = root / f"f{i:02d}.py"
        path.write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(40)))
        paths.append(str(path))
    return paths


def fit_layouts(
    root: Path, template: str, layouts: Mapping[str, Sequence[str]], *, timeout: float
) -> dict[str, subprocess.CompletedProcess[str]]:
    """``lightning-pat fit`` of one CausalLM config per layout (the installed console script, one process each).

    ``template`` is a YAML config with ``{model}``, ``{export}`` (``root / <layout name>``) and ``{files}`` (four
    standard-library files) to fill; each layout's flags go on its command line.
    """
    from tests.common.processes import console_script

    model = tiny_lm_dir(root)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / name) for name in ("abc.py", "ast.py", "bisect.py", "calendar.py")]
    done = {}
    for name, flags in layouts.items():
        config = root / f"{name}.yaml"
        config.write_text(template.format(model=model, export=root / name, files=files))
        done[name] = subprocess.run(
            [console_script(), "fit", "--config", str(config), *flags], capture_output=True, text=True, cwd=root,
            timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    return done
