"""A frozen copy of a module whose parameters are DTensors (FSDP2, tensor parallel, both), sharded like it.

``fully_shard`` forbids ``copy.deepcopy`` (its state is not copyable) and gathering the model to copy it would
defeat the sharding, so :func:`sharded_frozen_copy` copies the module tree by hand:

* every module becomes an instance of its original class (the ``FSDP<Class>`` swap and FSDP2's state are left
  behind); other attributes are deep-copied, the objects in ``share`` and every device mesh are shared;
* every parameter becomes a detached clone of the same DTensor (same mesh, same placements: each rank copies only
  its own shard, no communication), with ``requires_grad=False``; buffers are cloned;
* hooks are dropped, except the input/output layout hooks of tensor parallelism (``parallelize_module``'s, defined
  in ``torch.distributed.tensor``), which the copy needs to lay out its activations like the original;
* each module whose parameters FSDP2 managed gets a forward pre-hook that gathers them along FSDP2's mesh axes (as
  FSDP2's unshard does: a plain tensor, or a DTensor on the tensor-parallel sub-mesh) and a forward hook that puts
  the shards back. The copy's forward therefore holds one module's gathered parameters at a time, like FSDP2, and
  is meant for ``no_grad`` (its parameters never get gradients). Unlike FSDP2 it gathers parameter by parameter
  (no bucketing) and ignores a mixed-precision policy (it computes in the parameters' dtype).
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from lightning_pat.parallel import distributed

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
    return any(distributed.is_dtensor(p) for p in module.parameters())


def _is_layout_hook(hook: Any) -> bool:
    fn = hook.func if isinstance(hook, functools.partial) else hook
    return str(getattr(fn, "__module__", "") or "").startswith(_LAYOUT_HOOKS)


def _meshes(module: nn.Module) -> Iterable[Any]:
    for tensor in (*module.parameters(), *module.buffers()):
        if distributed.is_dtensor(tensor):
            yield tensor.device_mesh
    for sub in module.modules():
        for value in sub.__dict__.values():
            if distributed.is_device_mesh(value):
                yield value


class _Unshard:
    """Forward hooks of one copied module: gather its own parameters along ``dims`` before, shards back after."""

    def __init__(self, dims: tuple[str, ...]) -> None:
        self.dims = dims
        self._held: list[dict[str, Any]] = []

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        params = module._parameters  # noqa: SLF001 - swapped in place, as FSDP2 does
        self._held.append(dict(params))
        for name, param in list(params.items()):
            if param is not None:
                params[name] = distributed.gather_axes(param, self.dims)  # type: ignore[assignment]

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._held:
            module._parameters.update(self._held.pop())  # noqa: SLF001


def _managing_dims(module: nn.Module) -> dict[int, tuple[str, ...]]:
    """``id(submodule)`` -> FSDP2 mesh dims of the ``fully_shard`` group that manages its own parameters."""
    out: dict[int, tuple[str, ...]] = {}

    def visit(mod: nn.Module, dims: tuple[str, ...]) -> None:
        own = distributed.fsdp2_mesh_dims(mod)
        dims = own if own is not None else dims
        out[id(mod)] = dims
        for child in mod.children():
            visit(child, dims)

    visit(module, ())
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
    dims_of = _managing_dims(module)
    memo: dict[int, Any] = {id(obj): obj for obj in share if obj is not None}
    memo.update({id(mesh): mesh for mesh in _meshes(module)})
    copies: dict[int, nn.Module] = {}
    for mod in modules:
        cls = distributed.unsharded_class(mod)
        copies[id(mod)] = cls.__new__(cls)
    memo.update(copies)
    clones: dict[int, nn.Parameter] = {}
    for mod in modules:
        new = copies[id(mod)]
        skip = {"_parameters", "_buffers", "_modules", *HOOK_DICTS, *_FSDP_FLAGS}
        for key, value in mod.__dict__.items():
            if key not in skip and not distributed.is_composable_state_key(key):
                new.__dict__[key] = copy.deepcopy(value, memo)
        params: dict[str, Any] = {}
        for name, param in mod._parameters.items():  # noqa: SLF001
            if param is not None and dims_of[id(mod)] and not distributed.is_dtensor(param):
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
        if dims_of[id(mod)] and any(p is not None for p in params.values()):
            unshard = _Unshard(dims_of[id(mod)])
            new.register_forward_pre_hook(unshard.pre)
            new.register_forward_hook(unshard.post, always_call=True)
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
        local: Tensor = distributed.local_tensor(tensor)
        total += local.numel() * local.element_size()
    return total
