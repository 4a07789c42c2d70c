r"""Activation-aware unit scores: input statistics of each cluster's readers (opt-in, ``score="activation"``).

A reader member (channel axis on dim 1) is the ``weight`` of an ``nn.Linear`` whose input channel ``j`` carries
the cluster's unit ``c(j)``. A forward pre-hook on that module keeps, per input channel, an exponential moving
average (``beta``, deterministic, float64) of the mean of ``x_j^2`` over all leading dims, taken only in training
forwards (grad enabled, and ``module.training`` or inside a training batch of the callback; squares summed in
float32). Under activation checkpointing each batch still counts once: a forward recomputed during the backward is
skipped when its first pass was counted (non-reentrant checkpoint) and counted when that pass ran under ``no_grad``
(reentrant checkpoint). The score of
unit ``c`` is the expected squared contribution of its channels to the readers' outputs::

    score_c = sqrt( sum over readers r, sum over channels j of unit c: E[x_j^2] * ||W_r[:, j]||^2 )

(Minitron-style: a unit whose weights are large but whose inputs are small scores low.) Readers that are no
``nn.Linear`` weight (an embedding, whose dim 1 is the residual stream) are left out of the sum, as long as the
cluster has at least one ``nn.Linear`` reader: the residual (hidden-size) cluster is then scored by the inputs of
``q/k/v/gate/up_proj`` and ``lm_head``, i.e. by the outputs of the norm layers (what Minitron scores embedding
channels by), each weighted by the squared column norm of the weight that reads it. A dropped unit's input is
zero, so its average decays towards 0 (by ``beta`` per forward) and latent mode rarely revives it, unlike with a
weight score.

Sharded models (FSDP2, tensor parallelism): each rank keeps the statistics of the input channels it sees (its
*window*: every channel under DDP and FSDP2, its shard under tensor parallelism, where a row-parallel reader gets a
``Shard(-1)`` input). At a selection every rank's statistics and per-channel "seen" flags are summed (the mean over
the ranks that saw a channel: data-parallel ranks average, tensor-parallel peers that saw the same rows count once
in the mean); as an :class:`~lightning_pat.parallel.executors.Evidence` they travel in the sharded path's one packed
gather together with the readers' column partials, so no weight is gathered.

Cost: one square-and-sum over every reader's input per training forward (``rows x in_features`` elements, an
elementwise op against the reader's matmul), and ``in_features`` float64 values per reader module of memory. The
callback removes the hooks once the mask is frozen and at the end of every fit.

Legend: ``C`` units of a cluster, ``I`` input channels of a reader module, ``N`` rows (all leading dims), ``S`` the
input channels of every reader module, stacked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lightning_pat.core.layers import is_layer_cluster
from lightning_pat.core.norms import channel_sq_sums
from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import Cluster, Member, ResolvedCluster, ensure_resolved
from lightning_pat.core.state_fields import FieldChecker, rank_entry
from lightning_pat.core.units import unit_of_channels
from lightning_pat.parallel import placement
from lightning_pat.parallel.comm import dtensor
from lightning_pat.parallel.executors import Evidence, Reduced
from lightning_pat.scoring.collector import Collector, entries
from lightning_pat.scoring.hooks import TrainingForwardHooks, run_batches


def _owner(modules: Mapping[str, nn.Module], name: str) -> tuple[str, nn.Module | None, str]:
    path, _, attr = name.rpartition(".")
    return path, modules.get(path), attr


class ActivationStats(TrainingForwardHooks, Collector):
    """Per-input-channel ``E[x^2]`` of every cluster's reader modules, and the unit scores built from them.

    A :class:`~lightning_pat.scoring.collector.Collector` of the state's ``activation`` entry: the ranks' statistics
    in rank order (each rank sees other batches and resumes its own).

    Args:
        model: The module holding the clusters' parameters (names as in ``model.named_parameters()``).
        clusters: The resolved clusters (layer units are left out: :mod:`lightning_pat.scoring.layers` scores them).
        beta: Weight of the previous average: ``ema = beta * ema + (1 - beta) * batch_mean`` (the first batch sets
            it). ``None`` keeps the plain mean over all batches seen (calibration).

    Raises:
        ValueError: If ``beta`` is outside ``[0, 1)``, a cluster has no reader, a reader is not the ``weight`` of an
            ``nn.Linear``.

    Example::

        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> stats = calibrate(mlp, Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"]),
        ...                   [torch.randn(16, 4)])
        >>> stats.unit_scores(dict(mlp.named_parameters()))["h"].shape
        torch.Size([8])
    """

    key: ClassVar[str] = "activation"

    def __init__(self, model: nn.Module, clusters: Sequence[ResolvedCluster], *, beta: float | None = 0.9) -> None:
        if beta is not None and (isinstance(beta, bool) or not 0.0 <= beta < 1.0):
            raise ValueError(f"`beta` must be None or a number in [0, 1), got {beta!r}.")
        super().__init__()
        self.beta = beta
        self.clusters = [rc for rc in clusters if not is_layer_cluster(rc)]  # layers: lightning_pat.scoring.layers
        modules = dict(model.named_modules(remove_duplicate=False))
        params = dict(model.named_parameters(remove_duplicate=False))
        self.readers: dict[str, list[tuple[Member, str]]] = {}  # cluster -> [(member, reader module name)]
        self.modules: dict[str, nn.Linear] = {}  # reader module name -> module, in first-seen order
        #: cluster -> readers that are no nn.Linear weight (an embedding): left out of the score
        self.unmeasured: dict[str, list[str]] = {}
        for rc in self.clusters:
            readers = [m for m in rc.members if m.role == "reader"]
            if not readers:
                raise ValueError(
                    f"Cluster {rc.name!r}: score='activation' scores units by the input of their readers, but the "
                    f"cluster has only writers {[m.name for m in rc.members][:5]}. Add the member that reads these "
                    "channels (e.g. down_proj/o_proj columns) to `readers`, or use a weight score ('rms')."
                )
            measured, refused = [], []
            for m in readers:
                try:
                    measured.append((m, self._reader_module(rc, m, modules, params)))
                except ValueError as err:
                    refused.append((m, err))
            if not measured:
                raise refused[0][1]
            self.readers[rc.name] = measured
            if refused:  # e.g. the residual cluster's embedding: scored by its nn.Linear readers (the norms' outputs)
                self.unmeasured[rc.name] = [m.name for m, _ in refused]
        self._ema: dict[str, Tensor] = {}  # per module, over the input channels this rank sees (its window)
        self._window: dict[str, tuple[int, int]] = {}  # per module, (first channel, channels) this rank sees
        # per module, 0-d int64 tensors on its device: finite batches folded in, non-finite batches skipped (kept on
        # the device so that a training forward never waits for the host)
        self._count: dict[str, Tensor] = {}
        self._bad: dict[str, Tensor] = {}
        self._warned: dict[str, int] = {}
        #: (start, block, channels, units, device) -> each channel's unit (channels inside units) and which are inside
        self._unit_index: dict[tuple[int, int, int, int, torch.device], tuple[Tensor, Tensor | None]] = {}

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
                self.modules.setdefault(path, module)
                return path
        path, owner, attr = _owner(modules, m.name)
        where = f"{type(owner).__name__} {path!r}" if path else f"the root module ({type(owner).__name__})"
        found = f"the `{attr}` of {where}" if owner is not None else "not a parameter of a module"
        raise ValueError(
            f"Cluster {rc.name!r}: score='activation' needs a reader that is the `weight` of an nn.Linear (its "
            f"input channels are the cluster's units), but reader {m.name!r} is {found}. Use a weight score "
            "('rms') for this model, add an nn.Linear reader, or leave this cluster out."
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
        self._window = {}

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
        local, offset = self._local_input(name, x)
        x_NI = local.detach().reshape(-1, local.shape[-1])
        rows = x_NI.shape[0]
        if rows == 0:
            return
        window = (offset, x_NI.shape[1])
        if self._window.setdefault(name, window) != window:
            seen = self._window[name]
            raise ValueError(
                f"score='activation': reader module {name!r} saw input channels [{window[0]}, {sum(window)}) on this "
                f"rank, but its statistics cover [{seen[0]}, {sum(seen)}) (a resume with another tensor-parallel "
                "layout, or a module that changes how its input is sharded). Resume with the same layout, or reset "
                "the statistics (a fresh run)."
            )
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

    def _local_input(self, name: str, x: Tensor) -> tuple[Tensor, int]:
        """This rank's piece of a reader's input and the first input channel it holds.

        A DTensor input (e.g. a row-parallel reader's ``Shard(-1)`` input) gives its local piece and offset; a plain
        input with every channel starts at 0; a plain input holding only the channels of this rank's shard of a
        ``Shard(1)`` reader weight starts where that shard does.

        Raises:
            ValueError: If the input's layout is not Shard/Replicate boxes, or a plain input has neither the reader's
                width nor its local shard's width.
        """
        module = self.modules[name]
        width = module.in_features
        if dtensor.is_dtensor(x):
            mesh, coordinate = x.device_mesh, x.device_mesh.get_coordinate()
            assert coordinate is not None  # this rank ran a forward on it, so it is in the mesh
            box = placement.local_box(
                tuple(x.shape), tuple(x.placements), mesh_shape=tuple(mesh.shape), coordinate=coordinate
            )
            return dtensor.local_tensor(x), box[-1][0]
        if x.shape[-1] == width:
            return x, 0
        weight = module.weight
        if dtensor.is_dtensor(weight) and x.shape[-1] == dtensor.local_tensor(weight).shape[1]:
            mesh, coordinate = weight.device_mesh, weight.device_mesh.get_coordinate()
            assert coordinate is not None  # this rank ran a forward with it, so it is in the mesh
            box = placement.local_box(
                tuple(weight.shape), tuple(weight.placements), mesh_shape=tuple(mesh.shape), coordinate=coordinate
            )
            return x, box[1][0]
        raise ValueError(
            f"score='activation': the input of reader module {name!r} has {x.shape[-1]} channels, but the module reads "
            f"{width} (and this rank holds no shard of that width); cannot tell which input channels it carries."
        )

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
                PruningWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ scores
    def _module_pair(self, name: str) -> tuple[Tensor, Tensor]:
        """``([I] average times "seen", [I] seen)`` of reader module ``name``, over its whole input width (float64).

        Channels outside this rank's window (tensor parallelism) and modules not seen are 0 in both.
        """
        module = self.modules[name]
        width = module.in_features
        device = dtensor.local_tensor(module.weight).device
        values = torch.zeros(width, dtype=torch.float64, device=device)
        seen = torch.zeros(width, dtype=torch.float64, device=device)
        ema = self._ema.get(name)
        if ema is not None:  # a module whose batches were all skipped is not seen (its average stayed 0)
            offset, length = self._window[name]
            flag = (self._count[name] > 0).to(torch.float64)
            values[offset : offset + length] = ema * flag
            seen[offset : offset + length] = flag
        return values, seen

    def stacked(self) -> Tensor:
        """``[2 S]``: every module's average times its "seen" flag, then per channel the flag (0 or 1), float64.

        Summed over ranks (:func:`~lightning_pat.parallel.comm.reduce.sum_over_ranks`), passed to :meth:`unit_scores`,
        it gives the mean over the ranks that saw the module; a module no rank saw stays detectably empty. Under
        tensor parallelism a rank fills only the input channels it sees (its window).
        """
        pairs = [self._module_pair(name) for name in self.modules]
        return torch.cat([v for v, _ in pairs] + [s for _, s in pairs])

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
            out[name] = self._mean(name, value, seen)
        return out

    def check_seen(self) -> None:
        """Refuse statistics that miss a reader module on this rank (over the input channels this rank sees).

        Raises:
            ValueError: Naming the cluster, the reader and its module.
        """
        self._warn_skipped()
        for name in self.modules:
            value, seen = self._module_pair(name)
            offset, length = self._window.get(name, (0, self.modules[name].in_features))
            self._mean(name, value[offset : offset + length], seen[offset : offset + length])

    def _mean(self, name: str, value: Tensor, seen: Tensor) -> Tensor:
        """``value / seen`` of module ``name``, refusing channels no rank saw and non-finite statistics."""
        if not bool((seen > 0).all()):
            cluster, param = next((c, m.name) for c, rs in self.readers.items() for m, n in rs if n == name)
            raise ValueError(
                f"Cluster {cluster!r}: score='activation' has no statistics for reader {param!r} (module "
                f"{name!r}): no training forward (grad enabled, in train mode or inside a training batch) with finite "
                f"inputs has reached it yet ({self.skipped.get(name, 0)} non-finite batch(es) skipped on this rank). "
                "Run at least one training step before the first selection, or calibrate() first for one-shot use."
            )
        if not bool(torch.isfinite(value).all()):
            cluster, param = next((c, m.name) for c, rs in self.readers.items() for m, n in rs if n == name)
            raise ValueError(
                f"Cluster {cluster!r}: the score='activation' statistics of reader {param!r} (module {name!r}) "
                "are not finite (the weights are not the cause); they were loaded or summed that way. Reset "
                "them (a fresh run or calibrate()), or use a weight score ('rms')."
            )
        return value / seen

    def unit_scores(self, params: Mapping[str, Tensor], *, summed: Tensor | None = None) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` float64 scores ``sqrt(sum_r sum_j E[x_j^2] ||W_r[:, j]||^2)``.

        Args:
            params: Parameter name -> tensor, holding every reader weight (the weights to score now).
            summed: :meth:`stacked` summed over ranks; ``None`` uses this rank's statistics.

        Raises:
            ValueError: If a reader module has no statistics yet, or ``summed`` has the wrong shape.
        """
        averages = self.averages(summed)
        columns: dict[str, Tensor] = {}
        for rc in self.clusters:
            for m, _ in self.readers[rc.name]:
                if m.name not in columns:
                    weight = dtensor.full_tensor(params[m.name].detach())  # a DTensor: gathered (one-shot use)
                    columns[m.name] = channel_sq_sums(weight, dim=1, acc_dtype=torch.float64)  # ||W[:, j]||^2
        return self._scores(averages, columns)

    def _fold(self, m: Member, contrib_I: Tensor, *, num_units: int) -> Tensor:
        """``[C]``: reader ``m``'s per-channel ``contrib_I`` summed into its units.

        As :func:`~lightning_pat.core.units.fold_to_units`, with the same index additions in the same order (the
        same bits); the channels' unit indices depend on the reader's layout only, so they are computed once per
        layout.
        """
        key = (m.start, m.block, contrib_I.numel(), num_units, contrib_I.device)
        hit = self._unit_index.get(key)
        if hit is None:
            units_I = unit_of_channels(
                start=m.start, block=m.block, offset=0, length=contrib_I.numel(), device=contrib_I.device
            )
            inside_I = (units_I >= 0) & (units_I < num_units)
            hit = self._unit_index[key] = (units_I[inside_I], None if bool(inside_I.all()) else inside_I)
        units, inside = hit
        out_C = torch.zeros(num_units, dtype=contrib_I.dtype, device=contrib_I.device)
        return out_C.index_add_(0, units, contrib_I if inside is None else contrib_I[inside])

    def _scores(self, averages: Mapping[str, Tensor], columns: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Cluster name -> ``[C]`` scores from per-module averages and per-reader squared column norms."""
        out = {}
        for rc in self.clusters:
            total_C: Tensor | None = None
            for m, name in self.readers[rc.name]:
                col_I = columns[m.name]
                part_C = self._fold(m, col_I * averages[name].to(col_I.device), num_units=rc.num_units)
                total_C = part_C if total_C is None else total_C + part_C
            assert total_C is not None  # every cluster has a reader (checked at construction)
            if not bool(torch.isfinite(total_C).all()):
                bad = [m.name for m, _ in self.readers[rc.name] if not bool(torch.isfinite(columns[m.name]).all())]
                cause = f"reader weights {bad[:3]} hold NaN/Inf" if bad else "E[x^2] * ||W[:, j]||^2 overflows"
                raise ValueError(
                    f"Cluster {rc.name!r}: score='activation' unit scores are not finite ({cause}; the input "
                    "statistics are finite); no units were pruned. Check the learning rate or loss scaling."
                )
            out[rc.name] = total_C.sqrt()
        return out

    # ------------------------------------------------------------------ evidence (see parallel.executors.Evidence)
    #: The executors add the readers' squared column norms to the reduction (partial sums of the local pieces).
    columns = True

    def as_evidence(self) -> Evidence:
        """The statistics are the selection's data-aware score (see :meth:`data_riders`, :meth:`finish`)."""
        return self

    def shard_riders(self) -> dict[str, Tensor]:
        """None: the statistics are per rank (see :meth:`data_riders`)."""
        return {}

    def data_riders(self) -> dict[str, Tensor]:
        """Cluster name -> ``[2 I]`` per reader module (values, then "seen"), this rank's; summed over every rank."""
        out = {}
        for rc in self.clusters:
            pairs = [self._module_pair(name) for _, name in self.readers[rc.name]]
            out[rc.name] = torch.cat([v for v, _ in pairs] + [s for _, s in pairs])
        return out

    def finish(self, reduced: Reduced) -> dict[str, Tensor]:
        """Unit scores from the statistics summed over every rank and the readers' whole column norms.

        Raises:
            ValueError: If a reader module has no statistics on any rank, or the scores are not finite.
        """
        self._warn_skipped()
        averages: dict[str, Tensor] = {}
        for rc in self.clusters:
            summed = reduced.data[rc.name]
            names = [name for _, name in self.readers[rc.name]]
            total = sum(self.modules[n].in_features for n in names)
            start = 0
            for name in names:
                width = self.modules[name].in_features
                value, seen = summed[start : start + width], summed[total + start : total + start + width]
                start += width
                averages.setdefault(name, self._mean(name, value, seen))
        return self._scores(averages, reduced.columns)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain types and CPU float64 tensors: ``beta``, per module the average, batches seen and window.

        The window is the input channels the average covers (``[first, channels]``: this rank's shard under tensor
        parallelism, else every channel).
        """
        counted = [k for k, v in self._count.items() if int(v)]
        return {
            "beta": self.beta,
            "ema": {k: self._ema[k].detach().cpu().clone() for k in counted},
            "count": {k: int(self._count[k]) for k in counted},
            "window": {k: list(self._window[k]) for k in counted},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (exactly; modules unknown to this model are ignored).

        Raises:
            ValueError: If a saved average's window does not fit its module's ``in_features``.
        """
        self.reset()
        for name, ema in state.get("ema", {}).items():
            module = self.modules.get(name)
            if module is None:
                continue
            offset, length = state.get("window", {}).get(name, (0, module.in_features))
            if ema.numel() != length or offset < 0 or offset + length > module.in_features:
                raise ValueError(
                    f"The saved activation statistics of {name!r} have {ema.numel()} channels, the module "
                    f"{module.in_features} (saved window: {length} channel(s) from channel {offset}); resume with "
                    "the same model."
                )
            self._window[name] = (int(offset), int(length))
            device = dtensor.local_tensor(module.weight).device
            self._ema[name] = ema.to(device=device, dtype=torch.float64).clone()
            count = int(state.get("count", {}).get(name, 1))
            self._count[name] = torch.tensor(count, dtype=torch.long, device=device)
            self._bad[name] = torch.zeros((), dtype=torch.long, device=device)

    def rank_entry(self, saved: Sequence[Mapping[str, Any]] | None, *, rank: int, world: int) -> Mapping[str, Any]:
        """This rank's statistics of the ranks' saved ones (rank order); ``{}`` if there are none.

        Statistics that cover every input channel (DDP, FSDP2) move to another number of ranks (a rank beyond the
        saved ones resumes rank 0's); statistics split over input channels by tensor parallelism do not.

        Raises:
            ValueError: If the saved statistics are split over input channels (a window that starts after channel 0
                exists exactly then) and ``world`` differs from the number of ranks saved.
        """
        partial = sorted({n for entry in saved or () for n, (offset, _) in entry.get("window", {}).items() if offset})
        split = f"sharded by tensor parallelism (reader modules {partial[:3]} cover only some input channels per rank)"
        return rank_entry(
            saved, rank=rank, world=world, split=split if partial else None, who="score='activation'",
            entries="the statistics", fix="resume with score='rms' (or a fresh run) to collect new statistics",
        )  # fmt: skip

    @classmethod
    def check_entry(cls, raw: object, check: FieldChecker, *, held: ActivationStats | None) -> None:
        """Check a saved ``activation`` entry; with ``held``, against its reader modules and their widths.

        Per rank: ``beta``, and per reader module its average (1-D, finite, not negative), batches seen and window.

        Raises:
            StateError: Naming the field, what was expected and what was found.
        """
        readers = None if held is None else {n: m.in_features for n, m in held.modules.items()}
        for where, entry in entries(raw, check, cls.key):
            unknown = sorted(set(entry) - {"beta", "ema", "count", "window"})
            if unknown:
                raise check.fail(where, f"has unknown entries {unknown}")
            if "beta" in entry:
                check.real(entry["beta"], f"{where}.beta", low=0.0, high=1.0)
            ema = check.mapping(entry.get("ema", {}), f"{where}.ema") or {}
            counts = check.mapping(entry.get("count", {}), f"{where}.count") or {}
            windows = check.mapping(entry.get("window", {}), f"{where}.window") or {}
            for part, names in (("ema", ema), ("count", counts), ("window", windows)):
                check.names(names, readers, f"{where}.{part}", "reader modules")
            for name, value in ema.items():
                tensor = check.tensor(value, f"{where}.ema[{name!r}]", nonnegative=True)
                if tensor.dim() != 1:
                    raise check.fail(f"{where}.ema[{name!r}]", f"must be 1-D, got shape {tuple(tensor.shape)}")
                width = None if readers is None else readers.get(name)
                window = windows.get(name, (0, tensor.numel() if width is None else width))
                window = check.sequence(window, f"{where}.window[{name!r}]")
                if len(window) != 2:
                    raise check.fail(f"{where}.window[{name!r}]", f"must be [first channel, channels], got {window!r}")
                offset = check.integer(window[0], f"{where}.window[{name!r}]")
                length = check.integer(window[1], f"{where}.window[{name!r}]", low=1)
                if tensor.numel() != length or (width is not None and offset + length > width):
                    raise check.fail(
                        f"{where}.ema[{name!r}]",
                        f"has {tensor.numel()} channels for a window of {length} from channel {offset}"
                        + ("" if width is None else f" of the module's {width} input channels"),
                    )
            for name, value in counts.items():
                check.integer(value, f"{where}.count[{name!r}]")


def calibrate(
    model: nn.Module,
    clusters: Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]] | Sequence[ResolvedCluster],
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
    stats.check_seen()  # every reader was reached, or a clear error now
    return stats


def reached_clusters(
    model: nn.Module,
    clusters: Sequence[ResolvedCluster],
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> list[ResolvedCluster]:
    """The clusters whose every reader module the ``batches`` reach (a calibration pass whose statistics are dropped).

    A multimodal LM calibrated on text never runs its vision or audio encoder: those clusters are not reached, and
    the caller ranks them by another score.

    Raises:
        ValueError: If a cluster's readers are not ``nn.Linear`` weights (see :class:`ActivationStats`).
    """
    stats = ActivationStats(model, list(clusters), beta=None)
    with stats.collecting():
        run_batches(model, batches, forward=forward)
    seen = {name for name, count in stats._count.items() if int(count)}  # noqa: SLF001 - its own module's class
    return [rc for rc in stats.clusters if all(n in seen for _, n in stats.readers[rc.name])]
