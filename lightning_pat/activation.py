r"""Activation-aware unit scores: input statistics of each cluster's readers (opt-in, ``score="activation"``).

A reader member (channel axis on dim 1) is the ``weight`` of an ``nn.Linear`` whose input channel ``j`` carries
the cluster's unit ``c(j)``. A forward pre-hook on that module keeps, per input channel, an exponential moving
average (``beta``, deterministic, float64) of the mean of ``x_j^2`` over all leading dims, taken only in training
forwards (``module.training`` and grad enabled; squares summed in float32). Under activation checkpointing each
batch still counts once: a forward recomputed during the backward is skipped when its first pass was counted
(non-reentrant checkpoint) and counted when that pass ran under ``no_grad`` (reentrant checkpoint). The score of
unit ``c`` is the expected squared contribution of its channels to the readers' outputs::

    score_c = sqrt( sum over readers r, sum over channels j of unit c: E[x_j^2] * ||W_r[:, j]||^2 )

(Minitron-style: a unit whose weights are large but whose inputs are small scores low.) A dropped unit's input is
zero, so its average decays towards 0 (by ``beta`` per forward) and latent mode rarely revives it, unlike with a
weight score.

Cost: one square-and-sum over every reader's input per training forward (``rows x in_features`` elements, an
elementwise op against the reader's matmul), and ``in_features`` float64 values per reader module of memory. The
callback removes the hooks once the mask is frozen and at the end of every fit.

Legend: ``C`` units of a cluster, ``I`` input channels of a reader module, ``N`` rows (all leading dims), ``S`` the
input channels of every reader module, stacked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pat.core.budget import is_layer_cluster
from lightning_pat.core.forwards import TrainingForwardHooks, run_batches
from lightning_pat.core.scoring import channel_sq_sums
from lightning_pat.core.spec import Cluster, Member, ResolvedCluster, ensure_resolved
from lightning_pat.core.units import fold_to_units, unit_of_channels
from lightning_pat.parallel import distributed


def _owner(modules: Mapping[str, nn.Module], name: str) -> tuple[str, nn.Module | None, str]:
    path, _, attr = name.rpartition(".")
    return path, modules.get(path), attr


class ActivationStats(TrainingForwardHooks):
    """Per-input-channel ``E[x^2]`` of every cluster's reader modules, and the unit scores built from them.

    Args:
        model: The module holding the clusters' parameters (names as in ``model.named_parameters()``).
        clusters: The resolved clusters (layer units are left out: :mod:`lightning_pat.layer_score` scores them).
        beta: Weight of the previous average: ``ema = beta * ema + (1 - beta) * batch_mean`` (the first batch sets
            it). ``None`` keeps the plain mean over all batches seen (calibration).

    Raises:
        ValueError: If ``beta`` is outside ``[0, 1)``, a cluster has no reader, a reader is not the ``weight`` of an
            ``nn.Linear``, or a reader weight is a DTensor.

    Example::

        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> stats = calibrate(mlp, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]),
        ...                   [torch.randn(16, 4)])
        >>> stats.unit_scores(dict(mlp.named_parameters()))["h"].shape
        torch.Size([8])
    """

    def __init__(self, model: nn.Module, clusters: Sequence[ResolvedCluster], *, beta: float | None = 0.9) -> None:
        if beta is not None and (isinstance(beta, bool) or not 0.0 <= beta < 1.0):
            raise ValueError(f"`beta` must be None or a number in [0, 1), got {beta!r}.")
        super().__init__()
        self.beta = beta
        self.clusters = [rc for rc in clusters if not is_layer_cluster(rc)]  # layers: lightning_pat.layer_score
        modules = dict(model.named_modules(remove_duplicate=False))
        params = dict(model.named_parameters(remove_duplicate=False))
        self.readers: dict[str, list[tuple[Member, str]]] = {}  # cluster -> [(member, reader module name)]
        self.modules: dict[str, nn.Linear] = {}  # reader module name -> module, in first-seen order
        for rc in self.clusters:
            readers = [m for m in rc.members if m.role == "reader"]
            if not readers:
                raise ValueError(
                    f"Cluster {rc.name!r}: score='activation' scores units by the input of their readers, but the "
                    f"cluster has only writers {[m.name for m in rc.members][:5]}. Add the member that reads these "
                    "channels (e.g. down_proj/o_proj columns) to `readers`, or use a weight score ('rms')."
                )
            self.readers[rc.name] = [(m, self._reader_module(rc, m, modules, params)) for m in readers]
        self._ema: dict[str, Tensor] = {}
        # per module, 0-d int64 tensors on its device: finite batches folded in, non-finite batches skipped (kept on
        # the device so that a training forward never waits for the host)
        self._count: dict[str, Tensor] = {}
        self._bad: dict[str, Tensor] = {}
        self._warned: dict[str, int] = {}

    def _reader_module(
        self, rc: ResolvedCluster, m: Member, modules: Mapping[str, nn.Module], params: Mapping[str, Tensor]
    ) -> str:
        """The ``nn.Linear`` whose ``weight`` is reader ``m`` (under any name: tied tensors have several owners)."""
        tensor = params.get(m.name)
        owners = [
            (path, module)
            for path, module in modules.items()
            if tensor is not None and module._parameters.get("weight") is tensor  # noqa: SLF001 - identity only
        ]
        for path, module in owners:
            if isinstance(module, nn.Linear):
                if distributed.is_dtensor(module.weight):
                    raise ValueError(
                        f"Cluster {rc.name!r}: reader {m.name!r} is a DTensor; score='activation' supports plain "
                        "parameters (one device, DDP) only. Use a weight score ('rms') with sharded parameters."
                    )
                self.modules.setdefault(path, module)
                return path
        path, module, attr = _owner(modules, m.name)
        where = f"{type(module).__name__} {path!r}" if path else f"the root module ({type(module).__name__})"
        found = f"the `{attr}` of {where}" if module is not None else "not a parameter of a module"
        raise ValueError(
            f"Cluster {rc.name!r}: score='activation' needs every reader to be the `weight` of an nn.Linear (its "
            f"input channels are the cluster's units), but reader {m.name!r} is {found}. Use a weight score "
            "('rms') for this model, or leave this cluster out (e.g. the residual cluster, read by the embedding)."
        )

    # ------------------------------------------------------------------ collection
    def hooked_modules(self) -> Mapping[str, nn.Module]:
        """The reader modules."""
        return self.modules

    def register_hook(self, name: str, module: nn.Module) -> Any:
        """A forward pre-hook on reader module ``name``."""
        return module.register_forward_pre_hook(self._hook(name), with_kwargs=True)

    def reset(self) -> None:
        """Forget every statistic."""
        self._ema, self._count, self._bad, self._warned, self._unrecomputed = {}, {}, {}, {}, {}

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.training_forward(name, module):
                return
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, Tensor):
                self.observe(name, x)

        return hook

    @torch.no_grad()
    def observe(self, name: str, x: Tensor) -> None:
        """Fold one input batch of reader module ``name`` into its average.

        The squares are summed over rows in the input's precision, at least float32 (a relative error of about
        1e-7, far below the batch-to-batch spread of the statistic, and 5x cheaper than float64 on CPU); the mean
        and the average are float64. A batch whose mean square is not finite (NaN/Inf input, or squares overflowing
        float32) is left out (it would poison the average for good) and counted in :attr:`skipped`, with a warning
        when the statistics are next read; the decision stays on the device (no wait for the host per forward).
        """
        x_NI = x.detach().reshape(-1, x.shape[-1])
        rows = x_NI.shape[0]
        if rows == 0:
            return
        if x_NI.dtype not in (torch.float32, torch.float64):
            x_NI = x_NI.float()
        mean_I = x_NI.square().sum(dim=0).to(torch.float64) / rows
        ok = torch.isfinite(mean_I).all()  # a 0-d tensor: no wait for the host
        prev = self._ema.get(name)
        if prev is None:
            prev = self._ema[name] = torch.zeros_like(mean_I)
            self._count[name] = torch.zeros((), dtype=torch.long, device=mean_I.device)
            self._bad[name] = torch.zeros((), dtype=torch.long, device=mean_I.device)
        count = self._count[name]
        if self.beta is None:
            new = prev + (mean_I - prev) / (count + 1)
        else:
            new = torch.where(count == 0, mean_I, torch.add(prev * self.beta, mean_I, alpha=1.0 - self.beta))
        self._ema[name] = torch.where(ok, new, prev)
        count.add_(ok)
        self._bad[name].add_(~ok)

    @property
    def skipped(self) -> dict[str, int]:
        """Reader module name -> input batches skipped because their mean square was not finite (this rank's).

        The skip is rank-local; the statistics are summed over ranks at selection, so every rank still selects
        from the same numbers.
        """
        return {k: n for k, v in self._bad.items() if (n := int(v))}

    def _warn_skipped(self) -> None:
        """Warn once per module and new skip count (read at selection, where the host waits anyway)."""
        new = {k: n for k, n in self.skipped.items() if n > self._warned.get(k, 0)}
        if new:
            self._warned.update(new)
            warnings.warn(
                f"score='activation': skipped non-finite input batches of reader modules {new} (NaN/Inf, or values "
                "whose squares overflow float32); their statistics keep the finite batches only "
                "(`ActivationStats.skipped`).",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ scores
    def stacked(self) -> Tensor:
        """``[2 S]``: every module's average times its "seen" flag, then per channel the flag (0 or 1), float64.

        Summed over ranks (:func:`~lightning_pat.parallel.distributed.sum_over_ranks`), passed to :meth:`unit_scores`,
        it gives the mean over the ranks that saw the module; a module no rank saw stays detectably empty.
        """
        values, seen = [], []
        for name, module in self.modules.items():
            ema = self._ema.get(name)
            width = module.in_features
            device = module.weight.device
            if ema is None:
                values.append(torch.zeros(width, dtype=torch.float64, device=device))
                seen.append(torch.zeros(width, dtype=torch.float64, device=device))
            else:  # a module whose batches were all skipped is not seen (its average stayed 0)
                values.append(ema)
                seen.append((self._count[name] > 0).to(torch.float64).expand(width))
        return torch.cat(values + seen)

    def averages(self, summed: Tensor | None = None) -> dict[str, Tensor]:
        """Module name -> ``[I]`` mean ``E[x^2]`` (over the ranks that saw it when ``summed`` is given).

        Raises:
            ValueError: If a reader module has no statistics, or ``summed`` has the wrong shape.
        """
        self._warn_skipped()
        summed = self.stacked() if summed is None else summed
        total = sum(m.in_features for m in self.modules.values())
        if summed.shape != (2 * total,):
            raise ValueError(f"`summed` must have shape ({2 * total},) (see stacked()), got {tuple(summed.shape)}.")
        out, start = {}, 0
        for name, module in self.modules.items():
            width = module.in_features
            value, seen = summed[start : start + width], summed[total + start : total + start + width]
            start += width
            if not bool((seen > 0).all()):
                cluster, param = next((c, m.name) for c, rs in self.readers.items() for m, n in rs if n == name)
                raise ValueError(
                    f"Cluster {cluster!r}: score='activation' has no statistics for reader {param!r} (module "
                    f"{name!r}): no training forward (module.training and grad enabled) with finite inputs has reached "
                    f"it yet ({self.skipped.get(name, 0)} non-finite batch(es) skipped on this rank). Run "
                    "at least one training step before the first selection, or calibrate() first for one-shot use."
                )
            if not bool(torch.isfinite(value).all()):
                cluster, param = next((c, m.name) for c, rs in self.readers.items() for m, n in rs if n == name)
                raise ValueError(
                    f"Cluster {cluster!r}: the score='activation' statistics of reader {param!r} (module {name!r}) "
                    "are not finite (the weights are not the cause); they were loaded or summed that way. Reset "
                    "them (a fresh run or calibrate()), or use a weight score ('rms')."
                )
            out[name] = value / seen
        return out

    def unit_scores(self, params: Mapping[str, Tensor], *, summed: Tensor | None = None) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` float64 scores ``sqrt(sum_r sum_j E[x_j^2] ||W_r[:, j]||^2)``.

        Args:
            params: Parameter name -> tensor, holding every reader weight (the weights to score now).
            summed: :meth:`stacked` summed over ranks; ``None`` uses this rank's statistics.

        Raises:
            ValueError: If a reader module has no statistics yet, or ``summed`` has the wrong shape.
        """
        averages = self.averages(summed)
        out = {}
        for rc in self.clusters:
            total_C: Tensor | None = None
            for m, name in self.readers[rc.name]:
                weight = params[m.name].detach()
                col_I = channel_sq_sums(weight, dim=1, acc_dtype=torch.float64)  # ||W[:, j]||^2
                contrib_I = col_I * averages[name].to(col_I.device)
                units_I = unit_of_channels(
                    start=m.start, block=m.block, offset=0, length=contrib_I.numel(), device=contrib_I.device
                )
                part_C = fold_to_units(contrib_I, units_I, num_units=rc.num_units)
                total_C = part_C if total_C is None else total_C + part_C
            assert total_C is not None  # every cluster has a reader (checked at construction)
            if not bool(torch.isfinite(total_C).all()):
                bad = [m.name for m, _ in self.readers[rc.name] if not bool(torch.isfinite(params[m.name]).all())]
                cause = f"reader weights {bad[:3]} hold NaN/Inf" if bad else "E[x^2] * ||W[:, j]||^2 overflows"
                raise ValueError(
                    f"Cluster {rc.name!r}: score='activation' unit scores are not finite ({cause}; the input "
                    "statistics are finite); no units were pruned. Check the learning rate or loss scaling."
                )
            out[rc.name] = total_C.sqrt()
        return out

    def summed_unit_scores(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`unit_scores` from the statistics summed over all ranks (one collective when distributed).

        Raises:
            ValueError: If a reader module has no statistics on any rank yet.
        """
        return self.unit_scores(
            params, summed=distributed.sum_over_ranks(self.stacked(), group=distributed.world_group())
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain types and CPU float64 tensors: ``beta``, per module the average and the number of batches seen."""
        return {
            "beta": self.beta,
            "ema": {k: v.detach().cpu().clone() for k, v in self._ema.items() if int(self._count[k])},
            "count": {k: n for k, v in self._count.items() if (n := int(v))},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (exactly; modules unknown to this model are ignored).

        Raises:
            ValueError: If a saved average's length differs from its module's ``in_features``.
        """
        self.reset()
        for name, ema in state.get("ema", {}).items():
            module = self.modules.get(name)
            if module is None:
                continue
            if ema.numel() != module.in_features:
                raise ValueError(
                    f"The saved activation statistics of {name!r} have {ema.numel()} channels, the module "
                    f"{module.in_features}; resume with the same model."
                )
            device = module.weight.device
            self._ema[name] = ema.to(device=device, dtype=torch.float64).clone()
            count = int(state.get("count", {}).get(name, 1))
            self._count[name] = torch.tensor(count, dtype=torch.long, device=device)
            self._bad[name] = torch.zeros((), dtype=torch.long, device=device)


def calibrate(
    model: nn.Module,
    clusters: Cluster | Mapping | Sequence[Cluster | Mapping] | Sequence[ResolvedCluster],
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> ActivationStats:
    """Activation statistics from forward passes over ``batches`` (no grad; the plain mean over batches).

    The model runs in the mode it is in (``model.eval()`` first to switch dropout off); nothing is mutated. The
    result feeds :func:`~lightning_pat.prune_clusters` with ``score="activation"``. Statistics are this process's
    own: with several ranks, calibrate on the same batches on every rank.

    Args:
        model: The module to calibrate.
        clusters: Cluster declarations (or resolved clusters).
        batches: Inputs; each is passed as ``model(batch)`` unless ``forward`` is given.
        forward: ``forward(model, batch)`` for models that take something else (e.g. ``model(**batch)``).

    Returns:
        The statistics.

    Raises:
        ValueError: If a declaration is invalid, a cluster's readers are not ``nn.Linear`` weights (see
            :class:`ActivationStats`), or no batch reached some reader.
    """
    stats = ActivationStats(model, ensure_resolved(model, clusters), beta=None)
    with stats.collecting():
        run_batches(model, batches, forward=forward)
    stats.averages()  # every reader was reached, or a clear error now
    return stats
