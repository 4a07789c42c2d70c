"""The ``tiny_gpt`` preset: cluster declarations of the demo's :class:`~lightning_pat.demo.model.TinyGPT`.

Importing ``lightning_pat.demo`` registers it (:func:`lightning_pat.presets.register`), so ``clusters="tiny_gpt"``
works in the callback, ``prune_clusters``, the CLI's YAML files and ``clusters="auto"`` for a TinyGPT (building a
TinyGPT imports the demo).
"""

from __future__ import annotations

from torch import nn

from lightning_pat import presets
from lightning_pat.core.spec import Cluster

#: TinyGPT is Llama-like: ``layers.N.attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``attn_norm``, ``mlp_norm``.
LAYOUT = presets.llama_like("tiny_gpt", attn="attn", norms="(?:attn_norm|mlp_norm)", embed="embed")


def tiny_gpt(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = True,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = False,
) -> list[Cluster]:
    """Clusters of :class:`~lightning_pat.demo.model.TinyGPT` (same kinds as :func:`lightning_pat.presets.llama`).

    Args:
        model: The model, or a module that holds exactly one TinyGPT.
        mlp: Add ``mlp.{layer}``.
        heads: Add ``heads.{layer}``.
        residual: Add ``residual``.
        layers: Add ``layer.{layer}`` (see :func:`lightning_pat.presets.layer_units`).
        query_heads: A ``heads`` unit is one query head inside its KV group (see :func:`lightning_pat.presets.llama`);
            off by default here, so that the demo's numbers stay those of whole query groups.

    Returns:
        The declarations, in the order mlp, heads, residual, layers.

    Raises:
        ValueError: As for :func:`lightning_pat.presets.llama`.
    """
    return presets.build(LAYOUT, model, mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads)


presets.register("tiny_gpt", tiny_gpt, layout=LAYOUT)
