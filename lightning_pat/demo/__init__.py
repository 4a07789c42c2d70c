"""The demo, not the library: TinyGPT (``model``), its byte-level data and Lightning modules (``task``)."""

from lightning_pat.demo.model import MLP, Attention, Block, TinyGPT, TinyGPTConfig
from lightning_pat.demo.task import (
    ByteWindows,
    CausalLMModule,
    StdlibText,
    TinyGPTModule,
    fully_shard_blocks,
    stdlib_bytes,
    stdlib_sources,
)

__all__ = [
    "Attention",
    "Block",
    "ByteWindows",
    "CausalLMModule",
    "MLP",
    "StdlibText",
    "TinyGPT",
    "TinyGPTConfig",
    "TinyGPTModule",
    "fully_shard_blocks",
    "stdlib_bytes",
    "stdlib_sources",
]
