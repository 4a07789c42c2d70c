"""``shrink_on_freeze`` under FSDP2: the model cut to its kept units and sharded again at its new size, in place.

:func:`shrink_sharded` is the FSDP2 counterpart of :func:`lightning_pat.shrink.entry.shrink_for_training`. No rank
ever holds the whole model: at most one ``fully_shard`` group (a decoder layer, or the root's embedding, norm and
head) is whole at a time, and one kind of tensor of it at a time (its parameters, then each kind of optimizer state),
as FSDP2's own forward gathers one group at a time.

1. **Checked before anything changes**: the plan against the live model and its optimizers' state (the one-device
   shrink's checks, on the DTensors' global shapes), the layouts this path serves (FSDP2's default ``Shard(0)``
   per ``fully_shard`` group; no dropped layer units).
2. **Metadata, once for the whole model**: every ``fully_shard`` is undone in place
   (:func:`~lightning_pat.parallel.comm.fsdp2.strip_fully_shard`: the module objects stay, so hooks and references
   on them stay valid), every parameter is replaced by a placeholder on the meta device of its global shape, and
   :func:`~lightning_pat.shrink.surgery.apply_plan` rewrites the module metadata, head counts and the config exactly
   as on one device, allocating nothing.
3. **Values, one group at a time, bottom-up** (decoder layers, then the root): the group's parameter shards are
   gathered with **one** packed all-gather (:func:`~lightning_pat.parallel.comm.fsdp2.gather_packed`, in the stored
   dtype, never FSDP2's ``param_dtype``; a tensor-parallel axis is then gathered per tensor), each cut parameter gets
   its value from the shrink's own rules (:class:`~lightning_pat.shrink.values.ValueCut`: the slicing and the
   RMSNorm rescale), the group is sharded again
   with the settings it had (:func:`~lightning_pat.parallel.comm.fsdp2.shard_again`: same mesh,
   ``reshard_after_forward``, ``MixedPrecisionPolicy``, offload policy; uneven shards where the kept count does not
   divide the world size, as FSDP2 pads them); then each kind of optimizer state is gathered the same way (one packed
   all-gather per kind: 3 collectives per group for Adam), sliced like its parameter (``exp_avg``, ``exp_avg_sq``,
   momentum; scalars such as ``step`` kept) and laid out like the new parameter (each rank keeps its own rows), and
   every optimizer's param groups point at the new parameters.

The parameters are new objects (a DTensor cannot change its global shape): the returned mapping gives each
parameter's new object by name, for whoever kept references (the pruning plan's executors). Gradients are dropped
(the freeze comes right after a real optimizer step). The distillation teacher is a separate copy and is not touched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_pat.core.selection import num_to_drop
from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.parallel.comm import dtensor, fsdp2
from lightning_pat.shrink import depth
from lightning_pat.shrink.edits import validate
from lightning_pat.shrink.plan import ShrinkPlan, align_names, build_plan
from lightning_pat.shrink.surgery import apply_plan
from lightning_pat.shrink.values import ValueCut

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """One ``fully_shard`` group: its module, settings, FSDP2 mesh dims and the names of the parameters it manages."""

    module: nn.Module
    settings: fsdp2.ShardSettings
    dims: tuple[str, ...]
    names: list[str]


def _slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """``id(parameter)`` -> every ``(module, attribute)`` that holds it (a tied parameter has several)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():  # noqa: SLF001 - a module's own parameters
            if param is not None:
                out.setdefault(id(param), []).append((module, attr))
    return out


def _groups(model: nn.Module) -> tuple[list[_Group], list[str]]:
    """The ``fully_shard`` groups bottom-up (each module after its descendants), and the parameters of none."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    claimed: set[int] = set()
    groups: list[_Group] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        settings = fsdp2.shard_settings(module)
        if settings is None:
            return
        names = []
        for param in module.parameters():
            if id(param) not in claimed:
                claimed.add(id(param))
                names.append(first[id(param)])
        groups.append(_Group(module, settings, fsdp2.fsdp2_mesh_dims(module) or (), names))

    visit(model)
    rest = [name for pid, name in first.items() if pid not in claimed]
    return groups, rest


def _check_layout(model: nn.Module, groups: Sequence[_Group], rest: Sequence[str]) -> None:
    """Refuse, before anything changes, a layout this path does not serve (naming the parameter and the fix)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if not groups:
        raise ValueError(
            f"shrink_sharded: {type(model).__name__} has no fully_shard module; a model on one device shrinks with "
            "lightning_pat.shrink.entry.shrink_for_training."
        )
    loose = [n for n in rest if dtensor.is_dtensor(params[n])]
    if loose:
        raise ValueError(
            f"shrink_sharded: the plan cuts {loose[:3]}, DTensors that no fully_shard group manages (tensor parallel "
            "without FSDP2); only FSDP2 layouts are sharded again at a new size. Apply fully_shard over the "
            "data-parallel axis too, or set shrink_on_freeze=False."
        )


def _tensor_parallel_splits(
    model: nn.Module, groups: Sequence[_Group], rc: ResolvedCluster
) -> list[tuple[str, Tensor, str, int, object]]:
    """Where a tensor-parallel axis splits a member of ``rc`` along its cut dim.

    A tensor-parallel axis: a mesh axis of the parameter that no ``fully_shard`` group of it shards over. Each entry
    is ``(parameter name, parameter, mesh axis, axis size, placement)``.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    fsdp_dims = {id(params[n]): set(g.dims) for g in groups for n in g.names}
    out: list[tuple[str, Tensor, str, int, object]] = []
    for name, dims in align_names(build_plan([rc], {rc.name: [0]}), model).keep.items():
        param = params[name]
        if not dtensor.is_dtensor(param):
            continue
        axes = param.device_mesh.mesh_dim_names or ()
        for axis, placement in zip(axes, param.placements, strict=True):
            split = placement.is_shard() and getattr(placement, "dim", None) in dims
            if split and axis not in fsdp_dims.get(id(param), set()):
                out.append((name, param, axis, param.device_mesh.size(axes.index(axis)), placement))
    return out


def _check_tensor_parallel(
    model: nn.Module,
    groups: Sequence[_Group],
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, Sequence[int]],
) -> None:
    """A cut along a tensor-parallel dim must leave every rank whole units: the kept count divides by the axis size."""
    for rc in clusters:
        units = set(dropped.get(rc.name, ()))
        if not units:
            continue
        kept = rc.num_units - len(units)
        for name, param, axis, size, placement in _tensor_parallel_splits(model, groups, rc):
            if kept % size:
                raise ValueError(
                    f"shrink_sharded: cluster {rc.name!r} keeps {kept} of {rc.num_units} units, and {name!r} "
                    f"(shape {tuple(param.shape)}) is split along the cut dim over mesh axis {axis!r} of {size} "
                    f"ranks ({placement}): {kept} units do not divide into whole units per rank. Prune to a kept "
                    f"count that divides by {size} (multiple_of={size} on the cluster; a size target, "
                    "target_params or target_flops, rounds to it by itself), use a tensor-parallel size that "
                    "divides it, or set shrink_on_freeze=False and shrink after fit."
                )


def tensor_parallel_multiples(module: nn.Module, clusters: Sequence[ResolvedCluster]) -> dict[str, int]:
    """Per cluster cut along a tensor-parallel dim, the kept-count multiple the sharded shrink needs.

    The least common multiple of the cluster's ``multiple_of`` and the size of every tensor-parallel mesh axis that
    splits one of its members along its cut dim: a size target solved with it keeps counts that every rank of those
    axes holds whole units of (see :func:`shrink_sharded`). Clusters that need nothing more are left out. Global
    metadata only: no communication, nothing changes.

    Args:
        module: The sharded module the clusters were resolved against.
        clusters: The resolved clusters.

    Returns:
        Cluster name -> the new ``multiple_of`` (only where it is larger than the cluster's own).
    """
    if not any(dtensor.is_dtensor(p) for p in module.parameters()):
        return {}
    groups = _groups(module)[0]
    out = {}
    for rc in clusters:
        if rc.num_units < 2:
            continue
        multiple = math.lcm(rc.multiple_of, *(size for *_, size, _ in _tensor_parallel_splits(module, groups, rc)))
        if multiple > rc.multiple_of:
            out[rc.name] = multiple
    return out


def _state_tensors(optimizers: Sequence[torch.optim.Optimizer], param: Tensor) -> list[tuple[int, str, Tensor]]:
    """``(optimizer index, key, tensor)`` of every state tensor shaped like ``param`` (scalars such as ``step`` not)."""
    out = []
    for i, opt in enumerate(optimizers):
        for key, value in opt.state.get(param, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0:
                out.append((i, key, value))
    return out


def _replace(optimizers: Sequence[torch.optim.Optimizer], old: Tensor, new: nn.Parameter) -> None:
    """Every optimizer's param groups point at ``new`` where they held ``old``; its state moves with it."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        if old in opt.state:
            opt.state[new] = opt.state.pop(old)


def _gather(group: _Group | None, tensors: Sequence[Tensor]) -> list[Tensor]:
    """The group's tensors whole on this rank: one packed all-gather over FSDP2's axes, then tensor parallelism's."""
    if group is None:
        return [t.detach() for t in tensors]
    return [dtensor.full_tensor(g) for g in fsdp2.gather_packed(tensors, group.dims)]


def _cut_group(
    module: nn.Module,
    group: _Group | None,
    names: Sequence[str],
    *,
    old: Mapping[str, Tensor],
    stand_ins: Mapping[str, Tensor],
    plan: ShrinkPlan,
    values: ValueCut | None,
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """One group: its parameters cut and sharded again, then its optimizer state, one kind at a time.

    The parameters are gathered with one packed all-gather, cut and sharded again; then each kind of state
    (``exp_avg``, ``exp_avg_sq``, ...: one packed all-gather each) is sliced and laid out like the new parameters. One
    kind at a time, so that a rank holds the group whole once (plus the gather's buffers), not three times.
    """
    slots = _slots(module)
    dims = group.dims if group is not None else ()
    tensors = [old[n] for n in names]
    # tensor parallelism's layout beside FSDP2's: whole here, laid out like that again below
    tp_layout = {n: lay for n, t in zip(names, tensors, strict=True) if (lay := fsdp2.outside_layout(t, dims))}
    if values is None:  # restore: the shapes only, the values are about to be loaded (no communication)
        local = {n: dtensor.local_tensor(t) for n, t in zip(names, tensors, strict=True)}
        whole = {n: torch.zeros(stand_ins[n].shape, dtype=t.dtype, device=t.device) for n, t in local.items()}
    else:
        gathered = fsdp2.gather_packed(tensors, dims) if group is not None else [t.detach() for t in tensors]
        whole = {n: dtensor.full_tensor(g) for n, g in zip(names, gathered, strict=True)}
        del gathered
        whole.update(values.cut({n: whole[n] for n in names if n in plan.keep}))
    for name in names:
        value = whole.pop(name)
        value = dtensor.distribute_on(value, *tp_layout[name]) if name in tp_layout else value
        param = nn.Parameter(value, requires_grad=old[name].requires_grad)
        for owner, attr in slots[id(stand_ins[name])]:
            owner._parameters[attr] = param  # noqa: SLF001 - replaced in every module that holds it
    del whole, value, param
    if group is not None:
        fsdp2.shard_again(group.module, group.settings)
    placed = {n: p for n, p in module.named_parameters(remove_duplicate=False) if n in names}
    if values is None:  # restore: the state is about to be loaded for the new parameters
        for opt in optimizers:
            for name in names:
                opt.state.pop(old[name], None)
    kinds: dict[tuple[int, str], list[tuple[str, Tensor]]] = {}
    for name in names:
        for i, key, value in _state_tensors(optimizers, old[name]):
            kinds.setdefault((i, key), []).append((name, value))
    for (i, key), entries in kinds.items():  # the same kinds in the same order on every rank (global metadata)
        for (name, _), full in zip(entries, _gather(group, [v for _, v in entries]), strict=True):
            sliced = plan.slice(name, full) if name in plan.keep else full
            like = placed[name]
            laid = dtensor.as_dtensor(dtensor.shard_like(sliced, like), like) if dtensor.is_dtensor(like) else sliced
            optimizers[i].state[old[name]][key] = laid
    for name in names:
        _replace(optimizers, old[name], placed[name])


def check_kept_counts(module: nn.Module, clusters: Sequence[ResolvedCluster], targets: Mapping[str, float]) -> None:
    """Refuse, before training, the kept counts :func:`shrink_sharded` could not shard again at the freeze.

    With ``shrink_on_freeze`` on a tensor-parallel model: a cluster cut along a tensor-parallel dim must keep a count
    that divides by that axis's size. The count each cluster keeps at ``targets`` (its final sparsity) is known
    before the ramp unless the cluster shares a budget with others (then it is checked at the freeze); a trial
    mask of that count is checked as :func:`shrink_sharded` checks the real one. Nothing changes; no communication.

    Args:
        module: The sharded module the clusters were resolved against.
        clusters: The resolved clusters.
        targets: Cluster name -> final sparsity.

    Raises:
        ValueError: Naming the cluster, its kept count, the parameter, the mesh axis and the fix.
    """
    if not any(dtensor.is_dtensor(p) for p in module.parameters()):
        return
    trial = {}
    for rc in clusters:
        if rc.budget is None and rc.name in targets:
            num = num_to_drop(targets[rc.name], rc.num_units, multiple_of=rc.multiple_of)
            if 0 < num < rc.num_units:
                trial[rc.name] = list(range(num))
    _check_tensor_parallel(module, _groups(module)[0], clusters, trial)


def restore_shrunk_sharded(
    module: nn.Module,
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, Sequence[int]],
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, nn.Parameter]:
    """Give a freshly sharded full-size model the shapes and layout :func:`shrink_sharded` left, to load a checkpoint.

    The resume of a fit after a sharded ``shrink_on_freeze``: the checkpoint (a torch distributed checkpoint) holds
    the small tensors, so the model must have their shapes before it is loaded. Same steps as :func:`shrink_sharded`
    without the values: no communication; the parameters are zeros until the checkpoint's values are loaded, and
    the optimizers' param groups point at the new parameters with no state (the checkpoint's is loaded for them).

    Args:
        module: The full-size module, sharded as in the run that wrote the checkpoint.
        clusters: The saved clusters.
        dropped: The saved frozen mask.
        optimizers: The optimizers, before their state is loaded.

    Returns:
        Parameter name -> the new parameter object.

    Raises:
        ValueError: As for :func:`shrink_sharded`.
    """
    return _shrink(module, clusters, dropped, optimizers=optimizers, values=False)


def shrink_sharded(
    module: nn.Module,
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, Sequence[int]],
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, nn.Parameter]:
    """Cut an FSDP2-sharded model to its kept units and shard it again at its new size, with its optimizers' state.

    Collective: every rank of the model's mesh calls it with the same clusters and dropped units (the frozen mask,
    identical on every rank) between two training steps. See the module docstring for the steps and the memory.

    Args:
        module: The module the clusters were resolved against (the LightningModule), or a module inside it named by
            them after a common prefix; ``fully_shard`` applied to its decoder layers and its root (or any groups).
        clusters: The resolved clusters.
        dropped: The frozen mask: cluster name -> dropped unit indices.
        optimizers: The optimizers training ``module`` (``SGD``, ``Adam``, ``AdamW``: state shaped like the
            parameter, or scalars).

    Returns:
        Parameter name (as ``module.named_parameters()`` gives it) -> the new parameter object.

    Raises:
        ValueError: Before anything changes: if the module has no ``fully_shard`` group, the plan cuts a DTensor that
            no group manages, a cluster's kept count does not divide by the size of a tensor-parallel axis that splits
            a member along its cut dim, a group was sharded with a ``shard_placement_fn``, the plan drops whole
            layers, or as for :func:`~lightning_pat.shrink.surgery.apply_plan` (a member the shrink cannot rewrite,
            partial heads, optimizer state it cannot slice).
    """
    return _shrink(module, clusters, dropped, optimizers=optimizers, values=True)


def _shrink(
    module: nn.Module,
    clusters: Sequence[ResolvedCluster],
    dropped: Mapping[str, Sequence[int]],
    *,
    optimizers: Sequence[torch.optim.Optimizer],
    values: bool,
) -> dict[str, nn.Parameter]:
    cut = depth.split_layers(clusters, dropped)
    if cut.prefixes:
        raise ValueError(
            f"shrink_sharded: the mask drops whole layers ({list(cut.prefixes)[:3]}), which shrink_on_freeze does not "
            "remove from a sharded model yet; set shrink_on_freeze=False (the export after fit removes them)."
        )
    plan = align_names(build_plan(cut.clusters, cut.dropped), module)
    groups, rest = _groups(module)
    rest = [n for n in rest if n in plan.keep]  # a parameter of no group that is not cut is left as it is
    _check_layout(module, groups, rest)
    _check_tensor_parallel(module, groups, cut.clusters, cut.dropped)
    validate(
        module, plan, optimizers if values else ()
    )  # the one-device checks, on global shapes: nothing has changed yet
    # ---- validated; mutate from here on
    for each in groups:
        fsdp2.strip_fully_shard(each.module)
    cutter = ValueCut(module, plan) if values else None
    slots = _slots(module)
    old = dict(module.named_parameters(remove_duplicate=False))
    for name in [*(n for g in groups for n in g.names), *rest]:
        param = old[name]
        stand_in = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), param.requires_grad)
        for owner, attr in slots[id(param)]:
            owner._parameters[attr] = stand_in  # noqa: SLF001 - replaced in every module that holds it
    apply_plan(module, plan, check_zeros=False)  # metadata, head counts, config: on meta, nothing allocated
    stand_ins = dict(module.named_parameters(remove_duplicate=False))
    batches: list[tuple[_Group | None, list[str]]] = [(g, g.names) for g in groups]
    for group, names in [*batches, (None, list(rest))]:  # bottom-up; then the parameters of no group (plain)
        if names:
            _cut_group(
                module, group, names, old=old, stand_ins=stand_ins, plan=plan, values=cutter, optimizers=optimizers
            )
    log.info(
        "shrink_on_freeze: %d fully_shard groups cut and sharded again (%d parameters cut)", len(groups), len(plan.keep)
    )
    return dict(module.named_parameters(remove_duplicate=False))
