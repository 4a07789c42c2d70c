"""Describe an ``nn.Module`` as JSON plus named tensors, and rebuild it without pickle.

The description lists every submodule with its class path, its plain attributes (numbers, strings, tuples, lists,
dicts and allow-listed dict subclasses such as Lightning's ``AttributeDict``, dtypes, devices and dataclass configs
such as ``TinyGPTConfig``; what the module's ``__getstate__`` returns, as for pickle), its parameters and buffers
(names of tensors in the safetensors file; tied tensors are stored once) and its children in order. Rebuilding does
what unpickling a module does (``cls.__new__`` and the module's attribute dict), restricted to these plain values:
no constructor runs, no function named in the file is called.

Classes are allow-listed (:func:`resolve_class`): a class the caller passes in ``classes``, or an ``nn.Module``
subclass (a dataclass for configs, a dict subclass for mappings) defined in one of the model modules of
:data:`MODEL_MODULES` (``torch.nn.modules.*``, transformers' ``models.<family>.modeling_*``/``configuration_*`` and
``activations``, lightning_pat's own model modules, Lightning's ``AttributeDict``). The path is checked against that
list before anything is imported: a module outside it (a ``__main__``, a script, any other module of an allowed
package) is never imported. A user's own class (defined in a script, a notebook or a package of theirs) is passed by
the caller: ``load_pretrained(dir, classes=[MyNet])``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar, overload

import torch
from torch import Tensor, nn

_T = TypeVar("_T")


class _Dataclass(Protocol):
    """What a dataclass has (typeshed's ``DataclassInstance``): the type :func:`resolve_class` gives without a base."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


MODEL_MODULES: tuple[str, ...] = (
    r"torch\.nn\.modules\.[a-z_]+",
    r"transformers\.models\.[a-z0-9_]+\.(modeling|configuration)_[a-z0-9_]+",
    r"transformers\.(activations|modeling_utils|configuration_utils)",
    r"lightning_pat\.demo\.(model|task)",
    r"lightning_pat\.lm\.module",
    r"lightning_pat\.heads\.(mha|window|maxvit)",
    r"lightning_pat\.shrink\.depth",
    r"lightning_pat\.core\.(schedule|spec\.declaration)",
    r"lightning\.fabric\.utilities\.data",
    r"(lightning\.pytorch|pytorch_lightning)\.utilities\.parsing",
)
"""The modules (full-match patterns) whose ``nn.Module`` subclasses, dataclasses and dict subclasses an export may
name without being passed ``classes``; no other module named in a file is ever imported."""

#: Model modules that moved, old name -> new name: an export written before the move names the old module, and loads.
MOVED_MODULES: dict[str, str] = {
    "lightning_pat.shrink.mha_attention": "lightning_pat.heads.mha",
    "lightning_pat.shrink.window_attention": "lightning_pat.heads.window",
    "lightning_pat.shrink.maxvit_attention": "lightning_pat.heads.maxvit",
}

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
#: Set by ``load_pretrained`` on the module it rebuilt: the directory it was read from (an export never replaces it).
#: Never described: it is not state of the model, and a path of the loading machine does not go into an export.
SOURCE_ATTR = "_lightning_pat_source"


class UnsupportedStateError(ValueError):
    """A module holds a value that the safe format cannot describe (the message names it)."""


def class_path(cls: type) -> str:
    """``module.QualName`` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def model_module(name: str) -> bool:
    """Whether ``name`` is one of :data:`MODEL_MODULES` (the only modules a file's class path may import)."""
    return any(re.fullmatch(pattern, name) for pattern in MODEL_MODULES)


@overload
def resolve_class(path: object, *, classes: Iterable[type] = ()) -> type[nn.Module]: ...
@overload
def resolve_class(path: object, *, classes: Iterable[type] = (), base: type[_T]) -> type[_T]: ...
@overload
def resolve_class(path: object, *, classes: Iterable[type] = (), base: None) -> type[_Dataclass]: ...
def resolve_class(path: object, *, classes: Iterable[type] = (), base: type | None = nn.Module) -> type[Any]:
    """The class an export names, if it is allowed.

    Args:
        path: ``module.QualName`` read from the file.
        classes: Classes the caller allows explicitly (matched by their path, nothing is imported).
        base: The class must subclass it (``None``: it must be a dataclass; ``dict`` for a mapping attribute).

    Returns:
        The class.

    Raises:
        ValueError: If the path names a module outside :data:`MODEL_MODULES` (and no passed class), is not
            importable, or the object is not a subclass of ``base`` (a dataclass) defined under that path.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"load_pretrained: expected a class path, got {path!r}")
    old_module, _, name = path.rpartition(".")
    if old_module in MOVED_MODULES:
        path = f"{MOVED_MODULES[old_module]}.{name}"
    for cls in classes:
        if class_path(cls) == path:
            return cls
    kind = f"an {base.__module__}.{base.__qualname__} subclass" if base is not None else "a dataclass"
    parts = path.split(".")
    modules = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]  # longest module name first
    allowed = [m for m in modules if model_module(m)]
    if not allowed:
        raise ValueError(
            f"load_pretrained: the export names the class {path!r}, which is not in a model module lightning_pat "
            f"imports by itself (torch.nn.modules, transformers' model files, lightning_pat's models). If you trust "
            f"it, pass the class: load_pretrained(directory, classes=[{parts[-1]}])."
        )
    module_name = allowed[0]  # the longest allowed module name, then attributes (nested classes)
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            obj = None
    for attr in parts[module_name.count(".") + 1 :]:
        obj = getattr(obj, attr, None)
    if not (
        isinstance(obj, type)
        and class_path(obj) == path
        and (issubclass(obj, base) if base is not None else dataclasses.is_dataclass(obj))
    ):
        raise ValueError(f"load_pretrained: {path!r} is not {kind} (found {type(obj).__name__}); refused.")
    return obj


# ---------------------------------------------------------------------------------------------------- values
def _encode(value: Any, where: str) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.Size) or type(value) is tuple:
        return {"tuple": [_encode(v, where) for v in value]}
    if type(value) is list:
        return [_encode(v, where) for v in value]
    if isinstance(value, dict) and all(type(k) is str for k in value):
        out: dict[str, Any] = {"dict": {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
        if type(value) is not dict:  # e.g. Lightning's AttributeDict (hyperparameters)
            out["mapping"] = class_path(type(value))
        return out
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        if any(not f.init for f in fields):
            raise UnsupportedStateError(f"{where}: the dataclass {type(value).__name__} has fields set outside init")
        data = {f.name: _encode(getattr(value, f.name), f"{where}.{f.name}") for f in fields}
        return {"dataclass": class_path(type(value)), "fields": data}
    raise UnsupportedStateError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}")


def _decode(value: Any, classes: Iterable[type]) -> Any:
    if isinstance(value, list):
        return [_decode(v, classes) for v in value]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(_decode(v, classes) for v in value["tuple"])
    if "dict" in value:
        items = {k: _decode(v, classes) for k, v in value["dict"].items()}
        if "mapping" not in value:
            return items
        mapping = resolve_class(value["mapping"], classes=classes, base=dict)()
        mapping.update(items)
        return mapping
    if "device" in value:
        return torch.device(str(value["device"]))
    if "dtype" in value:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"load_pretrained: {value['dtype']!r} is not a torch dtype")
        return dtype
    if "dataclass" in value:
        cls = resolve_class(value["dataclass"], classes=classes, base=None)
        fields = {k: _decode(v, classes) for k, v in value["fields"].items()}
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) - names:
            raise ValueError(f"load_pretrained: {value['dataclass']} has no fields {sorted(set(fields) - names)}")
        obj = cls.__new__(cls)  # the fields as saved, without running __init__/__post_init__
        for k, v in fields.items():
            object.__setattr__(obj, k, v)
        return obj
    raise ValueError(f"load_pretrained: unknown value {value!r} in the export's module description")


# ---------------------------------------------------------------------------------------------------- describe
def describe(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The JSON description of ``model`` and the tensors to store (each tensor once, by its first name).

    Args:
        model: Any module.

    Returns:
        ``(description, tensors)``.

    Raises:
        UnsupportedStateError: If a module holds an attribute the format cannot store (a function, an object of
            another class); the message names the module and the attribute.
    """
    tensors: dict[str, Tensor] = {}
    names: dict[int, str] = {}  # id(tensor) -> its name in `tensors`
    storages: set[int] = set()
    modules: list[dict[str, Any]] = []
    seen: dict[int, str] = {}

    def store(full: str, tensor: Tensor) -> str:
        if id(tensor) not in names:
            data = tensor.detach().to("cpu").contiguous()
            ptr = data.untyped_storage().data_ptr()
            if ptr in storages and data.numel():  # a view of another stored tensor: safetensors wants distinct ones
                data = data.clone()
            storages.add(data.untyped_storage().data_ptr())
            names[id(tensor)] = full
            tensors[full] = data
        return names[id(tensor)]

    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen:
            modules.append({"name": name, "same_as": seen[id(module)]})
            continue
        seen[id(module)] = name
        prefix = f"{name}." if name else ""
        where = f"module {name or '(root)'} ({type(module).__name__})"
        attributes = {}
        state = module.__getstate__()  # what pickle would store (LightningModule leaves out its trainer)
        for key, value in (state if isinstance(state, dict) else vars(module)).items():
            if key in _MODULE_INTERNALS or key == SOURCE_ATTR:
                continue
            attributes[key] = _encode(value, f"{where}: attribute {key!r}")
        modules.append(
            {
                "name": name,
                "class": class_path(type(module)),
                "training": module.training,
                "attributes": attributes,
                "parameters": {
                    k: None if p is None else {"tensor": store(prefix + k, p), "requires_grad": p.requires_grad}
                    for k, p in module._parameters.items()
                },
                "buffers": {k: None if b is None else store(prefix + k, b) for k, b in module._buffers.items()},
                "non_persistent": sorted(module._non_persistent_buffers_set),
                "children": [[k, c is not None] for k, c in module._modules.items()],
            }
        )
    return {"modules": modules}, tensors


# ---------------------------------------------------------------------------------------------------- rebuild
def rebuild(
    description: Mapping[str, Any], tensors: Mapping[str, Tensor], *, classes: Iterable[type] = ()
) -> nn.Module:
    """Build the module :func:`describe` described, with ``tensors`` as its parameters and buffers.

    Args:
        description: What :func:`describe` returned (read from JSON).
        tensors: The stored tensors (read from safetensors).
        classes: Classes allowed besides those of :data:`MODEL_MODULES`.

    Returns:
        The module (same classes, attributes, parameter ties and ``requires_grad`` flags).

    Raises:
        ValueError: If a class is not allowed, a tensor is missing, or the description is malformed.
    """
    classes = list(classes)
    entries = description.get("modules") if isinstance(description, Mapping) else None
    if not isinstance(entries, list) or not entries or entries[0].get("name") != "":
        raise ValueError("load_pretrained: the export's module description has no root module")
    built: dict[str, nn.Module] = {}
    params: dict[str, nn.Parameter] = {}

    def tensor(key: object) -> Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise ValueError(f"load_pretrained: the export names tensor {key!r}, which its safetensors file lacks")
        return tensors[key]

    for entry in entries:
        name = entry["name"]
        if "same_as" in entry:
            module = built.get(entry["same_as"])
            if module is None:
                raise ValueError(f"load_pretrained: module {name!r} refers to unknown module {entry['same_as']!r}")
        else:
            cls = resolve_class(entry["class"], classes=classes)
            module = cls.__new__(cls)
            nn.Module.__init__(module)
            for key, value in entry["attributes"].items():
                if key in _MODULE_INTERNALS:
                    raise ValueError(f"load_pretrained: module {name!r} sets the internal attribute {key!r}")
                module.__dict__[key] = _decode(value, classes)
            module.training = bool(entry["training"])
            for key, spec in entry["parameters"].items():
                if spec is not None and spec["tensor"] not in params:
                    params[spec["tensor"]] = nn.Parameter(tensor(spec["tensor"]), bool(spec["requires_grad"]))
                module._parameters[key] = None if spec is None else params[spec["tensor"]]
            for key, ref in entry["buffers"].items():
                module._buffers[key] = None if ref is None else tensor(ref)
            module._non_persistent_buffers_set.update(entry["non_persistent"])
            for key, present in entry["children"]:
                module._modules[key] = None  # filled in order below; keeps the order of the original
                if not present:
                    continue
        if name:
            parent_name, _, attr = name.rpartition(".")
            parent = built.get(parent_name)
            if parent is None or attr not in parent._modules:
                raise ValueError(f"load_pretrained: module {name!r} has no parent in the export's description")
            parent._modules[attr] = module
        built[name] = module
    return built[""]
