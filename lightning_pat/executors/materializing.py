"""The materializing executor: the reference path for plain tensors and any DTensor layout.

Each parameter is made dense on every rank (``full_tensor`` for a DTensor), scored, masked, and written back: a
DTensor rank slices its own shard from its identical dense copy (``src_data_rank=None``), so there is no broadcast.
A parameter shared by several clusters is gathered once per step and written back once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_pat import distributed as D
from lightning_pat.executors.base import Executor, UnitAction
from lightning_pat.masking import count_zeros, scale_units_
from lightning_pat.scoring import accumulation_dtype, member_unit_sq_sums


class MaterializingExecutor(Executor):
    """Dense scoring and masking on full tensors (see module docstring)."""

    kind = "materializing"

    def __init__(self, clusters, params) -> None:  # noqa: ANN001 - same as base
        super().__init__(clusters, params)
        self._dense: dict[str, Tensor] = {}

    def _get(self, name: str, *, grads: bool = False) -> Tensor:
        key = f"{name}.grad" if grads else name
        if key not in self._dense:
            src = self.params[name].grad if grads else self.params[name]
            self._dense[key] = D.full_tensor(src)
        return self._dense[key]

    def unit_sq_norms(self) -> dict[str, Tensor]:
        """See :meth:`Executor.unit_sq_norms`."""
        out = {}
        for rc in self.clusters:
            acc = accumulation_dtype(*(self.params[m.name].dtype for m in rc.members))
            parts = [
                member_unit_sq_sums(self._get(m.name), m, num_units=rc.num_units, acc_dtype=acc) for m in rc.members
            ]
            out[rc.name] = torch.stack(parts).sum(dim=0) if len(parts) > 1 else parts[0]
        return out

    @torch.no_grad()
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """See :meth:`Executor.apply`."""
        touched: list[str] = []
        for rc in self.clusters:
            action = actions.get(rc.name)
            if action is None:
                continue
            for m in rc.members:
                if grads and self.params[m.name].grad is None:
                    continue
                dense = self._get(m.name, grads=grads)
                if action.factors is not None:
                    scale_units_(dense, m, action.factors)
                else:
                    self._zero_units(dense, rc, m, action.dropped)
                touched.append(m.name)
        for name in dict.fromkeys(touched):
            target = self.params[name].grad if grads else self.params[name]
            D.write_back_(target, self._dense[f"{name}.grad" if grads else name])
        self.release()

    @torch.no_grad()
    def zero_counts(self) -> dict[str, tuple[int, int]]:
        """See :meth:`Executor.zero_counts`."""
        names = list(self.params)
        zeros = torch.stack([count_zeros(self._get(n)) for n in names]).tolist() if names else []
        self.release()
        return {n: (z, self.params[n].numel()) for n, z in zip(names, zeros, strict=True)}

    def release(self) -> None:
        """See :meth:`Executor.release`."""
        self._dense.clear()
