"""The demo, not the library: TinyGPT (``model``), its preset, data and Lightning modules (``task``).

Importing it registers the ``tiny_gpt`` preset (``preset``).
"""

from lightning_pat.demo import preset
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
    "preset",
    "stdlib_bytes",
    "stdlib_sources",
]
