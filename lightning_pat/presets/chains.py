"""The ``linear_chain`` preset: one cluster per hidden axis between consecutive ``nn.Linear`` of an ``nn.Sequential``.

It cannot see ``forward``: it assumes an ``nn.Sequential`` runs its children in order.
"""

from __future__ import annotations

from torch import nn

from lightning_pat.core.spec import Cluster
from lightning_pat.presets.transformers import HOW_TO, check_flags

_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.CELU,
    nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink,
    nn.LogSigmoid, nn.Identity, nn.Dropout,
)  # fmt: skip


def linear_pairs(model: nn.Module) -> list[tuple[str, nn.Linear, str]]:
    """``(writer name, writer, reader name)`` for consecutive Linears in every ``nn.Sequential``."""
    pairs = []
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        prev: tuple[str, nn.Linear] | None = None
        for child_name, child in seq.named_children():
            name = f"{seq_name}.{child_name}" if seq_name else child_name
            if isinstance(child, nn.Linear):
                if prev is not None and prev[1].out_features == child.in_features:
                    pairs.append((prev[0], prev[1], name))
                prev = (name, child)
            elif not isinstance(child, _ELEMENTWISE):
                prev = None
    return pairs


def linear_chain(
    model: nn.Module,
    *,
    mlp: bool = True,
    heads: bool = False,
    residual: bool = False,
    layers: bool = False,
    query_heads: bool = False,
) -> list[Cluster]:
    """One cluster per hidden axis between consecutive ``nn.Linear`` layers of every ``nn.Sequential``.

    Linear ``i`` and the next Linear ``i+1`` in the same ``nn.Sequential`` are coupled when only elementwise modules
    (activations, ``Dropout``, ``Identity``) sit between them: Linear ``i`` rows and bias are writers, Linear ``i+1``
    columns the reader. Any other module (a norm, a nested container) breaks the chain. This assumes the Sequential
    runs its children in order and nothing else reads Linear ``i``'s output. With an activation where
    ``f(0) != 0`` (sigmoid, softplus) a pruned channel is a constant that the zero reader columns ignore.

    Args:
        model: Any module.
        mlp: Must be true (the hidden axes are the only kind here).
        heads: Must be false: a chain has no attention heads.
        residual: Must be false: a chain has no residual stream.
        layers: Must be false: a chain has no residual layers to skip.
        query_heads: Ignored (a chain has no attention).

    Returns:
        One ``Cluster`` per hidden axis, named ``hidden.<writer module name>``.

    Raises:
        ValueError: If an option is not a bool, ``mlp`` is false, ``heads``, ``residual`` or ``layers`` is true, or
            no pair of consecutive Linears exists.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [(c.name, c.writers, c.readers) for c in linear_chain(net)]
        [('hidden.0', ['0.weight', '0.bias'], ['2.weight'])]
    """
    check_flags("linear_chain", mlp=mlp, heads=heads, residual=residual, layers=layers, query_heads=query_heads)
    if not mlp or heads or residual or layers:
        raise ValueError(
            "presets.linear_chain: only the hidden axes (mlp=True) exist in a chain of nn.Linear; got "
            f"mlp={mlp}, heads={heads}, residual={residual}, layers={layers}. Declare other clusters by hand."
        )
    pairs = linear_pairs(model)
    if not pairs:
        raise ValueError(f"presets.linear_chain: no two consecutive nn.Linear layers in an nn.Sequential. {HOW_TO}")
    out = []
    for writer_name, writer, reader_name in pairs:
        writers = [f"{writer_name}.weight"] + ([f"{writer_name}.bias"] if writer.bias is not None else [])
        out.append(Cluster(f"hidden.{writer_name}", writers, [f"{reader_name}.weight"]))
    return out
