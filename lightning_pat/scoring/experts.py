"""Data scores of whole routed experts: REAP's router-weighted output norm, its sum over tokens, router frequency.

For an expert cluster (a fused experts module's dim 0 with its router rows, see
:func:`lightning_pat.presets.experts.moe`), the score of expert ``e`` is, over the tokens ``X_e`` that the router
sends to ``e`` (calibration batches, or the training tokens of a run),

* ``"reap"`` (Lasby et al., 2025, REAP): ``mean over X_e of g_e(x) * ||f_e(x)||``, the router weight ``g_e`` times
  the norm of the expert's output ``f_e``; an expert that no token reaches scores 0;
* ``"reap_sum"``: ``sum over X_e of g_e(x) * ||f_e(x)||`` (``reap * frequency``): what the expert adds over all the
  tokens, so that an expert that few tokens use counts for less (BENCHMARKS.md, "Expert scores");
* ``"frequency"``: ``|X_e|``, how often the router picks ``e``.

Scores are float64 and rank the experts of one cluster (lowest dropped first). :func:`expert_scores` computes them on
calibration batches (what :func:`lightning_pat.prune_clusters` uses for expert clusters when it is given
``calibration``); :class:`ExpertStats` collects the same sums from the training forwards of a run (the callback's
``expert_score``), as a :class:`~lightning_pat.scoring.collector.Collector` of the state's ``expert_scores`` entry.

Both read one call of the fused experts module through a forward hook (:class:`ExpertStats`: a forward pre-hook,
where FSDP2 has gathered the experts' weights): its hidden states, top-k index and top-k
weights (the router's output as the block passes it on; the masked model routes around dropped experts, see
:mod:`lightning_pat.core.routing`, so a dropped expert receives no token). ``||f_e(x)||`` is the expert's output
recomputed in the hook without grad from the module's own weights (:func:`expert_output`): the routed tokens go
through each expert once more, the model runs no extra forward; ``"frequency"`` reads only the index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.core.state_fields import FieldChecker
from lightning_pat.parallel.comm import dtensor
from lightning_pat.scoring.collector import SummedStats, entries
from lightning_pat.scoring.hooks import TrainingForwardHooks, run_batches

#: The data scores of an expert (see the module docs).
ExpertScore = Literal["reap", "reap_sum", "frequency"]
EXPERT_DATA_SCORES: tuple[str, ...] = ("reap", "reap_sum", "frequency")


def _in_projection(module: nn.Module) -> str | None:
    """The name of a fused experts module's 3-D in-projection: ``gate_up_proj``, or ``up_proj`` (gate-less experts)."""
    params = module._parameters  # noqa: SLF001 - this module's own parameters
    down = params.get("down_proj")
    if not isinstance(down, Tensor) or down.dim() != 3:
        return None
    found = [a for a in ("gate_up_proj", "up_proj") if isinstance(t := params.get(a), Tensor) and t.dim() == 3]
    if found == ["up_proj"] and set(params) - {"up_proj", "down_proj", "up_proj_bias", "down_proj_bias"}:
        return None  # a gate of its own (Inkling's shared experts' gate_proj), not a gate-less experts module
    return found[0] if len(found) == 1 else None


def expert_modules(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> dict[str, nn.Module]:
    """Cluster name -> the fused experts module whose experts are the cluster's units (its in-projection on dim 0)."""
    owners = {
        f"{name}.{up}" if name else up: module
        for name, module in model.named_modules()
        if (up := _in_projection(module)) is not None
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
    Gate-less experts (Nemotron-H, Ergo) hold ``up_proj`` (``(E, I, H)``, transposed ``(E, H, I)``) and apply
    ``act_fn`` to it alone; a per-expert norm after the expert (Ergo's ``post_expert_norm``, called with the expert
    ids) is part of its output.
    """
    params = module._parameters  # noqa: SLF001 - this module's own parameters
    name = _in_projection(module) or "gate_up_proj"
    gate_up: Tensor = params[name]  # type: ignore[assignment]
    down: Tensor = params["down_proj"]  # type: ignore[assignment]
    parts = 2 if name == "gate_up_proj" else 1
    flag = getattr(module, "is_transposed", None)  # else from the shapes: (E, H, 2I) and (E, I, H) (Llama 4)
    transposed = flag is True or (flag is None and down.shape[1] * parts == gate_up.shape[2])
    h = x_TH @ gate_up[e] if transposed else nn.functional.linear(x_TH, gate_up[e])
    if params.get(f"{name}_bias") is not None:
        h = h + params[f"{name}_bias"][e]  # type: ignore[index]
    apply_gate = getattr(module, "_apply_gate", None)
    if parts == 1:
        h = module.act_fn(h)  # type: ignore[operator]
    elif callable(apply_gate):
        h = apply_gate(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        h = module.act_fn(gate) * up  # type: ignore[operator]
    out = h @ down[e] if transposed else nn.functional.linear(h, down[e])
    if params.get("down_proj_bias") is not None:
        out = out + params["down_proj_bias"][e]  # type: ignore[index]
    norm = getattr(module, "post_expert_norm", None)
    if isinstance(norm, nn.Module):  # Ergo: each expert's own RMSNorm scale, indexed by the expert ids
        out = norm(out, torch.full(out.shape[:1], e, dtype=torch.long, device=out.device))
    return out


#: Keyword names of a fused experts forward's (hidden states, top-k index, top-k weights), gpt-oss's included.
_ARGS = ("hidden_states", "top_k_index", "router_indices", "top_k_weights", "routing_weights")


def observe_call(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    sums_E: Tensor,
    counts_E: Tensor,
    *,
    norms: bool,
) -> bool:
    """Add one call of a fused experts module to its per-expert sums (in place); ``False`` if it has no top-k.

    Args:
        module: The fused experts module.
        args: The call's positional arguments (hidden states, top-k index, top-k weights).
        kwargs: Its keyword arguments (:data:`_ARGS` names them, gpt-oss's included).
        sums_E: ``[E]`` float64: ``g_e(x) * ||f_e(x)||`` summed over the tokens routed to ``e`` (``norms``).
        counts_E: ``[E]`` float64: the tokens routed to ``e``.
        norms: Whether to compute the expert outputs (``False``: only the counts, for ``"frequency"``).

    Returns:
        Whether the call was read: ``False`` for an experts forward that gets no top-k (Llama 4's runs every
        expert on pre-scaled tokens).
    """
    values = list(args) + [kwargs[k] for k in _ARGS if k in kwargs]
    if len(values) < 3 or not all(isinstance(v, Tensor) for v in values[:3]):
        return False
    h_TH, index_TK, weights_TK = (v.detach() for v in values[:3])
    h_TH = h_TH.reshape(-1, h_TH.shape[-1])
    index_TK = index_TK.reshape(h_TH.shape[0], -1)
    weights_TK = weights_TK.reshape(h_TH.shape[0], -1)
    for e in range(counts_E.numel()):
        hit_TK = index_TK == e
        tokens_T = hit_TK.any(dim=-1)
        num = int(tokens_T.sum())
        if num == 0:
            continue
        counts_E[e] += num
        if not norms:
            continue
        out = expert_output(module, h_TH[tokens_T], e)
        g = (weights_TK * hit_TK).sum(dim=-1)[tokens_T]
        sums_E[e] += (g.double() * out.double().norm(dim=-1)).sum().to(sums_E.device)
    return True


def rank_scores(sums_E: Tensor, counts_E: Tensor, kind: ExpertScore) -> Tensor:
    """The ``kind`` scores of one cluster's experts from their sums and token counts (see the module docs).

    Example::

        >>> rank_scores(torch.tensor([6.0, 0.0, 2.0]), torch.tensor([3.0, 0.0, 4.0]), "reap").tolist()
        [2.0, 0.0, 0.5]
    """
    if kind == "frequency":
        return counts_E.clone()
    if kind == "reap_sum":
        return sums_E.clone()
    return sums_E / counts_E.clamp(min=1.0)


def _hook(sums_E: Tensor, counts_E: Tensor, kind: ExpertScore, unrouted: list[bool]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        if not observe_call(module, args, kwargs, sums_E, counts_E, norms=kind != "frequency"):
            unrouted[0] = True

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
        kind: ``"reap"``, ``"reap_sum"`` or ``"frequency"``.
        forward: How to run a batch, if not ``model(batch)``.

    Returns:
        Cluster name -> ``[E]`` float64 scores.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    if kind not in EXPERT_DATA_SCORES:
        raise ValueError(f"`kind` must be one of {EXPERT_DATA_SCORES}, got {kind!r}; e.g. kind='reap'.")
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
    return {name: rank_scores(sums[name], counts[name], kind) for name in scored}


class ExpertStats(TrainingForwardHooks, SummedStats):
    """Per-expert token counts and router-weighted output norms from the training forwards of a run.

    A :class:`~lightning_pat.scoring.collector.SummedStats` of the state's ``expert_scores`` entry (only a run with
    expert clusters and a data ``expert_score`` writes it; a state without it starts empty). One forward pre-hook per
    fused experts module (:func:`expert_modules`) reads each training forward's routing (:func:`observe_call`); a
    batch's sums are kept once a real optimizer step applied it (the micro-batches of an accumulated step wait for
    it; a step that AMP skipped leaves its tokens to the next real step). At a selection the sums of every rank are
    added in rank order (:meth:`summed_scores`: one collective of the ``[2 E]`` score vectors, bitwise identical on
    every rank, so every rank drops the same experts), ranked by ``kind`` and started again: the score covers the
    training tokens since the previous selection. A dropped expert receives no token (the masked router skips it),
    scores 0 and stays dropped.

    Args:
        model: The model the clusters were resolved against.
        clusters: The resolved clusters; those whose units are fused routed experts are scored.
        kind: ``"reap_sum"``, ``"reap"`` or ``"frequency"`` (see the module docs).

    Raises:
        ValueError: If ``kind`` is unknown.

    Example::

        >>> from lightning_pat.core.spec import Cluster, resolve_clusters
        >>> net = nn.Linear(2, 2)
        >>> stats = ExpertStats(net, resolve_clusters(net, [Cluster("c", writers=["weight"])]), kind="reap")
        >>> stats.modules, stats.summed_scores()
        ({}, None)
    """

    key: ClassVar[str] = "expert_scores"
    saved_when_unused: ClassVar[bool] = False

    def __init__(self, model: nn.Module, clusters: Sequence[ResolvedCluster], *, kind: ExpertScore) -> None:
        super().__init__()
        if kind not in EXPERT_DATA_SCORES:
            raise ValueError(f"`expert_score` must be one of {EXPERT_DATA_SCORES} for data scores, got {kind!r}.")
        self.kind: ExpertScore = kind
        self.modules: dict[str, nn.Module] = expert_modules(model, clusters)  # cluster name -> fused experts module
        self.units: dict[str, int] = {rc.name: rc.num_units for rc in clusters if rc.name in self.modules}
        self._sum: dict[str, Tensor] = {}  # cluster name -> [E] float64, kept (real optimizer steps)
        self._count: dict[str, Tensor] = {}
        self._pending: dict[str, tuple[Tensor, Tensor]] = {}  # this batch's (and its accumulation's) sums
        self._unrouted: set[str] = set()  # experts modules called without a top-k (the weights rank them)
        self._problem: dict[str, str] = {}  # cluster name -> why its experts' outputs cannot be computed here
        self.last: dict[str, Tensor] = {}  # cluster name -> the scores used at the latest selection (for reports)

    # ------------------------------------------------------------------ collection
    def hooked_modules(self) -> Mapping[str, nn.Module]:
        """Cluster name -> its fused experts module."""
        return self.modules

    def register_hook(self, name: str, module: nn.Module) -> Any:
        """A forward pre-hook (arguments with keywords) on the experts module of cluster ``name``.

        Before the forward, not after it: under FSDP2 with ``fully_shard`` on the experts module itself, its
        parameters are whole only between FSDP2's pre-forward hook (registered first, ahead of every other) and its
        post-forward hook (which shards them again before any later forward hook). With ``fully_shard`` on the
        decoder layer around it, they are whole throughout the layer's forward.
        """
        return module.register_forward_pre_hook(self._hook(name), with_kwargs=True)

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.training_forward(name, module):
                self.observe(name, module, args, kwargs)

        return hook

    @torch.no_grad()
    def observe(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Add one call of cluster ``name``'s experts module to the pending sums (kept at the next real step)."""
        norms = self.kind != "frequency"
        if norms and any(dtensor.is_dtensor(p) for p in module.parameters(recurse=False)):
            self._problem.setdefault(
                name, "its experts' weights are sharded (DTensors: tensor or expert parallel over the experts) when "
                "its forward runs, so their outputs cannot be recomputed there (FSDP2 alone gathers them for the "
                "forward: supported)",
            )  # fmt: skip
            return
        if name not in self._pending:
            first = next(module.parameters(recurse=False), None)
            device = torch.device("cpu") if first is None else first.device
            zeros = torch.zeros(self.units[name], dtype=torch.float64, device=device)
            self._pending[name] = (zeros, zeros.clone())
        sums, counts = self._pending[name]
        if not observe_call(module, args, kwargs, sums, counts, norms=norms):
            self._unrouted.add(name)

    def end_batch(self, *, stepped: bool) -> None:
        """The batch is over: with a real optimizer ``stepped``, keep the pending sums (else they wait for it)."""
        super().end_batch(stepped=stepped)
        if not stepped:
            return
        for name, (sums, counts) in self._pending.items():
            if name in self._sum:
                self._sum[name] += sums.to(self._sum[name].device)
                self._count[name] += counts.to(self._count[name].device)
            else:
                self._sum[name], self._count[name] = sums, counts
        self._pending = {}

    def reset(self) -> None:
        """Forget the sums (a selection consumed them, or a new run starts)."""
        self._sum, self._count, self._pending, self._unrecomputed = {}, {}, {}, {}

    def seen(self) -> dict[str, int]:
        """Cluster name -> tokens routed (top-k slots) since the last selection on this rank, kept sums only."""
        return {name: n for name, c in self._count.items() if (n := int(c.sum()))}

    # ------------------------------------------------------------------ scores
    @property
    def scored(self) -> bool:
        """Whether the model has fused experts to score (else a selection sums nothing and reads no scores)."""
        return bool(self.units)

    def stacked(self) -> Tensor:
        """``[2 sum(E)]`` float64: every cluster's per-expert sums, then its token counts (0 where none)."""
        device = next((t.device for t in self._sum.values()), torch.device("cpu"))
        parts = [
            self._sum.get(name, torch.zeros(n, dtype=torch.float64, device=device)).to(device)
            for name, n in self.units.items()
        ]
        parts += [
            self._count.get(name, torch.zeros(n, dtype=torch.float64, device=device)).to(device)
            for name, n in self.units.items()
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def scores(self, summed: Tensor | None = None) -> dict[str, Tensor] | None:
        """Cluster name -> ``[E]`` float64 ``kind`` scores; ``None`` if no expert saw a training token.

        Experts modules called without a top-k (Llama 4's) are left out: the weights rank their experts (``{}`` if
        every one is).

        Args:
            summed: :meth:`stacked` summed over ranks; ``None`` uses this rank's sums.

        Raises:
            ValueError: If the experts' outputs could not be computed in the hook (sharded weights).
        """
        if self._problem:
            name, why = next(iter(self._problem.items()))
            raise ValueError(
                f"Cluster {name!r}: expert_score={self.kind!r} scores an expert by its router-weighted output norm, "
                f"but {why}. Use expert_score='frequency' (the tokens routed to each expert) or 'weight'."
            )
        summed = self.stacked() if summed is None else summed
        total = sum(self.units.values())
        if summed.shape != (2 * total,):
            raise ValueError(f"`summed` must have shape ({2 * total},) (see stacked()), got {tuple(summed.shape)}.")
        summed = summed.cpu()
        if self._unrouted.issuperset(self.units):  # no experts module gets a top-k (Llama 4's): the weights rank
            return {}
        if not bool((summed[total:] > 0).any()):
            return None
        out, at = {}, 0
        for name, n in self.units.items():
            sums, counts = summed[at : at + n], summed[total + at : total + at + n]
            at += n
            if name not in self._unrouted:
                out[name] = rank_scores(sums, counts, self.kind)
        self.last = {name: s.clone() for name, s in out.items()}
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's kept sums since the last selection, as exact floats: ``{"sum": {name: [..]}, "count": ..}``."""
        return {
            "sum": {name: v.tolist() for name, v in self._sum.items()},
            "count": {name: v.tolist() for name, v in self._count.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (clusters unknown to this model are ignored)."""
        self.reset()
        for name, values in state.get("sum", {}).items():
            module = self.modules.get(name)
            if module is None:
                continue
            first = next(module.parameters(recurse=False), None)
            device = torch.device("cpu") if first is None else dtensor.local_tensor(first).device
            counts = state.get("count", {}).get(name, [0.0] * len(values))
            self._sum[name] = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
            self._count[name] = torch.tensor([float(v) for v in counts], dtype=torch.float64, device=device)

    @classmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: ExpertStats | None) -> None:
        """Check a saved ``expert_scores`` entry; with ``held``, against its clusters and their expert counts.

        Per rank: per cluster, the sums and token counts (finite numbers, not negative) of its experts.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        units = None if held is None else held.units
        for where, entry in entries(raw, check, cls.key):
            lengths: dict[str, int] = {}
            for part in ("sum", "count"):
                values = check.mapping(entry.get(part, {}), f"{where}.{part}") or {}
                check.names(values, units, f"{where}.{part}", "expert clusters")
                for name, row in values.items():
                    at = f"{where}.{part}[{name!r}]"
                    items = check.sequence(row, at)
                    want = lengths.setdefault(name, len(items)) if units is None else units[name]
                    if len(items) != want:
                        raise check.fail(at, f"must hold {want} numbers (one per expert), got {len(items)}")
                    for value in items:
                        check.real(value, at, low=0.0)
