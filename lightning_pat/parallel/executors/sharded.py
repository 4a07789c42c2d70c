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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_pat.core.masking import count_zeros, scale_units_
from lightning_pat.core.scoring import ACCUMULATION_DTYPE, member_unit_sq_sums
from lightning_pat.core.spec import Member, ResolvedCluster
from lightning_pat.parallel import distributed, placement
from lightning_pat.parallel.executors.base import Executor, UnitAction


@dataclass(frozen=True)
class _Piece:
    """Where a member's local tensor sits along its channel axis, and whether its partial is summed."""

    offset: int
    length: int
    contributes: bool


@dataclass
class _Pack:
    """Clusters reduced together over ``group`` per step, summed in mesh-coordinate ``order``."""

    group: object
    order: list[int]
    clusters: list[ResolvedCluster]
    two_phase: bool = False


class ShardedExecutor(Executor):
    """Scores and masks eligible DTensor clusters on local shards (see module docstring).

    Raises:
        ValueError: If a member's layout is not eligible (see :func:`lightning_pat.parallel.placement.cluster_reason`).
    """

    kind = "sharded"
    #: Above this many bytes received per rank by the one-collective reduction ((n - 1) * L * itemsize), a pack
    #: is reduced with all_to_all + all_gather instead (2 (n - 1) / n * L elements; the same bits).
    two_phase_min_bytes: int = 4 << 20

    def __init__(self, clusters: Sequence[ResolvedCluster], params: Mapping[str, Tensor]) -> None:
        super().__init__(clusters, params)
        self._groups: dict[tuple[int, ...], object] = {}  # multi-axis process groups, owned by this executor
        self._pieces: dict[tuple[str, str], _Piece] = {}
        self._ungathered: list[ResolvedCluster] = []  # every member replicated: the local partial is complete
        packs: dict[tuple[tuple[int, ...], tuple[int, ...]], _Pack] = {}  # (group ranks, order) -> pack
        mismatches: list[str] = []
        for rc in self.clusters:
            first = self.params[rc.members[0].name]
            mesh = first.device_mesh
            coord = mesh.get_coordinate()
            placements = [tuple(self.params[m.name].placements) for m in rc.members]
            reason = placement.cluster_reason(rc, placements, mesh_shape=tuple(mesh.shape))
            if reason is not None:  # global metadata: every rank raises here, before any collective
                raise ValueError(f"Cluster {rc.name!r} cannot take the sharded path: {reason}.")
            axes = placement.gather_axes(placements)
            for m, ps in zip(rc.members, placements, strict=True):
                box = placement.local_box(m.shape, ps, mesh_shape=tuple(mesh.shape), coordinate=coord)
                local_shape = tuple(distributed.local_tensor(self.params[m.name]).shape)
                if local_shape != tuple(n for _, n in box):  # a torch whose DTensor layout differs from ours
                    mismatches.append(f"{m.name}: local shape {local_shape} != expected box {box} for {ps}")
                offset, length = box[m.dim]
                self._pieces[(rc.name, m.name)] = _Piece(
                    offset, length, placement.contributes(ps, coordinate=coord, axes=axes)
                )
            if not axes:
                self._ungathered.append(rc)
                continue
            group = distributed.axes_group(mesh, axes, cache=self._groups)
            order = distributed.gather_order(mesh, axes, group)
            packs.setdefault((distributed.group_key(group), tuple(order)), _Pack(group, order, [])).clusters.append(rc)
        self._packs = list(packs.values())
        for pack in self._packs:  # global metadata only: every rank of the group decides the same
            n = distributed.group_size(pack.group)
            itemsize = ACCUMULATION_DTYPE.itemsize
            one_phase_bytes = (n - 1) * sum(rc.num_units for rc in pack.clusters) * itemsize
            pack.two_phase = n > 2 and one_phase_bytes > self.two_phase_min_bytes
        counts: dict[tuple[int, ...], tuple[object, list[str]]] = {}  # whole-mesh group -> parameter names
        for name, tensor in self.params.items():
            group = distributed.mesh_group(tensor.device_mesh, cache=self._groups)
            counts.setdefault(distributed.group_key(group), (group, []))[1].append(name)
        self._count_groups = list(counts.values())
        # a local shape check must not make one rank raise while the others go on into a gather: agree first
        flags = [
            distributed.any_rank([bool(mismatches)], group=group)[0] for group, _ in self._count_groups
        ]  # no short cut
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
            local = distributed.local_tensor(self.params[m.name])
            if piece.contributes:
                part_C = member_unit_sq_sums(local, m, num_units=rc.num_units, acc_dtype=acc, offset=piece.offset)
            else:
                part_C = torch.zeros(rc.num_units, dtype=acc, device=local.device)
            q_C = part_C if q_C is None else q_C + part_C
        assert q_C is not None  # a resolved cluster has members
        return q_C

    @torch.no_grad()
    def unit_sq_norms(self) -> dict[str, Tensor]:
        """See :meth:`Executor.unit_sq_norms`: one packed reduction per distinct gather group, nothing else.

        A reduction is one ``all_gather`` (or, for large packs, ``all_to_all`` + ``all_gather``, same bits).
        """
        out = {rc.name: self._partial(rc) for rc in self._ungathered}
        for pack in self._packs:
            partials = [self._partial(rc) for rc in pack.clusters]
            buffer_L = torch.cat(partials)
            reduce = distributed.scatter_gather_sum if pack.two_phase else distributed.gather_sum
            q_L = reduce(buffer_L, group=pack.group, order=pack.order)
            start = 0
            for rc in pack.clusters:
                out[rc.name] = q_L[start : start + rc.num_units]
                start += rc.num_units
        return out

    # ------------------------------------------------------------------ masking
    def _apply_member(self, target: Tensor, rc: ResolvedCluster, m: Member, action: UnitAction) -> None:
        piece = self._pieces[(rc.name, m.name)]
        in_place = distributed.is_dtensor(target) and tuple(target.placements) == tuple(self.params[m.name].placements)
        if in_place:
            local = distributed.local_tensor(target)
            offset, length = piece.offset, piece.length
        else:  # a gradient laid out differently: same decision on every rank (placements are global metadata)
            if not distributed.mesh_is_increasing(target.device_mesh):
                raise ValueError(
                    f"Cluster {rc.name!r}, member {m.name!r}: the gradient is laid out as {tuple(target.placements)}, "
                    "unlike its parameter, on a mesh whose ranks do not increase along every axis, where torch's "
                    "full_tensor is wrong; keep gradients in their parameter's layout."
                )
            local = distributed.full_tensor(target).clone()
            offset, length = 0, local.shape[m.dim]
        if action.factors is not None:
            scale_units_(local, m, action.factors, offset=offset, length=length)
        else:
            self._zero_units(local, rc, m, action.dropped, offset=offset, length=length)
        if not in_place:
            distributed.write_back_(target, local)

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
                count_zeros(distributed.local_tensor(self.params[n]))
                if distributed.is_counting_replica(self.params[n])
                else torch.zeros((), dtype=torch.int64, device=distributed.local_tensor(self.params[n]).device)
                for n in names
            ]
            counts = distributed.reduce_counts(torch.stack(local).to(torch.int64), group=group).tolist()
            out.update({n: (c, self.params[n].numel()) for n, c in zip(names, counts, strict=True)})
        return out
