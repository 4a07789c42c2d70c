"""A frozen copy of a module whose parameters are DTensors (FSDP2, tensor parallel, both), sharded like it.

``fully_shard`` forbids ``copy.deepcopy`` (its state is not copyable) and gathering the model to copy it would
defeat the sharding, so :func:`sharded_frozen_copy` copies the module tree by hand:

* every module becomes an instance of its original class (the ``FSDP<Class>`` swap and FSDP2's state are left
  behind); other attributes are deep-copied, the objects in ``share`` and every device mesh are shared;
* every parameter becomes a detached clone of the same DTensor (same mesh, same placements: each rank copies only
  its own shard, no communication), with ``requires_grad=False``; buffers are cloned;
* hooks are dropped, except the input/output layout hooks of tensor parallelism (``parallelize_module``'s, defined
  in ``torch.distributed.tensor``), which the copy needs to lay out its activations like the original;
* each module passed to ``fully_shard`` gets FSDP2's forward hooks back, in the copy's own form: before its forward,
  the parameters its group manages (its own and those of descendants not sharded on their own) are gathered along
  FSDP2's mesh axes with **one** all-gather (:func:`~lightning_pat.parallel.comm.fsdp2.gather_packed`: the local
  shards packed into one flat buffer, uneven shards included; a DTensor also sharded by tensor parallelism stays a
  DTensor on the tensor-parallel sub-mesh, as FSDP2's unshard gives it); after it, the shards are put back. The
  group's ``MixedPrecisionPolicy`` is honoured as FSDP2 does: floating-point shards are cast to ``param_dtype``
  before the gather (the teacher computes in the student's dtype), floating-point inputs are cast to it
  (``cast_forward_inputs``) and outputs to ``output_dtype``.

The copy's forward therefore issues the same number of parameter gathers as FSDP2's (one per ``fully_shard`` group)
and holds the same gathered parameters at a time; it is meant for ``no_grad`` (its parameters never get gradients).
It keeps the parameters in their stored dtype (the shards cost what the student's cost) and does not prefetch the
next group's gather (FSDP2 overlaps it with compute on GPUs).
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from lightning_pat.parallel.comm import dtensor, fsdp2

#: The hook dictionaries of ``nn.Module`` (dropped from copies, except tensor-parallel layout hooks).
HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip
_ID_DICTS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
_LAYOUT_HOOKS = "torch.distributed.tensor"  # parallelize_module's input/output layout hooks are defined there
_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def has_dtensors(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is a DTensor (FSDP2 or tensor parallel)."""
    return any(dtensor.is_dtensor(p) for p in module.parameters())


def _is_layout_hook(hook: Any) -> bool:
    fn = hook.func if isinstance(hook, functools.partial) else hook
    return str(getattr(fn, "__module__", "") or "").startswith(_LAYOUT_HOOKS)


def _meshes(module: nn.Module) -> Iterable[Any]:
    for tensor in (*module.parameters(), *module.buffers()):
        if dtensor.is_dtensor(tensor):
            yield tensor.device_mesh
    for sub in module.modules():
        for value in sub.__dict__.values():
            if dtensor.is_device_mesh(value):
                yield value


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (itself when ``dtype`` is ``None``)."""
    if dtype is None:
        return tree
    return tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class _Unshard:
    """Forward hooks of one copied ``fully_shard`` module, as FSDP2's: gather its group's parameters, shards back.

    Args:
        members: The copied module and its descendants whose own parameters its ``fully_shard`` group manages.
        dims: The mesh dim names of FSDP2's mesh.
        policy: The group's ``MixedPrecisionPolicy`` (``None``: none).
    """

    def __init__(self, members: list[nn.Module], dims: tuple[str, ...], policy: Any) -> None:
        self.members, self.dims = members, dims
        self.param_dtype: torch.dtype | None = getattr(policy, "param_dtype", None)
        cast = bool(getattr(policy, "cast_forward_inputs", False))
        self.input_dtype = self.param_dtype if cast else None
        self.output_dtype: torch.dtype | None = getattr(policy, "output_dtype", None)
        self._held: list[list[dict[str, Any]]] = []

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        held = [dict(m._parameters) for m in self.members]  # noqa: SLF001 - swapped in place, as FSDP2 does
        self._held.append(held)
        unique = {id(p): p for saved in held for p in saved.values() if p is not None}  # tied parameters once
        if unique:
            gathered = fsdp2.gather_packed(list(unique.values()), self.dims, dtype=self.param_dtype)
            full = dict(zip(unique, gathered, strict=True))
            for member, saved in zip(self.members, held, strict=True):
                for name, param in saved.items():
                    if param is not None:
                        member._parameters[name] = full[id(param)]  # type: ignore[assignment]  # noqa: SLF001
        return _cast(args, self.input_dtype), _cast(kwargs, self.input_dtype)

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self._held:
            for member, saved in zip(self.members, self._held.pop(), strict=True):
                member._parameters.update(saved)  # noqa: SLF001
        return _cast(output, self.output_dtype)


def _groups(module: nn.Module) -> dict[int, list[nn.Module]]:
    """``id(fully_shard module)`` -> it and its descendants whose own parameters its group manages."""
    out: dict[int, list[nn.Module]] = {}
    seen: set[int] = set()

    def visit(mod: nn.Module, owner: nn.Module | None) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        if fsdp2.fsdp2_mesh_dims(mod) is not None:
            owner = mod
            out[id(mod)] = []
        if owner is not None:
            out[id(owner)].append(mod)
        for child in mod.children():
            visit(child, owner)

    visit(module, None)
    return out


def sharded_frozen_copy(module: nn.Module, *, share: tuple[Any, ...] = ()) -> nn.Module:
    """A frozen copy of ``module`` with every DTensor parameter cloned shard by shard (see the module docstring).

    Args:
        module: The module to copy (call it between training steps, when FSDP2 holds the sharded parameters).
        share: Objects referenced by the module that must not be copied (e.g. the Trainer).

    Returns:
        The copy, in eval mode, with ``requires_grad=False`` everywhere.

    Raises:
        ValueError: If a module managed by FSDP2 holds a parameter that is not a DTensor (a copy taken inside a
            forward, while FSDP2 holds gathered parameters), or FSDP2's mesh has no dim names.
    """
    modules = list(module.modules())
    groups = _groups(module)
    dims_of = {id(m): fsdp2.fsdp2_mesh_dims(owner) or () for owner in modules if id(owner) in groups
               for m in groups[id(owner)]}  # fmt: skip
    memo: dict[int, Any] = {id(obj): obj for obj in share if obj is not None}
    memo.update({id(mesh): mesh for mesh in _meshes(module)})
    copies: dict[int, nn.Module] = {}
    for mod in modules:
        cls = fsdp2.unsharded_class(mod)
        copies[id(mod)] = cls.__new__(cls)
    memo.update(copies)
    clones: dict[int, nn.Parameter] = {}
    for mod in modules:
        new = copies[id(mod)]
        skip = {"_parameters", "_buffers", "_modules", *HOOK_DICTS, *_FSDP_FLAGS}
        for key, value in mod.__dict__.items():
            if key not in skip and not fsdp2.is_composable_state_key(key):
                new.__dict__[key] = copy.deepcopy(value, memo)
        params: dict[str, Any] = {}
        for name, param in mod._parameters.items():  # noqa: SLF001
            if param is not None and dims_of.get(id(mod)) and not dtensor.is_dtensor(param):
                raise ValueError(
                    f"The teacher copy found {type(mod).__name__}.{name} gathered (a plain tensor under fully_shard): "
                    "copy the model between training steps, not inside a forward."
                )
            if param is not None and id(param) not in clones:
                clones[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
            params[name] = None if param is None else clones[id(param)]
        new.__dict__["_parameters"] = params
        new.__dict__["_buffers"] = {
            n: None if b is None else b.detach().clone()
            for n, b in mod._buffers.items()  # noqa: SLF001
        }
        new.__dict__["_modules"] = {n: None if c is None else copies[id(c)] for n, c in mod._modules.items()}  # noqa: SLF001
        for attr in HOOK_DICTS:
            hooks = getattr(mod, attr, None)
            if hooks is None:
                continue
            kept = OrderedDict(
                (k, h) for k, h in hooks.items() if attr in _ID_DICTS or _is_layout_hook(h)
            )  # fmt: skip
            new.__dict__[attr] = kept
        for attr in _ID_DICTS:  # flags of the hooks kept above only
            live = set(new.__dict__.get("_forward_hooks", {})) | set(new.__dict__.get("_forward_pre_hooks", {}))
            new.__dict__[attr] = OrderedDict((k, v) for k, v in new.__dict__.get(attr, {}).items() if k in live)
    for mod in modules:  # once every copy exists: one gather per fully_shard group, FSDP2's casts
        if id(mod) in groups:
            dims = fsdp2.fsdp2_mesh_dims(mod) or ()
            unshard = _Unshard([copies[id(m)] for m in groups[id(mod)]], dims, fsdp2.fsdp2_policy(mod))
            copies[id(mod)].register_forward_pre_hook(unshard.pre, with_kwargs=True, prepend=True)
            copies[id(mod)].register_forward_hook(unshard.post, always_call=True)
    teacher = copies[id(module)]
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def local_nbytes(module: nn.Module) -> int:
    """Bytes this rank holds for ``module``'s parameters and buffers (a DTensor's local shard only)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local: Tensor = dtensor.local_tensor(tensor)
        total += local.numel() * local.element_size()
    return total
