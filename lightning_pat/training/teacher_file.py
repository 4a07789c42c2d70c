"""The distillation teacher written once as safetensors (``distill_teacher_store="file"``), referenced by checkpoints.

With the default store (``"checkpoint"``) every checkpoint written during pruning holds the copied teacher's weights
next to the model's: twice the model. With ``"file"`` the teacher's tensors are written once per directory, the
first time a checkpoint is saved after pruning started, and every checkpoint holds only a reference
(:func:`reference`)::

    {"format": "file", "sharded": bool, "world": int, "mesh": str,
     "files": [{"name": "pat-teacher-<key>[-rank<r>of<w>].safetensors", "digest": sha256, "layout": sha256}, ...]}

* One file for a teacher of plain tensors (one device, DDP: the replicas are equal, rank 0 writes it); one file per
  rank for a teacher sharded like the student (``ModelParallelStrategy``: each rank writes its own shards, the
  ``layout`` digest records their local shapes, placements and mesh, ``world`` the number of ranks).
* Names, never paths: a name is read back only inside the directories the caller gives (the checkpoint's own
  directory first), must match :data:`NAME` (no separator, no ``..``) and may not lead outside through a symlink
  (:func:`~lightning_pat.core.safe_io.confined`). The key in the name is derived from the content, so a new teacher
  (a fresh Trainer's) never overwrites a file that older checkpoints reference.
* The digest (sha256 over every tensor's name, dtype, shape and bytes, in name order) is checked on read: a missing,
  truncated, tampered or foreign file is an error naming the option, the file and the fix, never a silent wrong
  teacher. Files are safetensors (no pickle) and written atomically (a temporary file renamed into place).

Errors are ``ValueError``.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import Tensor

from lightning_pat.core.safe_io import confined, default_file_mode
from lightning_pat.parallel.comm import dtensor, ranks

#: The only file names a reference may hold.
NAME = re.compile(r"pat-teacher-[0-9a-f]{16}(-rank[0-9]+of[0-9]+)?\.safetensors")
OPTION = "distill_teacher_store='file'"
_FIX = (
    "Copy that file next to the checkpoint (or set `distill_teacher_dir` to the directory that holds it), resume "
    "from a checkpoint written with distill_teacher_store='checkpoint', or pass the dense model as `distill_teacher`."
)


def is_file_entry(entry: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether a saved teacher is a file reference (see the module docstring)."""
    return isinstance(entry, Mapping) and entry.get("format") == "file"


def _local(tensor: Tensor) -> Tensor:
    return dtensor.local_tensor(tensor).detach().to("cpu").contiguous()


def digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (DTensors: the local shard)."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        local = _local(tensors[name])
        sha.update(f"{name}|{local.dtype}|{tuple(local.shape)}\n".encode())
        if local.numel():
            # numpy arrays implement the buffer protocol; numpy's stubs do not say so to Python 3.11's typeshed
            sha.update(memoryview(local.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    return sha.hexdigest()


def layout(tensors: Mapping[str, Tensor]) -> str:
    """sha256 of every tensor's global and local shape, placements and mesh (what a shard file must match)."""
    parts = []
    for name in sorted(tensors):
        tensor = tensors[name]
        local = dtensor.local_tensor(tensor)
        placements = getattr(tensor, "placements", None)
        mesh = getattr(tensor, "device_mesh", None)
        mesh_desc = None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names)
        parts.append(f"{name}|{tuple(tensor.shape)}|{tuple(local.shape)}|{placements}|{mesh_desc}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def mesh_description(tensors: Iterable[Tensor]) -> str:
    """The first DTensor's mesh (shape and dim names), for messages; ``"none"`` for plain tensors."""
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None:
            return f"mesh {dict(zip(mesh.mesh_dim_names or (), tuple(mesh.shape), strict=False))}"
    return "none"


def reference(tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """The reference every checkpoint holds for these teacher tensors (a collective for DTensors: every rank calls).

    Returns:
        ``{"format": "file", "sharded", "world", "mesh", "files": [{"name", "digest", "layout"}, ...]}``: one file for
        plain tensors, one per rank (in rank order) for DTensors.
    """
    sharded = any(dtensor.is_dtensor(t) for t in tensors.values())
    mine = {"digest": digest(tensors), "layout": layout(tensors)}
    files = ranks.gather_objects(mine, group=ranks.world_group()) if sharded else [mine]
    world = len(files)
    key = hashlib.sha256("".join(f["digest"] for f in files).encode()).hexdigest()[:16]
    for rank, entry in enumerate(files):
        entry["name"] = f"pat-teacher-{key}" + (f"-rank{rank}of{world}" if sharded else "") + ".safetensors"
    return {
        "format": "file",
        "sharded": sharded,
        "world": world,
        "mesh": mesh_description(tensors.values()),
        "files": files,
    }


def _my_file(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    mine: Mapping[str, Any] = entry["files"][ranks.world_rank() if entry.get("sharded") else 0]
    return mine


def write(entry: Mapping[str, Any], tensors: Mapping[str, Tensor], directory: str | os.PathLike[str]) -> Path | None:
    """Write this rank's teacher file of ``entry`` into ``directory`` (for plain tensors only rank 0 writes).

    An existing file with the expected digest is kept; anything else under that name is replaced atomically.

    Returns:
        The file written or kept (``None`` on a rank that writes nothing).
    """
    if not entry.get("sharded") and ranks.world_rank() != 0:
        return None
    from safetensors.torch import save_file

    mine = _my_file(entry)
    directory = Path(directory)
    check_directories([directory])
    directory.mkdir(parents=True, exist_ok=True)
    path = confined(directory, mine["name"], what=OPTION)
    _check_slot(path)
    if path.is_file():
        try:
            if digest(_load(path)) == mine["digest"]:
                return path
        except ValueError:
            pass  # unreadable: replaced below
    fd, tmp = tempfile.mkstemp(prefix=f".{mine['name']}.", suffix=".partial", dir=directory)
    os.close(fd)
    try:
        save_file({n: _local(t).clone() for n, t in tensors.items()}, tmp)  # clones: tied tensors are stored apart
        os.chmod(tmp, default_file_mode())  # mkstemp's 0600 -> what the checkpoints next to it get (the umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _check_slot(path: Path) -> None:
    """Refuse anything but a regular file (or nothing) at a teacher file's place.

    Raises:
        ValueError: If a directory, a FIFO, a socket or a device is there.
    """
    if path.is_symlink() or not path.exists() or path.is_file():
        return
    kind = "a directory" if path.is_dir() else "not a regular file"
    raise ValueError(
        f"{OPTION}: {str(path)!r} is {kind}, not a file; it is where the teacher file is written and read. Move it "
        "away, or set `distill_teacher_dir` to another directory."
    )


def check_directories(directories: Sequence[str | os.PathLike[str]]) -> None:
    """Check, before training, that the teacher file can be written into ``directories`` (nothing is created).

    Each must be a directory (or creatable: its nearest existing ancestor a writable directory), writable, and hold
    no ``pat-teacher-*`` entry that is not a regular file inside it (a directory, a FIFO, a symlink leading out).

    Raises:
        ValueError: Naming the directory or entry and the fix.
    """
    for raw in directories:
        directory = Path(raw)
        existing = directory
        while not existing.exists() and existing.parent != existing and not existing.is_symlink():
            existing = existing.parent
        if not existing.is_dir():
            what = f"{directory}" if existing == directory else f"{directory} cannot be created: {existing}"
            raise ValueError(
                f"{OPTION}: the teacher directory {what} is a file, not a directory. Set `distill_teacher_dir` (or the "
                "checkpoint directory) to a directory."
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(
                f"{OPTION}: the teacher directory {str(directory)!r} is not writable ({str(existing)!r} denies it); "
                "the teacher file is written there at the first checkpoint after pruning starts. Set "
                "`distill_teacher_dir` to a writable directory."
            )
        if existing != directory:
            continue
        for entry in sorted(directory.iterdir()):
            if NAME.fullmatch(entry.name):
                _check_slot(confined(directory, entry.name, what=OPTION))


def _load(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type (and OSError) on bad bytes
        raise ValueError(f"not a safetensors file or truncated ({type(err).__name__}: {err})") from None


def check_entry(entry: Mapping[str, Any], *, world: int) -> None:
    """Check a reference read from a checkpoint before any file is opened.

    Raises:
        ValueError: If it is malformed, a name is not a plain teacher file name, or a sharded teacher was written by
            another number of ranks than ``world``.
    """
    files = entry.get("files")
    if not isinstance(files, list) or not files or not all(isinstance(f, Mapping) for f in files):
        raise ValueError(f"{OPTION}: the checkpoint's teacher reference is malformed (files={files!r}).")
    edited = "The checkpoint was edited or is not one of ours."
    if not isinstance(entry.get("sharded", False), bool):
        raise ValueError(
            f"{OPTION}: `sharded` of the checkpoint's teacher reference must be a bool, got {entry.get('sharded')!r}. "
            + edited
        )
    world_saved = entry.get("world", len(files))
    if isinstance(world_saved, bool) or not isinstance(world_saved, int) or world_saved < 1:
        raise ValueError(
            f"{OPTION}: `world` of the checkpoint's teacher reference must be an int >= 1, got {world_saved!r}. "
            + edited
        )
    if entry.get("sharded") and len(files) != world_saved:
        raise ValueError(
            f"{OPTION}: the checkpoint's teacher reference names {len(files)} shard file(s) for {world_saved} ranks. "
            + edited
        )
    for item in files:
        name = item.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or not isinstance(item.get("digest"), str):
            raise ValueError(
                f"{OPTION}: the checkpoint names the teacher file {name!r}, which is not a teacher file name "
                "(pat-teacher-<16 hex>[-rank<r>of<w>].safetensors; names with a directory or `..` are refused: the "
                "file is read only next to the checkpoint). The checkpoint was edited or is not one of ours."
            )
    if entry.get("sharded") and world_saved != world:
        raise ValueError(
            f"{OPTION}: the checkpoint's teacher was written as the shards of {entry.get('world')} ranks "
            f"({entry.get('mesh')}), and this run has {world}; its shard files cannot be redistributed. Resume on "
            f"{entry.get('world')} ranks with the same mesh, or from a checkpoint written with "
            "distill_teacher_store='checkpoint' (distributed checkpoints reshard), or pass `distill_teacher`."
        )


def read_teacher_file(
    entry: Mapping[str, Any], *, directories: Sequence[str | os.PathLike[str]], like: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """This rank's teacher tensors from the file ``entry`` names, found in the first of ``directories`` that has it.

    Args:
        entry: The reference saved in the checkpoint.
        directories: Where to look, in order (the checkpoint's directory first).
        like: The tensors the teacher will be loaded into (names, and for a sharded teacher the layout to match).

    Returns:
        The file's tensors (CPU; DTensors' local shards), their digest checked.

    Raises:
        ValueError: If the reference is malformed (:func:`check_entry`), the file is in none of ``directories``, is
            not a safetensors file, its digest or names differ from the reference, or a shard's layout differs from
            this run's.
    """
    check_entry(entry, world=ranks.world_size())
    mine = _my_file(entry)
    name = mine["name"]
    searched = list(dict.fromkeys(str(Path(d)) for d in directories))
    candidates = [confined(d, name, what=OPTION) for d in searched]
    for candidate in candidates:
        _check_slot(candidate)
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ValueError(f"{OPTION}: the checkpoint's teacher file {name!r} is in none of {searched}. {_FIX}")
    try:
        tensors = _load(path)
    except ValueError as err:
        raise ValueError(f"{OPTION}: cannot read the teacher file {path}: {err}. {_FIX}") from None
    if digest(tensors) != mine["digest"]:
        raise ValueError(
            f"{OPTION}: the teacher file {path} does not hold the teacher this checkpoint was written with (its sha256 "
            f"differs from the one recorded: the file was modified, or belongs to another run). {_FIX}"
        )
    if set(tensors) != set(like):
        missing, extra = sorted(set(like) - set(tensors)), sorted(set(tensors) - set(like))
        raise ValueError(
            f"{OPTION}: the teacher file {path} holds other tensors than the model (missing {missing[:3]}, unexpected "
            f"{extra[:3]}). Resume with the model the checkpoint was written for."
        )
    shapes = [n for n in sorted(tensors) if tuple(tensors[n].shape) != tuple(dtensor.local_tensor(like[n]).shape)]
    if shapes or (entry.get("sharded") and layout(like) != mine["layout"]):
        raise ValueError(
            f"{OPTION}: the teacher file {path} holds tensors of other shapes {shapes[:3]} or another layout "
            f"({entry.get('mesh')}) than this run's model ({mesh_description(like.values())}). Resume with the model "
            "and mesh (data/tensor-parallel sizes) the checkpoint was written with, or from a checkpoint written with "
            "distill_teacher_store='checkpoint'."
        )
    return tensors
