"""Tiny Llama models with a real byte-level BPE tokenizer, for the serving exports (GGUF, DeciLM, vLLM).

The tokenizer is trained here, offline, with the ``tokenizers`` library (deterministic), in the layout SmolLM2 and
GPT-2 use: byte-level pre-tokenizer and decoder, BPE merges, three special tokens first. The models are random
Llamas with head_dim 32 (vLLM's CPU attention takes it) whose weights are jittered so that greedy tokens differ
from step to step. ``TinyLlamaLM`` is a LightningModule with a ``tokenizer`` attribute, the contract of
``lightning_pat.lm.CausalLM``.
"""

from __future__ import annotations

import copy
import functools

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = [
    "def main():\n    return 42\n",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "import os, sys\nprint('hello world', 1234567890)",
    "for i in range(10):\n    total += i * i\n",
]
PROMPTS = ["def main():", "The capital of", "import os", "for i in range("]


@functools.cache
def _trained():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 10, trainer)
    return tok


def tokenizer():
    """A fresh ``PreTrainedTokenizerFast`` over the tiny BPE (BOS ``<|im_start|>``, EOS ``<|im_end|>``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(_trained()),
        bos_token=SPECIAL[1],
        eos_token=SPECIAL[2],
        unk_token=SPECIAL[0],
        pad_token=SPECIAL[2],
    )


def llama(
    *, layers: int = 3, hidden: int = 128, heads: int = 4, kv: int = 2, ffn: int = 192, tied: bool = True, vocab=None
):
    """A random ``LlamaForCausalLM`` (eval mode, jittered weights, fp32, eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab or _trained().get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Hugging Face ``generate`` greedily, ``n`` new tokens per prompt, EOS not stopping it."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), generation_config=config, attention_mask=torch.ones(1, len(p)))
            out.append(ids[0, len(p) :].tolist())
    return out


class TinyLlamaLM(pl.LightningModule):
    """A LightningModule around :func:`llama`, with the tokenizer as ``self.tokenizer`` (as ``lm.CausalLM`` has)."""

    def __init__(self, layers: int = 2, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = llama(layers=layers)
        self.tokenizer = tokenizer()
        ids = [self.tokenizer(t)["input_ids"][:12] for t in TEXT]
        self.data = torch.tensor([i + [2] * (12 - len(i)) for i in ids])

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=2)
