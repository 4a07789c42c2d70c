"""The files of an export, checked before anything is built from them (they are untrusted input).

Every malformed field ends in one ``ValueError`` naming the file and the field, never a ``KeyError``, a
``TypeError`` or an allocation of whatever size a file asks for:

* :func:`read_json`: a JSON file (``config.json``, ``lightning_pat.json``, an index), that must decode to a mapping.
* :func:`check_entry`: the ``"lightning_pat"`` entry of a ``config.json`` (``class``, ``base_config``, ``shapes``,
  ``attributes``); :func:`entry_attributes` resolves its attributes against the built model.
* :func:`check_description`: the module description of ``lightning_pat.json`` (what
  :func:`~lightning_pat.export.module_tree.rebuild` reads), every field's type, before any class is resolved.
* :func:`header_shapes`: the shapes a safetensors file holds, read from its header alone (the header's length, dtypes,
  shapes and byte ranges checked against the file's size); :func:`check_shapes` compares them with the shapes a
  description promises, before a model of those shapes is built.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from torch import nn

from lightning_pat.core.safe_io import confined

#: Bytes per element of the safetensors dtypes.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4,
    "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20  # safetensors itself refuses headers above 100 MB


def read_json(directory: Path, name: str, *, what: str = "load_pretrained") -> dict[str, Any]:
    """The mapping a JSON file of ``directory`` holds (the name confined to the directory).

    Raises:
        ValueError: If the file is not JSON or does not hold a mapping (naming the file).
    """
    path = confined(directory, name, what=what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{what}: {path} is not a JSON file ({type(err).__name__}: {err}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object (a mapping), got a {type(data).__name__}.")
    return data


def _fail(where: str, field: str, expected: str, value: object) -> ValueError:
    shown = repr(value) if len(repr(value)) < 80 else f"a {type(value).__name__}"
    return ValueError(f"load_pretrained: {where}: `{field}` must be {expected}, got {shown}; write the export again.")


def _dims(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def check_shapes_field(shapes: object, where: str, field: str = "shapes") -> dict[str, list[int]]:
    """``shapes`` (parameter name -> list of non-negative ints), checked."""
    if not isinstance(shapes, Mapping) or not all(isinstance(k, str) and _dims(v) for k, v in shapes.items()):
        raise _fail(where, field, "a mapping of parameter names to lists of non-negative ints", shapes)
    return dict(shapes)


def check_entry(entry: Mapping[str, Any], where: str) -> None:
    """The fields of a ``config.json`` ``"lightning_pat"`` entry (or of what a DeciLM config describes).

    Raises:
        ValueError: Naming the field, what was expected and what was found.
    """
    if not isinstance(entry.get("class"), str):
        raise _fail(where, "class", "a transformers model class name", entry.get("class"))
    if not isinstance(entry.get("base_config"), Mapping):
        raise _fail(where, "base_config", "the config mapping the model is built from", entry.get("base_config"))
    check_shapes_field(entry.get("shapes"), where)
    if not isinstance(entry.get("attributes", {}), Mapping):
        raise _fail(where, "attributes", "a mapping", entry.get("attributes"))


def _check_value(value: object, where: str) -> None:
    """An encoded attribute value of :mod:`~lightning_pat.export.module_tree` (plain JSON or one tagged mapping)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_value(item, where)
        return
    ok = isinstance(value, Mapping) and (
        (set(value) == {"tuple"} and isinstance(value["tuple"], list))
        or (set(value) <= {"dict", "mapping"} and isinstance(value.get("dict"), Mapping)
            and isinstance(value.get("mapping", ""), str) and all(isinstance(k, str) for k in value["dict"]))
        or (set(value) == {"dtype"} and isinstance(value["dtype"], str))
        or (set(value) == {"device"} and isinstance(value["device"], str))
        or (set(value) == {"dataclass", "fields"} and isinstance(value["dataclass"], str)
            and isinstance(value["fields"], Mapping))
    )  # fmt: skip
    if not ok:
        raise ValueError(f"load_pretrained: {where} holds {str(value)[:80]!r}, which is not an encoded value.")
    assert isinstance(value, Mapping)  # for mypy: checked above
    for inner in ("tuple", "dict", "fields"):
        if inner in value:
            items = value[inner].values() if isinstance(value[inner], Mapping) else value[inner]
            for item in items:
                _check_value(item, where)


def check_description(info: Mapping[str, Any], where: str) -> None:
    """Every field of a module description (``lightning_pat.json``) that the rebuild reads, by type.

    Raises:
        ValueError: Naming the module (by index and name) and the field.
    """
    modules = info.get("modules")
    if not isinstance(modules, list) or not modules:
        raise _fail(where, "modules", "a non-empty list of module descriptions", modules)
    for i, module in enumerate(modules):
        at = f"{where} modules[{i}]"
        if not isinstance(module, Mapping) or not isinstance(module.get("name"), str):
            raise _fail(at, "name", "a module name (a string) in a mapping", module)
        at = f"{at} ({module['name'] or 'root'})"
        if "same_as" in module:
            if not isinstance(module["same_as"], str):
                raise _fail(at, "same_as", "a module name", module["same_as"])
            continue
        fields: dict[str, tuple[str, Any]] = {
            "class": ("a class path", lambda v: isinstance(v, str)),
            "training": ("a bool", lambda v: isinstance(v, bool)),
            "attributes": ("a mapping of attribute names to values", lambda v: isinstance(v, Mapping)),
            "parameters": (
                "a mapping of names to null or {'tensor': name, 'requires_grad': bool}",
                lambda v: (
                    isinstance(v, Mapping)
                    and all(
                        p is None
                        or (
                            isinstance(p, Mapping)
                            and isinstance(p.get("tensor"), str)
                            and isinstance(p.get("requires_grad"), bool)
                        )
                        for p in v.values()
                    )
                ),
            ),  # fmt: skip
            "buffers": (
                "a mapping of names to null or a tensor name",
                lambda v: isinstance(v, Mapping) and all(b is None or isinstance(b, str) for b in v.values()),
            ),
            "non_persistent": (
                "a list of buffer names",
                lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
            ),  # fmt: skip
            "children": (
                "a list of [name, present] pairs",
                lambda v: (
                    isinstance(v, list)
                    and all(
                        isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], bool)
                        for c in v
                    )
                ),
            ),  # fmt: skip
        }
        for field, (expected, valid) in fields.items():
            if field not in module:
                raise ValueError(f"load_pretrained: {at} has no `{field}` ({expected}); write the export again.")
            if not valid(module[field]):
                raise _fail(at, field, expected, module[field])
        for key, value in module["attributes"].items():
            _check_value(value, f"{at} attribute {key!r}")
    check_shapes_field(info.get("shapes"), where)


def header_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape in a safetensors file, from its header, checked against the file's size.

    Raises:
        ValueError: If the header's length exceeds the file, it is not a JSON mapping, or a tensor's dtype, shape or
            byte range is malformed or disagrees with the others (naming the file and the tensor).
    """
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > min(size - 8, _MAX_HEADER):
            raise ValueError(
                f"load_pretrained: {path} is not a safetensors file or is truncated (its header length {length} "
                f"exceeds the file's {size} bytes or the 100 MB limit)."
            )
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"load_pretrained: {path}'s safetensors header is not a JSON mapping.")
    data = size - 8 - length
    shapes: dict[str, list[int]] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        entry = spec if isinstance(spec, Mapping) else {}
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_BYTES or not _dims(shape) or not _dims(offsets) or len(offsets) != 2:
            raise ValueError(f"load_pretrained: {where} has a malformed header entry {str(spec)[:120]}.")
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if not offsets[0] <= offsets[1] <= data or offsets[1] - offsets[0] != nbytes:
            raise ValueError(
                f"load_pretrained: {where}: its header says shape {shape} ({dtype}, {nbytes:,} bytes) at bytes "
                f"{offsets}, of {data:,} bytes of data; the file is inconsistent or truncated."
            )
        shapes[name] = list(shape)
    return shapes


def check_shapes(shapes: Mapping[str, list[int]], files: list[Path], where: str) -> None:
    """The shapes a description promises against the safetensors headers, before a model of them is built.

    Raises:
        ValueError: If a file's header is malformed (:func:`header_shapes`), or a parameter's saved shape differs
            from the one ``where`` gives it.
    """
    found: dict[str, tuple[list[int], Path]] = {}
    for path in files:
        found.update({name: (shape, path) for name, shape in header_shapes(path).items()})
    for name, shape in shapes.items():
        if name in found and list(found[name][0]) != list(shape):
            saved, path = found[name]
            raise ValueError(
                f"load_pretrained: {where} gives {name} the shape {list(shape)}, but {path} holds {saved}; the export "
                "is inconsistent. Write it again with save_pretrained."
            )


def _plain(value: object) -> bool:
    if isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def entry_attributes(model: nn.Module, attributes: object) -> list[tuple[nn.Module, str, Any]]:
    """(module, name, value) of every attribute the entry sets, each checked (the entry is read from a file).

    Only public plain attributes (sizes, head counts, eps: numbers, strings, bools, lists of ints) of modules the model
    has: never a method, a property, a class attribute, a parameter, a buffer, a submodule or an internal.

    Raises:
        ValueError: Naming the module and attribute.
    """
    where = "load_pretrained: config.json's lightning_pat entry"
    if not isinstance(attributes, Mapping):
        raise ValueError(f"{where}: `attributes` must be a mapping, got {type(attributes).__name__}.")
    out = []
    for name, values in attributes.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}: the attributes of module {name!r} must be a mapping, got {values!r}.")
        try:
            module = model.get_submodule(name) if isinstance(name, str) else None
        except AttributeError:
            module = None
        if module is None:
            raise ValueError(
                f"{where} names the module {name!r}, which the model ({type(model).__name__}) does not have."
            )
        for key, value in values.items():
            internal = not isinstance(key, str) or key.startswith("_") or not key.isidentifier()
            taken = not internal and (
                hasattr(type(module), key) or key in module._parameters or key in module._buffers  # noqa: SLF001
                or key in module._modules  # noqa: SLF001
            )  # fmt: skip
            current = vars(module).get(key) if not internal else None
            if internal or taken or (current is not None and not _plain(current)):
                raise ValueError(
                    f"{where}: attribute {key!r} of module {name!r} is refused: the entry sets only public plain "
                    "attributes (sizes, head counts, eps), never a method, a tensor, a submodule or an internal."
                )
            if not _plain(value):
                raise ValueError(
                    f"{where}: attribute {key!r} of module {name!r} must be a plain value (a number, a string, a bool "
                    f"or a list of ints), got {value!r}."
                )
            out.append((module, key, value))
    return out
