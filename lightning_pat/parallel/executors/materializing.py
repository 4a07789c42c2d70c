"""The materializing executor: the reference path for plain tensors and any DTensor layout.

Each parameter is made dense on every rank (``full_tensor`` for a DTensor), scored, masked, and written back: a
DTensor rank slices its own shard from its identical dense copy (``src_data_rank=None``), so there is no broadcast.
A parameter shared by several clusters is gathered once per step (inside one :meth:`Executor.session`) and
written back once; nothing outlives the call or session.

A gradient is made dense only where every rank holds one (agreed with one int64 collective for DTensors), so
that a rank without a gradient can never leave the others waiting in a gather.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_pat.core.masking import count_zeros, scale_units_
from lightning_pat.core.norms import ACCUMULATION_DTYPE, member_unit_sq_sums
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel.comm import dtensor, ranks, reduce
from lightning_pat.parallel.executors.base import Executor, UnitAction

if TYPE_CHECKING:
    from lightning_pat.parallel.comm.reduce import ProcessGroup


class MaterializingExecutor(Executor):
    """Dense scoring and masking on full tensors (see module docstring)."""

    kind = "materializing"

    def __init__(self, clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor]) -> None:
        super().__init__(clusters, params)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    def _get(self, name: str, dense: dict[str, Tensor], *, grads: bool = False) -> Tensor:
        key = f"{name}.grad" if grads else name
        if key not in dense:
            src = self.params[name].grad if grads else self.params[name]
            assert src is not None  # gradients are read only where _grads_present found them
            dense[key] = dtensor.full_tensor(src)
        return dense[key]

    def _dense(self) -> dict[str, Tensor]:
        return self._cache if self._cache is not None else {}

    def _grads_present(self, names: list[str]) -> set[str]:
        """Names whose gradient exists, decided identically on every rank for DTensors (one small collective).

        Raises:
            ValueError: If a DTensor parameter has a gradient on some ranks of its mesh and none on others.
        """
        present = {n for n in names if self.params[n].grad is not None}
        by_group: dict[tuple[int, ...], tuple[ProcessGroup, list[str]]] = {}
        for name in names:
            param = self.params[name]
            if dtensor.is_dtensor(param):
                group = reduce.mesh_group(param.device_mesh, cache=self._groups)
                by_group.setdefault(reduce.group_key(group), (group, []))[1].append(name)
        for group, group_names in by_group.values():
            has = [n in present for n in group_names]
            flags = ranks.any_rank([not h for h in has] + has, group=group)
            for i, name in enumerate(group_names):
                missing_somewhere, has_somewhere = flags[i], flags[len(group_names) + i]
                if missing_somewhere and has_somewhere:
                    raise ValueError(
                        f"Parameter {name!r} has a gradient on some ranks only; every rank of its mesh must run the "
                        "same backward over it (a parameter unused on one rank: multiply it by 0 in the forward)."
                    )
                if missing_somewhere:
                    present.discard(name)
        return present

    def _dense_param(self, name: str) -> Tensor:
        return self._get(name, self._dense())

    def unit_sq_norms(self, names: Collection[str] | None = None) -> dict[str, Tensor]:
        """See :meth:`Executor.unit_sq_norms`."""
        out = {}
        dense = self._dense()
        for rc in self.clusters:
            if names is not None and rc.name not in names:
                continue
            parts = [
                member_unit_sq_sums(self._get(m.name, dense), m, num_units=rc.num_units, acc_dtype=ACCUMULATION_DTYPE)
                for m in rc.members
            ]
            out[rc.name] = torch.stack(parts).sum(dim=0) if len(parts) > 1 else parts[0]
        return out

    @torch.no_grad()
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """See :meth:`Executor.apply`."""
        touched: list[str] = []
        cache = {} if grads else self._dense()
        acting = [rc for rc in self.clusters if rc.name in actions]
        present = (
            self._grads_present(list(dict.fromkeys(n for rc in acting for n in rc.param_names))) if grads else None
        )
        for rc in acting:
            action = actions[rc.name]
            for m in rc.members:
                if present is not None and m.name not in present:
                    continue
                dense = self._get(m.name, cache, grads=grads)
                if action.factors is not None:
                    scale_units_(dense, m, action.factors)
                else:
                    self._zero_units(dense, rc, m, action.dropped)
                touched.append(m.name)
        for name in dict.fromkeys(touched):
            target = self.params[name].grad if grads else self.params[name]
            assert target is not None  # touched: gradients only where _grads_present found them
            dtensor.write_back_(target, cache[f"{name}.grad" if grads else name])

    @torch.no_grad()
    def zero_counts(self) -> dict[str, tuple[int, int]]:
        """See :meth:`Executor.zero_counts`."""
        names = list(self.params)
        dense = self._dense()
        zeros = torch.stack([count_zeros(self._get(n, dense)) for n in names]).tolist() if names else []
        return {n: (z, self.params[n].numel()) for n, z in zip(names, zeros, strict=True)}
