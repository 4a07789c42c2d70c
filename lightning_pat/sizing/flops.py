"""FLOPs per token as a size: the cost model that lets the size solver meet ``target_flops`` (no Lightning here).

The solver of :mod:`lightning_pat.sizing.solver` counts the product of each tensor's dims, with every clustered dim
at its kept width. FLOPs per token of a decoder fit that model exactly:

* every weight used in a matmul (``nn.Linear``, GPT-2's ``Conv1D``, a tied ``lm_head`` once) costs ``2 * out * in``:
  it enters with a trailing dim of 2;
* attention scores and the weighted values cost ``2 * S * q`` each per token per layer (``S`` the sequence length,
  ``q`` the query channels, ``n_heads * head_dim``): a pseudo-tensor ``<q weight>#attention`` of shape ``(q, 4 S)``
  whose first dim follows the query channels' clusters (a GQA group carries its query heads);
* fused routed experts (``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``) cost ``2 * top_k`` times one
  expert's weights per token, whatever the number of experts kept (pseudo-tensors ``<weight>#active`` whose dims
  follow the experts' channel and hidden clusters); the router costs ``2 * E * H``;
* embedding lookups, biases, norms, activations and softmax cost nothing (what ``FlopCounterMode`` counts).

Attention is recognised as a module with ``nn.Linear`` ``q_proj`` and an int ``head_dim`` (Llama family, TinyGPT)
or GPT-2's packed ``c_attn`` with an int ``split_size``; the score FLOPs of any other attention are not counted.
The count is the full ``S x S`` score matrix (as ``FlopCounterMode`` counts a causal forward), a dropped layer
removes its FLOPs with its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_pat.core.spec import ResolvedCluster

#: Suffix of the pseudo-tensors that carry the attention FLOPs of one layer.
ATTENTION = "#attention"
#: Suffix of the pseudo-tensors that carry the FLOPs of a layer's active routed experts.
ACTIVE = "#active"
Axes = dict[tuple[str, int], list[tuple[str, int, int]]]


def _shape(weight: object) -> tuple[int, ...]:
    if not isinstance(weight, Tensor):
        raise TypeError(f"expected a weight tensor, found {type(weight).__name__}")
    return tuple(weight.shape)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def flop_costs(
    model: nn.Module, clusters: Sequence[ResolvedCluster], *, seq_len: int
) -> tuple[dict[str, tuple[int, ...]], Axes]:
    """The solver's ``shapes`` for FLOPs per token, and the axes of the attention pseudo-tensors.

    Args:
        model: The model (its modules tell matmul weights from lookups and find the attention).
        clusters: The resolved clusters (their members on the query channels give the attention axes).
        seq_len: The sequence length ``S`` the attention FLOPs are counted for.

    Returns:
        ``(shapes, axes)``: name -> dims whose product is the FLOPs per token (matmul weights under the first name
        of their tensor, as cluster members are named); the ``(pseudo-tensor, 0)`` axes to add to the solver's.

    Raises:
        ValueError: If ``seq_len`` is not a positive int.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"`seq_len` (the sequence length FLOPs are counted for) must be an int >= 1, got {seq_len!r}.")
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    shapes: dict[str, tuple[int, ...]] = {}
    queries: list[tuple[str, int, int]] = []  # (weight name, dim of the query channels, their number)
    for module in model.modules():
        if isinstance(module, nn.Linear) or _is_conv1d(module):
            shapes[first[id(module.weight)]] = (*_shape(module.weight), 2)
        q_proj = getattr(module, "q_proj", None)
        if isinstance(q_proj, nn.Linear) and isinstance(getattr(module, "head_dim", None), int):
            queries.append((first[id(q_proj.weight)], 0, q_proj.out_features))
        c_attn = getattr(module, "c_attn", None)
        split = getattr(module, "split_size", None)
        if c_attn is not None and _is_conv1d(c_attn) and isinstance(split, int):
            queries.append((first[id(c_attn.weight)], 1, split))
    axes: Axes = {}
    _experts(model, clusters, first, shapes, axes)
    for weight, dim, width in queries:
        pseudo = weight + ATTENTION
        shapes[pseudo] = (width, 4 * seq_len)
        axes[(pseudo, 0)] = [
            (rc.name, m.block, m.stop - m.start)
            for rc in clusters
            for m in rc.members
            if m.name == weight and m.dim == dim and m.start < width
        ]
    return shapes, axes


def _experts(
    model: nn.Module,
    clusters: Sequence[ResolvedCluster],
    first: dict[int, str],
    shapes: dict[str, tuple[int, ...]],
    axes: Axes,
) -> None:
    """Fused routed experts: each token runs ``top_k`` experts, so their FLOPs do not depend on the expert count."""
    for block in model.modules():
        experts = getattr(block, "experts", None)
        params = experts._parameters if isinstance(experts, nn.Module) else {}  # noqa: SLF001 - its own tensors
        routers = [getattr(block, n) for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module)]
        router = routers[0] if routers else None
        top_k = getattr(router, "top_k", None)
        weights = [params.get("gate_up_proj", params.get("up_proj")), params.get("down_proj")]  # up_proj: no gate
        if not isinstance(top_k, int) or not all(isinstance(w, Tensor) and w.dim() == 3 for w in weights):
            continue
        for weight in weights:
            name = first[id(weight)]
            pseudo = name + ACTIVE
            shapes[pseudo] = (*_shape(weight)[1:], 2 * top_k)
            for dim in (1, 2):  # the channel and hidden axes follow their clusters; the expert axis is not counted
                axes[(pseudo, dim - 1)] = [
                    (rc.name, m.block, m.stop - m.start) for rc in clusters for m in rc.members
                    if m.name == name and m.dim == dim
                ]  # fmt: skip
        assert router is not None  # top_k is an int
        router_weight = router._parameters.get("weight")  # noqa: SLF001
        if isinstance(router_weight, Tensor) and not isinstance(router, nn.Linear):
            shapes[first[id(router_weight)]] = (*_shape(router_weight), 2)


def check_flops(target_flops: object, seq_len: object) -> None:
    """``target_flops`` and ``seq_len`` go together; ``seq_len`` is a positive int.

    Raises:
        ValueError: If one is given without the other, or ``seq_len`` is not an int >= 1.
    """
    if (target_flops is None) != (seq_len is None):
        raise ValueError(
            "`target_flops` (FLOPs per token) depends on the sequence length through attention: give `seq_len` "
            f"with it, and neither without the other; got target_flops={target_flops!r}, seq_len={seq_len!r}."
        )
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"`seq_len` (the sequence length FLOPs are counted for) must be an int >= 1, got {seq_len!r}.")


def count_flops(model: nn.Module, *, seq_len: int) -> int:
    """FLOPs per token of ``model`` by the cost model above (no cluster shrunk: its current widths).

    Raises:
        ValueError: If ``seq_len`` is not a positive int.
    """
    shapes, _ = flop_costs(model, (), seq_len=seq_len)
    total = 0
    for shape in shapes.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


__all__ = ["ACTIVE", "ATTENTION", "check_flops", "count_flops", "flop_costs"]
