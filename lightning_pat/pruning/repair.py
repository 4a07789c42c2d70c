r"""One-shot repair without training: refit the readers of cut clusters by least squares on calibration data.

When units are cut, each reader (an ``nn.Linear`` whose input channels are the cluster's units: ``down_proj`` of an
MLP cluster, ``o_proj`` of a heads cluster) loses the contribution of the dropped input channels ``D``. The kept
channels ``S`` are usually correlated with the dropped ones, so the reader's output can be partly restored by
changing the kept columns alone. With ``G = E[x x^T]`` the Gram matrix of the reader's inputs over calibration
batches and ``W`` the dense weight, the kept columns that minimise ``E || W x - W'_S x_S ||^2`` are::

    W'_S = W G[:, S] (G[S, S] + lambda I)^-1        (lambda = ridge * mean(diag G[S, S]))

(the normal equations of the least-squares problem; ``ridge`` keeps a singular ``G[S, S]`` solvable, and a system
that stays singular, such as kept inputs that are all zero, is refused naming the reader). The dropped
columns stay exactly zero, so :func:`~lightning_pat.shrink` cuts the model as before and the shape is unchanged:
a stock Hugging Face config still describes it. This is the layer-wise reconstruction of structured post-training
pruning (a kept-columns update as in FLAP's and SlimGPT's compensation, without a bias term, which the stock Llama
layout does not have).

Usage (one-shot)::

    stats = calibrate(model, decls, batches)                  # lightning_pat.scoring.activation: which units to cut
    grams = calibrate_readers(model, decls, batches)          # the readers' input Gram matrices, dense weights
    result = prune_clusters(model, decls, target_params=0.75, score="activation", activations=stats)
    refit_readers(model, result, grams)                       # kept reader columns refit; dropped ones stay 0
    small = shrink(model, result)

The statistics are those of the dense model (every layer calibrated at once, before any cut), so a layer's refit
targets its dense output from dense inputs. Cost: one calibration pass (``rows x I^2`` multiply-adds per reader
module, ``I`` its input features), ``I^2`` float64 values and a copy of its weight per reader module, and one
``|S| x |S|`` solve per reader at refit. Plain tensors on one process (refit before sharding a model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.spec import Cluster, ResolvedCluster, ensure_resolved
from lightning_pat.core.units import unit_channels
from lightning_pat.parallel.comm import dtensor
from lightning_pat.scoring.hooks import TrainingForwardHooks, run_batches

_FLOAT32_SAFE = 1e37  # max|x|^2 * rows below this: a batch's float32 Gram cannot overflow (float32 max ~3.4e38)


@dataclass(frozen=True)
class RefitReport:
    """What :func:`refit_readers` changed.

    Attributes:
        modules: Reader module name -> ``(kept input channels, dropped input channels)`` of the refit.
        skipped: Cluster name -> why its readers were not refit (a reader that is no ``nn.Linear`` weight, a layer
            unit, nothing dropped).
        error: Reader module name -> relative squared error of its output on the calibration statistics, before
            (kept columns as they were) and after the refit: ``E||W x - W'_S x_S||^2 / E||W x||^2``.
    """

    modules: dict[str, tuple[int, int]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    error: dict[str, tuple[float, float]] = field(default_factory=dict)


class ReaderGrams(TrainingForwardHooks):
    """Input Gram matrices (float64) of the clusters' ``nn.Linear`` readers, and their weights when calibrated.

    Build it with :func:`calibrate_readers`. A reader module is hooked once, however many clusters read through it.

    Args:
        model: The module holding the clusters' parameters.
        clusters: The resolved clusters. Layer units, and clusters with a reader that is not the ``weight`` of an
            ``nn.Linear`` (the residual cluster's embedding), are left out and reported in :attr:`skipped`.
    """

    def __init__(self, model: nn.Module, clusters: Sequence[ResolvedCluster]) -> None:
        super().__init__()
        modules = dict(model.named_modules(remove_duplicate=False))
        params = dict(model.named_parameters(remove_duplicate=False))
        self.clusters: list[ResolvedCluster] = []
        self.skipped: dict[str, str] = {}
        self.readers: dict[str, list[tuple[str, str]]] = {}  # cluster -> [(member name, module name)]
        self.modules: dict[str, nn.Linear] = {}
        for rc in clusters:
            if is_layer_cluster(rc):
                self.skipped[rc.name] = "a layer unit (a dropped layer is removed whole: nothing reads it)"
                continue
            found, why = [], None
            for m in (m for m in rc.members if m.role == "reader"):
                owner = next(
                    (
                        path
                        for path, mod in modules.items()
                        if isinstance(mod, nn.Linear) and mod._parameters.get("weight") is params.get(m.name)  # noqa: SLF001 - identity only
                    ),
                    None,
                )
                if owner is None or m.dim != 1:
                    why = f"reader {m.name!r} is not the weight of an nn.Linear read along its input channels"
                    break
                found.append((m.name, owner))
            if why is None and not found:
                why = "it has no reader"
            if why is not None:
                self.skipped[rc.name] = why
                continue
            self.clusters.append(rc)
            self.readers[rc.name] = found
            for _, owner in found:
                self.modules.setdefault(owner, modules[owner])
        self.gram: dict[str, Tensor] = {}
        self.rows: dict[str, int] = {}
        self.weight: dict[str, Tensor] = {}
        self.batch: int | None = None  # the index of the calibration batch running now (named by the errors)

    def hooked_modules(self) -> Mapping[str, nn.Module]:
        """The reader modules."""
        return self.modules

    def register_hook(self, name: str, module: nn.Module) -> Any:
        """A forward pre-hook that adds ``x^T x`` of the module's input to its Gram sum."""

        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            if not self.training_forward(name, mod):
                return
            x = args[0].detach()
            if dtensor.is_dtensor(x) or dtensor.is_dtensor(mod.weight):
                raise ValueError(
                    f"calibrate_readers: reader {name!r} holds a DTensor; the refit works on plain tensors on one "
                    "process. Calibrate and refit before sharding the model (fully_shard / parallelize_module)."
                )
            x = x.reshape(-1, x.shape[-1])
            where = f"reader {name!r}" + (f" (calibration batch {self.batch})" if self.batch is not None else "")
            amax = float(x.abs().amax()) if x.numel() else 0.0
            if not math.isfinite(amax):
                raise ValueError(
                    f"calibrate_readers: {where}: its input holds values that are not finite (NaN or Inf); no "
                    "statistics are returned. Calibrate on batches whose forward stays finite (check the inputs and "
                    "the model)."
                )
            # float32 products are exact enough and fast; where their sum could overflow float32, float64
            xf = x.float() if amax * amax * x.shape[0] < _FLOAT32_SAFE else x.double()
            gram = (xf.T @ xf).double()
            total = self.gram[name] + gram if name in self.gram else gram
            if not bool(torch.isfinite(total.diagonal()).all()):  # |G_ij| <= sqrt(G_ii G_jj): the diagonal bounds it
                raise ValueError(
                    f"calibrate_readers: {where}: the Gram matrix of its inputs is not finite (inputs up to "
                    f"{amax:.3g} overflow float64 when squared and summed); no statistics are returned. Calibrate on "
                    "batches whose activations are in a usable range."
                )
            self.gram[name] = total
            if name not in self.weight:
                weight = mod.weight
                assert isinstance(weight, Tensor)
                self.weight[name] = weight.detach().clone()
            self.rows[name] = self.rows.get(name, 0) + x.shape[0]

        return module.register_forward_pre_hook(hook)

    def check_seen(self) -> None:
        """Raise if some reader module saw no calibration row."""
        missing = [name for name in self.modules if not self.rows.get(name)]
        if missing:
            raise ValueError(
                f"calibrate_readers: no batch reached the reader modules {missing[:4]}: check that `batches` run "
                "the model's forward through them (pass `forward=` for models that take something else)."
            )


def calibrate_readers(
    model: nn.Module,
    clusters: Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]] | Sequence[ResolvedCluster],
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> ReaderGrams:
    """The readers' input Gram matrices and dense weights from forward passes over ``batches`` (no grad).

    Call it on the dense model, before :func:`~lightning_pat.prune_clusters`; pass the result to
    :func:`refit_readers` after it. The model runs in the mode it is in; nothing is mutated.

    Args:
        model: The dense model.
        clusters: Cluster declarations (or resolved clusters), as for ``prune_clusters``.
        batches: Inputs; each is passed as ``model(batch)`` unless ``forward`` is given.
        forward: ``forward(model, batch)`` for models that take something else.

    Returns:
        The statistics.

    Raises:
        ValueError: If a declaration is invalid, no batch reached a reader, a reader is a DTensor, or a reader's
            input (or its Gram matrix, summed in float64) is not finite; the error names the reader and the batch.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> hidden = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
        >>> grams = calibrate_readers(net, hidden, [torch.randn(32, 4)])
        >>> grams.gram["2"].shape, grams.rows["2"]
        (torch.Size([8, 8]), 32)
    """
    grams = ReaderGrams(model, ensure_resolved(model, clusters))

    def numbered() -> Iterator[Any]:
        for i, batch in enumerate(batches):
            grams.batch = i
            yield batch

    with grams.collecting():
        run_batches(model, numbered(), forward=forward)
    grams.batch = None
    grams.check_seen()
    return grams


def _dropped_channels(grams: ReaderGrams, dropped: Mapping[str, Sequence[int]]) -> dict[str, Tensor]:
    """Reader module name -> sorted dropped input channels (the union over the clusters reading through it)."""
    out: dict[str, set[int]] = {}
    for rc in grams.clusters:
        units = sorted(int(u) for u in dropped.get(rc.name, ()))
        members = {m.name: m for m in rc.members if m.role == "reader"}
        for member_name, module in grams.readers[rc.name]:
            m = members[member_name]
            idx = unit_channels(
                m, torch.tensor(units, dtype=torch.long), num_units=rc.num_units, offset=0, length=m.shape[1],
                device=torch.device("cpu"),
            )  # fmt: skip
            out.setdefault(module, set()).update(idx.tolist())
    return {k: torch.tensor(sorted(v), dtype=torch.long) for k, v in out.items() if v}


def _relative_error(w: Tensor, v: Tensor, gram: Tensor) -> float:
    """``E||W x - V x||^2 / E||W x||^2`` for the Gram matrix ``G = sum x x^T`` (float64 matrices)."""
    d = w - v
    num = torch.einsum("oi,ij,oj->", d, gram, d)
    den = torch.einsum("oi,ij,oj->", w, gram, w)
    return float(num / den) if den > 0 else 0.0


def refit_readers(
    model: nn.Module,
    result: Any,
    grams: ReaderGrams,
    *,
    ridge: float = 1e-4,
) -> RefitReport:
    """Refit the kept input columns of every cut cluster's readers so that their outputs match the dense ones.

    For each reader module with dropped input channels ``D`` (kept ``S``: every other input channel) its weight
    becomes ``W'_S = W G[:, S] (G[S, S] + lambda I)^-1`` on ``S`` and zero on ``D``, where ``W`` is the weight and
    ``G`` the input Gram matrix recorded by :func:`calibrate_readers` and ``lambda = ridge * mean(diag G[S, S])``
    (solved in float64, stored in the weight's dtype). Rows of the weight that are all zero when it is called (cut
    by another cluster: a dropped layer's output projection, a dropped residual channel) stay zero. Writers, biases
    and everything else are untouched.

    Args:
        model: The model ``grams`` was calibrated on, pruned since (the same parameters, in place).
        result: The :class:`~lightning_pat.PruneResult` of the cut (or a mapping cluster name -> dropped units).
        grams: The statistics of :func:`calibrate_readers`, taken before the cut.
        ridge: Relative ridge ``lambda / mean(diag G[S, S])``, a number >= 0.

    Returns:
        What was refit, what was skipped and why, and the relative output error of each reader before and after.

    Raises:
        ValueError: If ``ridge`` is negative or not a number, ``result`` names a cluster the statistics do not
            know, a reader's weight changed shape since calibration, or a reader's system is singular (its kept
            inputs all zero; ``ridge=0`` with fewer calibration rows than kept columns or a never-nonzero kept
            column; numerically singular), naming the reader, its rows and kept columns and the fix. Every reader
            is solved before any is written, so nothing is mutated then.

    Example::

        >>> from lightning_pat import prune_clusters
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> hidden = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
        >>> batches = [torch.randn(64, 4) for _ in range(4)]
        >>> grams = calibrate_readers(net, hidden, batches)
        >>> result = prune_clusters(net, hidden, 0.5)
        >>> report = refit_readers(net, result, grams)
        >>> before, after = report.error["2"]
        >>> after <= before
        True
    """
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge >= 0:
        raise ValueError(f"refit_readers: `ridge` must be a number >= 0, got {ridge!r}.")
    dropped = dict(getattr(result, "dropped", result))
    known = {rc.name for rc in grams.clusters} | set(grams.skipped)
    unknown = sorted(set(dropped) - known)
    if unknown:
        raise ValueError(
            f"refit_readers: the result names clusters {unknown[:4]} that `grams` was not calibrated for (it knows "
            f"{sorted(known)[:4]}...). Calibrate with the same clusters as the cut: "
            "calibrate_readers(model, clusters, batches)."
        )
    channels = _dropped_channels(grams, dropped)
    for name in channels:
        mod = grams.modules[name]
        if mod.weight.shape != grams.weight[name].shape:
            raise ValueError(
                f"refit_readers: reader {name!r} has weight shape {tuple(mod.weight.shape)} but was calibrated at "
                f"{tuple(grams.weight[name].shape)}; refit before `shrink` (the columns are cut there)."
            )
    report = RefitReport(skipped=dict(grams.skipped))
    for rc in grams.clusters:
        if not dropped.get(rc.name):
            report.skipped.setdefault(rc.name, "nothing dropped")
    solved = {name: _solve(name, drop, grams, ridge=ridge) for name, drop in channels.items()}  # all, then write
    for name, (new, error, kept) in solved.items():
        mod = grams.modules[name]
        with torch.no_grad():
            mod.weight.copy_(new.to(dtype=mod.weight.dtype, device=mod.weight.device))
        report.error[name] = error
        report.modules[name] = (kept, int(channels[name].numel()))
    return report


def _solve(name: str, drop: Tensor, grams: ReaderGrams, *, ridge: float) -> tuple[Tensor, tuple[float, float], int]:
    """Reader ``name``'s refit weight (float64), its errors before and after, and its kept column count.

    Raises a ``ValueError`` naming the reader if its system is singular (the caller has written nothing yet).
    """
    mod = grams.modules[name]
    gram = grams.gram[name]
    dev = gram.device  # the calibration activations' device: every matrix of the solve stays on it
    w = grams.weight[name].double().to(dev)
    drop = drop.to(dev)
    keep_mask = torch.ones(w.shape[1], dtype=torch.bool, device=dev)
    keep_mask[drop] = False
    keep = torch.nonzero(keep_mask).flatten()
    g_ss = gram[keep][:, keep]
    diag = g_ss.diagonal()
    lam = float(ridge) * float(diag.mean()) if keep.numel() else 0.0
    rows, k = grams.rows[name], int(keep.numel())
    why = fix = None
    dead = torch.nonzero(diag == 0).flatten().tolist()
    if k and len(dead) == k:
        why = "those inputs are all zero on the calibration data (dead inputs, or all-zero batches)"
        fix = "Calibrate on batches that reach them (more or other calibration tokens); a ridge cannot help here"
    elif lam == 0 and (rows < k or dead):
        why = (
            f"ridge=0 leaves the system singular (kept input columns {dead[:4]} are never nonzero)"
            if dead
            else "ridge=0 leaves the system singular with fewer rows than columns"
        )
        fix = f"Calibrate on more tokens (at least {k} rows reaching every kept column) or pass ridge > 0 (e.g. 1e-4)"
    g_ss = g_ss + lam * torch.eye(k, dtype=gram.dtype, device=dev)
    rhs = gram[keep] @ w.T  # [S, out] = G[S, :] W^T
    v_s = rhs.T
    if why is None and k:
        sol, info = torch.linalg.solve_ex(g_ss, rhs)
        if int(info) != 0 or not bool(torch.isfinite(sol).all()):
            why = "the system is numerically singular"
            fix = "Calibrate on more tokens, or pass a larger ridge (e.g. 1e-2)"
        v_s = sol.T  # [out, S]
    if why is not None:
        raise ValueError(
            f"refit_readers: reader {name!r}: {rows} calibration rows for {k} kept input columns, and {why}; no "
            f"reader was changed. {fix}."
        )
    new = torch.zeros_like(w)
    new[:, keep] = v_s
    # rows another cut zeroed (a dropped layer's down_proj/o_proj, a dropped residual channel) stay zero
    cut_rows = (mod.weight.detach() == 0).all(dim=1).to(dev)
    new[cut_rows] = 0.0
    masked = w.clone()
    masked[:, drop] = 0.0
    masked[cut_rows] = 0.0
    return new, (_relative_error(w, masked, gram), _relative_error(w, new, gram)), k
