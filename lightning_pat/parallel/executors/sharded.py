"""The sharded executor: local partial unit sums, one packed gather per process group, local in-place masking.

Every member contributes, on every rank, a length-``C`` vector of partial per-unit sums of squares computed from
its local piece (the channels it holds, over the rows/columns it holds). A member whose channel axis is sharded
fills only its block of units with complete sums; one whose reduction axis is sharded fills every unit with a
partial sum; both are the same code. A member replicated on a gathered mesh axis contributes only at coordinate 0
of that axis, so the sum over the gather group counts every piece once.

All clusters whose gather groups coincide are packed into one buffer and gathered with a single ``all_gather``;
each rank then sums the rows in mesh-coordinate order, so every rank of every replica group holds bitwise
identical ``Q`` (floats are never all-reduced). When that gather would bring more than ``two_phase_min_bytes`` to
each rank (large groups: ``(n - 1) * L`` elements), the pack is reduced instead by an ``all_to_all`` of blocks, an
owner-side sum in the same order, and an ``all_gather`` of the summed blocks: ``2 (n - 1) / n * L`` elements and
bitwise the same ``Q``. Selections are applied to the local pieces in place; nothing is materialized or
redistributed.

Legend: ``C`` units of a cluster, ``L`` packed length, ``n`` ranks in a gather group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from lightning_pat.core.masking import count_zeros, scale_units_
from lightning_pat.core.norms import (
    ACCUMULATION_DTYPE,
    channel_sq_sums,
    member_unit_abs_prod_sums,
    member_unit_sq_sums,
)
from lightning_pat.core.spec import Member, ResolvedCluster
from lightning_pat.parallel import placement
from lightning_pat.parallel.comm import dtensor, ranks, reduce
from lightning_pat.parallel.executors.base import Executor, Reduced, UnitAction

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from lightning_pat.parallel.comm.reduce import ProcessGroup


@dataclass(frozen=True)
class _Piece:
    """Where a member's local tensor sits along its channel axis, and whether its partial is summed."""

    offset: int
    length: int
    contributes: bool


@dataclass
class _Pack:
    """Clusters reduced together over ``group`` per step, summed in mesh-coordinate ``order``."""

    group: ProcessGroup
    order: list[int]
    clusters: list[ResolvedCluster]


class ShardedExecutor(Executor):
    """Scores and masks eligible DTensor clusters on local shards (see module docstring).

    Raises:
        ValueError: If a member's layout is not eligible (see :func:`lightning_pat.parallel.placement.cluster_reason`).
    """

    kind = "sharded"
    #: Above this many bytes received per rank by the one-collective reduction ((n - 1) * L * itemsize), a pack
    #: is reduced with all_to_all + all_gather instead (2 (n - 1) / n * L elements; the same bits).
    two_phase_min_bytes: int = 4 << 20

    def __init__(
        self, clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor], *, data_aware: bool = False
    ) -> None:
        super().__init__(clusters, params)
        self._two_phase_min = self.two_phase_min_bytes  # decided at construction (the packs' lengths are not yet)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}  # multi-axis process groups, owned by this executor
        self._pieces: dict[tuple[str, str], _Piece] = {}
        self._ungathered: list[ResolvedCluster] = []  # every member replicated: the local partial is complete
        packs: dict[tuple[tuple[int, ...], tuple[int, ...]], _Pack] = {}  # (group ranks, order) -> pack
        mismatches: list[str] = []
        for rc in self.clusters:
            first = cast("DTensor", self.params[rc.members[0].name])  # every member of an eligible cluster is one
            mesh = first.device_mesh
            coord = mesh.get_coordinate()
            assert coord is not None  # this rank holds the parameter: it is in the mesh
            placements = [tuple(cast("DTensor", self.params[m.name]).placements) for m in rc.members]
            reason = placement.cluster_reason(rc, placements, mesh_shape=tuple(mesh.shape))
            if reason is not None:  # global metadata: every rank raises here, before any collective
                raise ValueError(f"Cluster {rc.name!r} cannot take the sharded path: {reason}.")
            # data-aware scores sum every rank's own statistics: the whole mesh (ranks that see the same data, e.g.
            # tensor-parallel peers, are averaged out by the statistics' "seen" counts)
            axes = tuple(range(mesh.ndim)) if data_aware and mesh.size() > 1 else placement.gather_axes(placements)
            for m, ps in zip(rc.members, placements, strict=True):
                box = placement.local_box(m.shape, ps, mesh_shape=tuple(mesh.shape), coordinate=coord)
                local_shape = tuple(dtensor.local_tensor(self.params[m.name]).shape)
                if local_shape != tuple(n for _, n in box):  # a torch whose DTensor layout differs from ours
                    mismatches.append(f"{m.name}: local shape {local_shape} != expected box {box} for {ps}")
                offset, length = box[m.dim]
                self._pieces[(rc.name, m.name)] = _Piece(
                    offset, length, placement.contributes(ps, coordinate=coord, axes=axes)
                )
            if not axes:
                self._ungathered.append(rc)
                continue
            group = reduce.axes_group(mesh, axes, cache=self._groups)
            order = reduce.gather_order(mesh, axes, group)
            packs.setdefault((reduce.group_key(group), tuple(order)), _Pack(group, order, [])).clusters.append(rc)
        self._packs = list(packs.values())
        counts: dict[tuple[int, ...], tuple[ProcessGroup, list[str]]] = {}  # whole-mesh group -> parameter names
        for name, tensor in self.params.items():
            group = reduce.mesh_group(cast("DTensor", tensor).device_mesh, cache=self._groups)
            counts.setdefault(reduce.group_key(group), (group, []))[1].append(name)
        self._count_groups = list(counts.values())
        # a local shape check must not make one rank raise while the others go on into a gather: agree first
        flags = [ranks.any_rank([bool(mismatches)], group=group)[0] for group, _ in self._count_groups]  # no short cut
        if any(flags):
            raise ValueError(
                "The sharded path found local shards whose shapes differ from the layout it computed (on some "
                f"rank; here: {mismatches or 'none'}); use executor='materializing' and report this torch version."
            )

    # ------------------------------------------------------------------ scores
    def _partial(self, rc: ResolvedCluster) -> Tensor:
        """This rank's partial ``[C]`` unit sums of squares over all members of ``rc``."""
        acc = ACCUMULATION_DTYPE
        q_C = None
        for m in rc.members:
            piece = self._pieces[(rc.name, m.name)]
            local = dtensor.local_tensor(self.params[m.name])
            if piece.contributes:
                part_C = member_unit_sq_sums(local, m, num_units=rc.num_units, acc_dtype=acc, offset=piece.offset)
            else:
                part_C = torch.zeros(rc.num_units, dtype=acc, device=local.device)
            q_C = part_C if q_C is None else q_C + part_C
        assert q_C is not None  # a resolved cluster has members
        return q_C

    @torch.no_grad()
    def unit_grad_products(self) -> dict[str, Tensor]:
        """See :meth:`Executor.unit_grad_products`: on the local pieces, each piece counted once (no communication).

        Raises:
            ValueError: If a member's gradient is laid out unlike its parameter (e.g. ``Partial``: its local values
                are not this piece's gradient).
        """
        out = {}
        for rc in self.clusters:
            total_C = None
            for m in rc.members:
                param = cast("DTensor", self.params[m.name])
                piece = self._pieces[(rc.name, m.name)]
                local = dtensor.local_tensor(param)
                grad = param.grad
                part_C = torch.zeros(rc.num_units, dtype=ACCUMULATION_DTYPE, device=local.device)
                # the layout is global metadata: every rank raises together
                if grad is not None and (
                    not dtensor.is_dtensor(grad) or tuple(grad.placements) != tuple(param.placements)
                ):
                    layout = tuple(grad.placements) if dtensor.is_dtensor(grad) else "a plain tensor"
                    raise ValueError(
                        f"Cluster {rc.name!r}: score='taylor' needs member {m.name!r}'s gradient laid out like "
                        f"the parameter ({tuple(param.placements)}), got {layout}; keep gradients in their "
                        "parameter's layout, or use another score."
                    )
                if grad is not None and piece.contributes:
                    part_C = member_unit_abs_prod_sums(
                        local, dtensor.local_tensor(grad), m, num_units=rc.num_units,
                        acc_dtype=ACCUMULATION_DTYPE, offset=piece.offset,
                    )  # fmt: skip
                total_C = part_C if total_C is None else total_C + part_C
            assert total_C is not None  # a resolved cluster has members
            out[rc.name] = total_C
        return out

    def _columns_partial(self, rc: ResolvedCluster) -> list[tuple[str, Tensor]]:
        """Per reader member, this rank's partial squared column norms over the whole width (zeros elsewhere)."""
        out = []
        for m in rc.members:
            if m.role != "reader":
                continue
            piece = self._pieces[(rc.name, m.name)]
            local = dtensor.local_tensor(self.params[m.name]).detach()
            width = self.params[m.name].shape[1]
            col_I = torch.zeros(width, dtype=ACCUMULATION_DTYPE, device=local.device)
            if piece.contributes:
                col_I[piece.offset : piece.offset + piece.length] = channel_sq_sums(
                    local, dim=1, acc_dtype=ACCUMULATION_DTYPE
                )
            out.append((m.name, col_I))
        return out

    def _two_phase(self, pack: _Pack, length: int) -> bool:
        """Whether a pack of ``length`` elements is reduced in two phases (global metadata: every rank agrees)."""
        n = reduce.group_size(pack.group)
        return n > 2 and (n - 1) * length * ACCUMULATION_DTYPE.itemsize > self._two_phase_min

    @torch.no_grad()
    def unit_sq_norms(self, names: Collection[str] | None = None) -> dict[str, Tensor]:
        """See :meth:`Executor.unit_sq_norms`: one packed reduction per distinct gather group, nothing else.

        A reduction is one ``all_gather`` (or, for large packs, ``all_to_all`` + ``all_gather``, same bits).
        """
        return self.reduce(weights=names).q

    @torch.no_grad()
    def reduce(
        self,
        *,
        shard_riders: Mapping[str, Tensor] | None = None,
        data_riders: Mapping[str, Tensor] | None = None,
        columns: bool = False,
        weights: Collection[str] | None = None,
    ) -> Reduced:
        """See :meth:`Executor.reduce`: the riders and columns travel in the same packed vector as ``Q``.

        Each cluster's segment is ``[Q partial | shard rider | reader column partials | data rider]``; still one
        reduction per distinct gather group (a data-aware executor gathers every cluster over its whole mesh).
        """
        shard_riders, data_riders = shard_riders or {}, data_riders or {}
        out = Reduced({})
        for rc in self._ungathered:  # every member replicated and a one-rank (or weight-only) group: all complete
            if weights is None or rc.name in weights:
                out.q[rc.name] = self._partial(rc)
            if rc.name in shard_riders:
                out.shard[rc.name] = shard_riders[rc.name]
            if rc.name in data_riders:
                out.data[rc.name] = data_riders[rc.name]
            if columns:
                out.columns.update(self._columns_partial(rc))
        for pack in self._packs:
            parts: list[Tensor] = []
            layout: list[tuple[str, str, int]] = []  # (kind, key, length) in packing order
            for rc in pack.clusters:
                segment = [("q", rc.name, self._partial(rc))] if weights is None or rc.name in weights else []
                if rc.name in shard_riders:
                    segment.append(("shard", rc.name, shard_riders[rc.name]))
                if columns:
                    segment += [("columns", name, col) for name, col in self._columns_partial(rc)]
                if rc.name in data_riders:
                    segment.append(("data", rc.name, data_riders[rc.name]))
                for kind, key, tensor in segment:
                    parts.append(tensor.to(ACCUMULATION_DTYPE).reshape(-1))
                    layout.append((kind, key, tensor.numel()))
            if not parts:  # nothing of this pack is read (every rank skips the same packs: the same `weights`)
                continue
            buffer_L = torch.cat(parts)
            two_phase = self._two_phase(pack, buffer_L.numel())
            gather_sum = reduce.scatter_gather_sum if two_phase else reduce.gather_sum
            summed_L = gather_sum(buffer_L, group=pack.group, order=pack.order)
            start = 0
            for kind, key, length in layout:
                getattr(out, kind)[key] = summed_L[start : start + length]
                start += length
        return out

    # ------------------------------------------------------------------ masking
    def _apply_member(self, target: Tensor, rc: ResolvedCluster, m: Member, action: UnitAction) -> None:
        piece = self._pieces[(rc.name, m.name)]
        param = cast("DTensor", self.params[m.name])
        in_place = dtensor.is_dtensor(target) and tuple(target.placements) == tuple(param.placements)
        if in_place:
            local = dtensor.local_tensor(target)
            offset, length = piece.offset, piece.length
        else:  # a gradient laid out differently: same decision on every rank (placements are global metadata)
            target = cast("DTensor", target)  # its mesh and placements are read (a plain tensor has none)
            if not reduce.mesh_is_increasing(target.device_mesh):
                raise ValueError(
                    f"Cluster {rc.name!r}, member {m.name!r}: the gradient is laid out as {tuple(target.placements)}, "
                    "unlike its parameter, on a mesh whose ranks do not increase along every axis, where torch's "
                    "full_tensor is wrong; keep gradients in their parameter's layout."
                )
            local = dtensor.full_tensor(target).clone()
            offset, length = 0, local.shape[m.dim]
        if action.factors is not None:
            scale_units_(local, m, action.factors, offset=offset, length=length)
        else:
            self._zero_units(local, rc, m, action.dropped, offset=offset, length=length)
        if not in_place:
            dtensor.write_back_(target, local)

    @torch.no_grad()
    def apply(self, actions: Mapping[str, UnitAction], *, grads: bool = False) -> None:
        """See :meth:`Executor.apply`: in place on each rank's local pieces (weights or gradients)."""
        for rc in self.clusters:
            action = actions.get(rc.name)
            if action is None:
                continue
            for m in rc.members:
                target = self.params[m.name].grad if grads else self.params[m.name]
                if target is not None:
                    self._apply_member(target, rc, m, action)

    # ------------------------------------------------------------------ counts
    @torch.no_grad()
    def zero_counts(self) -> dict[str, tuple[int, int]]:
        """See :meth:`Executor.zero_counts`: local counts by counting replicas, one int64 all_reduce per mesh."""
        out: dict[str, tuple[int, int]] = {}
        for group, names in self._count_groups:
            local = [
                count_zeros(dtensor.local_tensor(self.params[n]))
                if dtensor.is_counting_replica(self.params[n])
                else torch.zeros((), dtype=torch.int64, device=dtensor.local_tensor(self.params[n]).device)
                for n in names
            ]
            counts = reduce.reduce_counts(torch.stack(local).to(torch.int64), group=group).tolist()
            out.update({n: (c, self.params[n].numel()) for n, c in zip(names, counts, strict=True)})
        return out
