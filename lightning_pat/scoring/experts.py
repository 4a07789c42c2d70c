"""Data scores of whole routed experts from calibration batches: REAP's router-weighted output norm, router frequency.

For an expert cluster (a fused experts module's dim 0 with its router rows, see
:func:`lightning_pat.presets.experts.moe`), the score of expert ``e`` is, over the calibration tokens ``X_e`` that the
router sends to ``e``,

* ``"reap"`` (Lasby et al., 2025, REAP): ``mean over X_e of g_e(x) * ||f_e(x)||``, the router weight ``g_e`` times
  the norm of the expert's output ``f_e``; an expert that no token reaches scores 0;
* ``"frequency"``: ``|X_e|``, how often the router picks ``e``.

Scores are float64 and rank the experts of one cluster (lowest dropped first); they are what
:func:`lightning_pat.prune_clusters` uses for expert clusters when it is given ``calibration`` batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.scoring.hooks import run_batches

ExpertScore = Literal["reap", "frequency"]


def expert_modules(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> dict[str, nn.Module]:
    """Cluster name -> the fused experts module whose experts are the cluster's units (``gate_up_proj`` on dim 0)."""
    owners = {
        f"{name}.gate_up_proj" if name else "gate_up_proj": module
        for name, module in model.named_modules()
        if isinstance(module._parameters.get("gate_up_proj"), Tensor)  # noqa: SLF001 - this module's own parameter
        and isinstance(module._parameters.get("down_proj"), Tensor)  # noqa: SLF001
        and module._parameters["gate_up_proj"].dim() == 3  # noqa: SLF001
    }
    out = {}
    for rc in clusters:
        found = [owners[m.name] for m in rc.members if m.dim == 0 and m.name in owners]
        if found:
            out[rc.name] = found[0]
    return out


def expert_output(module: nn.Module, x_TH: Tensor, e: int) -> Tensor:
    """Expert ``e``'s output on tokens ``x_TH``, as the fused experts module computes it.

    ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, or transposed (``is_transposed``, gpt-oss:
    ``(E, H, 2I)`` and ``(E, I, H)``), with their biases where the module has them; the gate is the module's own
    ``_apply_gate`` (transformers' experts: halves or interleaved, its activation), else ``act_fn`` on the first half.
    """
    params = module._parameters  # noqa: SLF001 - this module's own parameters
    gate_up: Tensor = params["gate_up_proj"]  # type: ignore[assignment]
    down: Tensor = params["down_proj"]  # type: ignore[assignment]
    flag = getattr(module, "is_transposed", None)  # else from the shapes: (E, H, 2I) and (E, I, H) (Llama 4)
    transposed = flag is True or (flag is None and down.shape[1] * 2 == gate_up.shape[2])
    h = x_TH @ gate_up[e] if transposed else nn.functional.linear(x_TH, gate_up[e])
    if params.get("gate_up_proj_bias") is not None:
        h = h + params["gate_up_proj_bias"][e]  # type: ignore[index]
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        h = apply_gate(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        h = module.act_fn(gate) * up  # type: ignore[operator]
    out = h @ down[e] if transposed else nn.functional.linear(h, down[e])
    if params.get("down_proj_bias") is not None:
        out = out + params["down_proj_bias"][e]  # type: ignore[index]
    return out


#: Keyword names of a fused experts forward's (hidden states, top-k index, top-k weights), gpt-oss's included.
_ARGS = ("hidden_states", "top_k_index", "router_indices", "top_k_weights", "routing_weights")


def _hook(sums_E: Tensor, counts_E: Tensor, kind: ExpertScore, unrouted: list[bool]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        values = list(args) + [kwargs[k] for k in _ARGS if k in kwargs]
        if len(values) < 3 or not all(isinstance(v, Tensor) for v in values[:3]):
            unrouted[0] = True  # an experts forward that gets no top-k (Llama 4's: every expert, pre-scaled tokens)
            return
        h_TH, index_TK, weights_TK = values[:3]
        h_TH = h_TH.reshape(-1, h_TH.shape[-1])
        for e in range(sums_E.numel()):
            hit_TK = index_TK == e
            tokens_T = hit_TK.any(dim=-1)
            num = int(tokens_T.sum())
            if num == 0:
                continue
            counts_E[e] += num
            if kind == "frequency":
                continue
            out = expert_output(module, h_TH[tokens_T], e)
            g = (weights_TK * hit_TK).sum(dim=-1)[tokens_T]
            sums_E[e] += (g.double() * out.double().norm(dim=-1)).sum().to(sums_E.device)

    return hook


def expert_scores(
    model: nn.Module,
    clusters: Sequence[ResolvedCluster],
    batches: Iterable[Any],
    *,
    kind: ExpertScore = "reap",
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, Tensor]:
    """Score the experts of every expert cluster on ``batches`` (see the module docs).

    Args:
        model: The model the clusters were resolved against.
        clusters: The resolved clusters; those whose units are no fused experts, or whose experts module is not called
            with a top-k index and weights (Llama 4's runs every expert), are left out of the result.
        batches: Calibration inputs, each run as ``model(batch)`` (or ``forward(model, batch)``), without grad.
        kind: ``"reap"`` or ``"frequency"``.
        forward: How to run a batch, if not ``model(batch)``.

    Returns:
        Cluster name -> ``[E]`` float64 scores.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    if kind not in ("reap", "frequency"):
        raise ValueError(f"`kind` must be 'reap' or 'frequency', got {kind!r}.")
    modules = expert_modules(model, clusters)
    if not modules:
        return {}  # no calibration forward for a model without expert clusters
    by_name: Mapping[str, ResolvedCluster] = {rc.name: rc for rc in clusters}
    sums = {name: torch.zeros(by_name[name].num_units, dtype=torch.float64) for name in modules}
    counts = {name: torch.zeros(by_name[name].num_units, dtype=torch.float64) for name in modules}
    unrouted = {name: [False] for name in modules}
    handles = [
        module.register_forward_hook(_hook(sums[name], counts[name], kind, unrouted[name]), with_kwargs=True)
        for name, module in modules.items()
    ]
    try:
        run_batches(model, batches, forward=forward)
    finally:
        for handle in handles:
            handle.remove()
    scored = [name for name in modules if not unrouted[name][0]]  # the others: no data score (the weights rank them)
    if kind == "frequency":
        return {name: counts[name] for name in scored}
    return {name: sums[name] / counts[name].clamp(min=1.0) for name in scored}
