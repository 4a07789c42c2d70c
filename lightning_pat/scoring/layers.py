r"""Layer scores from training forwards: ``1 - cos(input, output)`` of each decoder layer (ShortGPT, ModelOpt).

A layer unit (``preset_options={"layers": True}``, see :func:`lightning_pat.presets.layer_units`) removes a whole
decoder layer. What a layer changes is measured on the residual stream: a forward hook on the layer's module (the
longest common module path of the cluster's members, e.g. ``model.layers.3``) takes the hidden state going in
(the first positional tensor, else ``hidden_states=``) and coming out (the output, or its first element) and adds,
per token ``t``, the cosine similarity::

    cos_t = <x_t, y_t> / sqrt(|x_t|^2 |y_t|^2)        (float32 dot products, float64 from the three per-token sums)

to a running float64 sum per layer, with the number of tokens. At a selection the sums of every rank are added in
rank order (one collective, bitwise identical on every rank), the score is ``1 - sum / count`` (0 for a layer that
changes nothing, up to 2), and the sums start again: the score covers the training forwards since the previous
selection. A layer that is exactly the identity has ``y_t == x_t``, every ``cos_t`` is exactly 1 (the float32 sums
are equal, their float64 product is exact) and its score exactly 0. A dropped layer is the identity in every later
forward (its output projections are zero), so it keeps score 0 and stays dropped, as in ShortGPT's iterative variant.

Tokens where both vectors are zero count as unchanged (``cos = 1``), where one is zero as orthogonal (``cos = 0``);
a token whose cosine is not finite (NaN/Inf hidden states) is left out of both sums. Only training forwards count
(grad enabled, and ``module.training`` or inside a training batch of the callback); a forward that activation
checkpointing recomputes during the backward is counted once. Hidden states that are DTensors are read through
their local shards when every token's hidden vector is whole on the rank (``Replicate`` or ``Shard`` on a token dim,
as sequence parallelism places them): tokens that several ranks hold are counted by each of them in the sum and in
the count alike, so the mean is unchanged. A hidden dim that is sharded, or a pending (``Partial``) sum, is refused
with a clear error at the next selection.

Cost per training forward and layer: three dot products over the hidden states (``3 N H`` multiply-adds, against
the layer's ``~24 N H^2``) and two numbers of state.

Legend: ``N`` tokens of the local batch, ``H`` the hidden size, ``L`` the layers scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lightning_pat.core.layers import is_layer_cluster, layer_prefix
from lightning_pat.core.spec import Cluster, ResolvedCluster, ensure_resolved
from lightning_pat.core.state_fields import FieldChecker
from lightning_pat.parallel.comm import dtensor
from lightning_pat.scoring.collector import SummedStats, entries
from lightning_pat.scoring.hooks import TrainingForwardHooks, run_batches


def token_cosines(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token ``cos(x_t, y_t)`` over the last dim, float64, and which tokens are finite (both ``[N]``).

    Args:
        x: The hidden states going into a layer, ``(..., H)``.
        y: The hidden states coming out, the same shape.

    Returns:
        ``(cos_N, finite_N)``: the cosines (0 where not finite) and the finite flags.

    Example::

        >>> x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
        >>> token_cosines(x, torch.tensor([[0.0, 2.0], [0.0, 0.0], [3.0, 4.0]]))[0].tolist()
        [0.0, 1.0, 1.0]
    """
    width = x.shape[-1]
    x_NH, y_NH = x.detach().reshape(-1, width), y.detach().reshape(-1, width)
    if x_NH.dtype not in (torch.float32, torch.float64):
        x_NH, y_NH = x_NH.float(), y_NH.float()
    xx, yy, xy = (torch.linalg.vecdot(a, b).double() for a, b in ((x_NH, x_NH), (y_NH, y_NH), (x_NH, y_NH)))
    denom = xx * yy
    both_zero = (xx == 0) & (yy == 0)
    cos = torch.where(denom > 0, xy / denom.sqrt(), both_zero.double()).clamp(-1.0, 1.0)
    finite = torch.isfinite(cos) & torch.isfinite(denom)
    return torch.where(finite, cos, 0.0), finite


def _hidden_pair(args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any) -> tuple[Tensor, Tensor] | str:
    """The (input, output) hidden states of a layer call, or why they cannot be read."""
    x = next((a for a in args if isinstance(a, Tensor)), None)
    if x is None:
        x = kwargs.get("hidden_states")
    y = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        return (
            f"its input is {type(x).__name__} and its output {type(output).__name__}; the first positional tensor "
            "(or `hidden_states=`) and the output (or its first element) must be the hidden states"
        )
    if x.shape != y.shape:
        return f"its input has shape {tuple(x.shape)} and its output {tuple(y.shape)}; they must be equal"
    if dtensor.is_dtensor(x) or dtensor.is_dtensor(y):
        places = getattr(x, "placements", None), getattr(y, "placements", None)
        kept = places[0]
        if kept is None or kept != places[1]:  # one of them is a DTensor, so not both are None
            return f"its input and output hidden states are placed differently ({places[0]} vs {places[1]})"
        last = x.ndim - 1
        if any(p.is_partial() or (p.is_shard() and p.dim in (last, -1)) for p in kept):
            return (
                f"its hidden states are placed as {kept}: a token's hidden vector is not whole on one rank "
                "(the hidden dim is sharded, or a sum is pending)"
            )
        return dtensor.local_tensor(x), dtensor.local_tensor(y)
    return x, y


class LayerStats(TrainingForwardHooks, SummedStats):
    r"""Running sums of ``cos(input, output)`` per layer unit's decoder layer, and the scores built from them.

    A :class:`~lightning_pat.scoring.collector.SummedStats` of the state's ``layer_scores`` entry: the ranks' sums since
    the last selection in rank order (each whole: a rank beyond the saved ones resumes rank 0's).

    Args:
        model: The module holding the clusters' parameters (names as in ``model.named_parameters()``).
        clusters: Resolved clusters; only the layer units (:func:`~lightning_pat.core.layers.is_layer_cluster`)
            are scored.

    Raises:
        ValueError: If a layer unit's members have no common module (so there is no layer to hook).

    Example::

        >>> from lightning_pat.core.spec import Cluster, resolve_clusters
        >>> net = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
        >>> rcs = resolve_clusters(net, [Cluster("layer.{i}", writers=["re:(?P<i>[ab])\.weight"], num_units=1,
        ...                                      budget="layers")])
        >>> stats = LayerStats(net, rcs)
        >>> stats.attach()
        >>> with torch.enable_grad():
        ...     _ = net["a"](torch.ones(3, 2))
        >>> sorted(stats.seen())
        ['layer.a']
    """

    key: ClassVar[str] = "layer_scores"

    def __init__(self, model: nn.Module, clusters: Sequence[ResolvedCluster]) -> None:
        super().__init__()
        modules = dict(model.named_modules(remove_duplicate=False))
        self.layers: dict[str, str] = {}  # cluster name -> module path
        self.modules: dict[str, nn.Module] = {}  # module path -> module, in cluster order
        for rc in clusters:
            if not is_layer_cluster(rc):
                continue
            path = layer_prefix(rc)
            module = modules.get(path)
            if not path or module is None:
                raise ValueError(
                    f"Cluster {rc.name!r}: a layer unit is scored by 1 - cos(input, output) of the module holding its "
                    f"members {[m.name for m in rc.members][:4]}, but they share no module (common path {path!r}). "
                    "Declare members of one layer, or use layer_score='weight'."
                )
            self.layers[rc.name] = path
            self.modules.setdefault(path, module)
        self._sum: dict[str, Tensor] = {}  # module path -> 0-d float64 sum of cosines (on the module's device)
        self._count: dict[str, Tensor] = {}  # module path -> 0-d float64 number of tokens
        self._problem: dict[str, str] = {}  # module path -> why its hidden states cannot be read
        self.last: dict[str, float] = {}  # cluster name -> the score used at the latest selection (for reports)

    # ------------------------------------------------------------------ collection
    def hooked_modules(self) -> Mapping[str, nn.Module]:
        """The layer modules."""
        return self.modules

    def register_hook(self, name: str, module: nn.Module) -> Any:
        """A forward hook (input and output) on layer module ``name``."""
        return module.register_forward_hook(self._hook(name), with_kwargs=True)

    def reset(self) -> None:
        """Forget the sums (a selection consumed them, or a new run starts)."""
        self._sum, self._count, self._problem, self._unrecomputed = {}, {}, {}, {}

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.training_forward(path, module):
                pair = _hidden_pair(args, kwargs, output)
                if isinstance(pair, str):
                    self._problem.setdefault(path, pair)
                else:
                    self.observe(path, *pair)

        return hook

    @torch.no_grad()
    def observe(self, path: str, x: Tensor, y: Tensor) -> None:
        """Add the per-token cosines of one call of layer module ``path`` (input ``x``, output ``y``) to its sums."""
        cos_N, finite_N = token_cosines(x, y)
        total, count = cos_N.sum(), finite_N.sum().double()
        if path in self._sum:
            self._sum[path] += total
            self._count[path] += count
        else:
            self._sum[path], self._count[path] = total, count

    def seen(self) -> dict[str, int]:
        """Cluster name -> tokens counted since the last selection on this rank (layers with none left out)."""
        return {c: n for c, p in self.layers.items() if p in self._count and (n := int(self._count[p]))}

    # ------------------------------------------------------------------ scores
    def stacked(self) -> Tensor:
        """``[2 L]`` float64: every layer module's sum of cosines, then its token count (0 where none)."""
        device = next((t.device for t in self._sum.values()), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = [self._sum.get(p, zero).to(device) for p in self.modules]
        counts = [self._count.get(p, zero).to(device) for p in self.modules]
        return torch.stack(sums + counts)

    def scores(self, summed: Tensor | None = None) -> dict[str, Tensor] | None:
        """Cluster name -> ``[1]`` float64 score ``1 - mean cos``; ``None`` if no layer saw a training forward.

        Args:
            summed: :meth:`stacked` summed over ranks; ``None`` uses this rank's sums.

        Raises:
            ValueError: If a layer's hidden states could not be read, or some layers saw forwards and others none.
        """
        if self._problem:
            path, why = next(iter(self._problem.items()))
            cluster = next(c for c, p in self.layers.items() if p == path)
            raise ValueError(
                f"Cluster {cluster!r}: layer_score='cosine' scores a layer by 1 - cos(input, output) of its module "
                f"{path!r} ({type(self.modules[path]).__name__}), but {why}. Use layer_score='weight' (the RMS of the "
                "layer's output projections) for this model."
            )
        summed = self.stacked() if summed is None else summed
        num = len(self.modules)
        if summed.shape != (2 * num,):
            raise ValueError(f"`summed` must have shape ({2 * num},) (see stacked()), got {tuple(summed.shape)}.")
        sums, counts = summed[:num].cpu(), summed[num:].cpu()
        if not bool((counts > 0).any()):
            return None
        missing = [c for c, p in self.layers.items() if counts[list(self.modules).index(p)] == 0]
        if missing:
            raise ValueError(
                f"Clusters {missing[:5]}: layer_score='cosine' saw no finite training forward of these layers since "
                "the last selection while other layers were seen; every layer must run in each training forward. "
                "Use layer_score='weight' for models that skip layers."
            )
        per_module = dict(zip(self.modules, (1.0 - sums / counts).tolist(), strict=True))
        self.last = {c: per_module[p] for c, p in self.layers.items()}
        return {c: torch.tensor([s], dtype=torch.float64) for c, s in self.last.items()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's sums since the last selection, as exact floats: ``{"sum": {path: s}, "count": {path: n}}``."""
        return {
            "sum": {p: float(v) for p, v in self._sum.items()},
            "count": {p: float(v) for p, v in self._count.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (modules unknown to this model are ignored)."""
        self.reset()
        for path, value in state.get("sum", {}).items():
            module = self.modules.get(path)
            if module is None:
                continue
            first = next(module.parameters(), None)
            device = torch.device("cpu") if first is None else dtensor.local_tensor(first).device
            count = float(state.get("count", {}).get(path, 0.0))
            self._sum[path] = torch.tensor(float(value), dtype=torch.float64, device=device)
            self._count[path] = torch.tensor(count, dtype=torch.float64, device=device)

    @classmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: LayerStats | None) -> None:
        """Check a saved ``layer_scores`` entry; with ``held``, against the module paths of its layers.

        Per rank: the sums and token counts (finite numbers, not negative) of layer modules.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        layers = None if held is None else list(held.modules)
        for where, entry in entries(raw, check, cls.key):
            for part in ("sum", "count"):
                values = check.mapping(entry.get(part, {}), f"{where}.{part}") or {}
                check.names(values, layers, f"{where}.{part}", "layers")
                for name, value in values.items():
                    check.real(value, f"{where}.{part}[{name!r}]", low=0.0)


def layer_clusters(clusters: Sequence[ResolvedCluster]) -> list[ResolvedCluster]:
    """The layer units among ``clusters``."""
    return [rc for rc in clusters if is_layer_cluster(rc)]


def calibrate_layers(
    model: nn.Module,
    clusters: Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]] | Sequence[ResolvedCluster],
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> LayerStats:
    """Layer scores ``1 - cos(input, output)`` from forward passes over ``batches`` (ShortGPT's calibration).

    The model runs in the mode it is in, without grad; nothing is mutated. Pass the result to
    :func:`~lightning_pat.prune_clusters` as ``layer_stats`` so that layer units are ranked by it instead of their
    weight RMS. Sums are this process's own: with several ranks, calibrate on the same batches on every rank.

    Args:
        model: The module to calibrate.
        clusters: Cluster declarations (or resolved clusters) holding layer units.
        batches: Inputs; each is passed as ``model(batch)`` unless ``forward`` is given.
        forward: ``forward(model, batch)`` for models that take something else (e.g. ``model(**batch)``).

    Returns:
        The statistics (read them with :meth:`LayerStats.scores`).

    Raises:
        ValueError: If a declaration is invalid, the clusters hold no layer unit, or a layer's hidden states cannot
            be read or no batch reached every layer (see :meth:`LayerStats.scores`).

    Example::

        >>> from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
        >>> from lightning_pat.demo.preset import tiny_gpt
        >>> net = TinyGPT(TinyGPTConfig(vocab_size=32, d_model=16, d_ff=32, n_layer=2, max_seq_len=8))
        >>> stats = calibrate_layers(net, tiny_gpt(net, layers=True), [torch.zeros(1, 8, dtype=torch.long)])
        >>> sorted(stats.scores())
        ['layer.0', 'layer.1']
    """
    stats = LayerStats(model, ensure_resolved(model, clusters))
    if not stats.layers:
        raise ValueError(
            "calibrate_layers: the clusters hold no layer unit (a 1-unit cluster in the 'layers' budget); add them "
            "with `layers=True` in a preset (e.g. presets.llama(model, layers=True))."
        )
    with stats.collecting():
        run_batches(model, batches, forward=forward)
    if stats.scores() is None:
        raise ValueError("calibrate_layers: `batches` is empty; pass at least one batch.")
    return stats
