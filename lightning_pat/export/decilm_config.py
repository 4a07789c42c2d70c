"""The DeciLM (``nemotron-nas``) config class that a DeciLM export carries as ``configuration_decilm.py``.

Neither transformers nor vLLM registers the ``nemotron-nas`` model type: a DeciLM checkpoint names its config class
in ``config.json`` (``auto_map``), and ``trust_remote_code=True`` lets them import it from the checkpoint directory.
vLLM then builds its own ``DeciLMForCausalLM`` (vLLM's model registry), which reads ``block_configs[i].attention``
and ``.ffn`` as attributes. This file is that class, written for lightning_pat (it imports transformers only and is
copied verbatim into each DeciLM export); :func:`lightning_pat.load_pretrained` never imports it, it reads
``config.json`` as data.

The class accepts what lightning_pat writes and what NVIDIA's Nemotron checkpoints use: per block an ``attention``
section (``no_op``, ``replace_with_linear``, ``n_heads_in_group``) and an ``ffn`` section (``no_op``,
``replace_with_linear``, and ``intermediate_size`` or ``ffn_mult``). A section holds exactly the keys it was given:
vLLM tests ``hasattr(ffn, "ffn_mult")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig


class DeciSection:
    """One section of a block (``attention`` or ``ffn``): its keys as attributes, and back to a dict."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        """The keys and values given."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"DeciSection({self.__dict__})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeciSection) and other.__dict__ == self.__dict__


class DeciBlock:
    """One decoder block's configuration: ``attention`` and ``ffn`` sections."""

    def __init__(self, attention: Mapping[str, Any] | DeciSection, ffn: Mapping[str, Any] | DeciSection) -> None:
        self.attention = attention if isinstance(attention, DeciSection) else DeciSection(**dict(attention))
        self.ffn = ffn if isinstance(ffn, DeciSection) else DeciSection(**dict(ffn))

    def to_dict(self) -> dict[str, Any]:
        """``{"attention": {...}, "ffn": {...}}``."""
        return {"attention": self.attention.to_dict(), "ffn": self.ffn.to_dict()}

    def __repr__(self) -> str:
        return f"DeciBlock(attention={self.attention}, ffn={self.ffn})"


class DeciLMConfig(PretrainedConfig):  # type: ignore[no-untyped-call]  # transformers leaves __init_subclass__ untyped
    """A Llama config with one ``block_configs`` entry per decoder layer (``model_type`` ``nemotron-nas``)."""

    model_type = "nemotron-nas"

    def __init__(self, block_configs: list[Any] | None = None, **kwargs: Any) -> None:
        self.block_configs = [b if isinstance(b, DeciBlock) else DeciBlock(**dict(b)) for b in block_configs or []]
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (``block_configs`` as dicts, as in ``config.json``)."""
        out = super().to_dict()
        out["block_configs"] = [b.to_dict() if isinstance(b, DeciBlock) else b for b in self.block_configs]
        return out
