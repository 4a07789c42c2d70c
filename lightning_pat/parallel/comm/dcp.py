"""Distributed checkpoint I/O (``torch.distributed.checkpoint``): a sharded load, a full gather, a safe read.

:func:`load_sharded_` and :func:`full_state_dict` are collective (every rank of the group calls them);
:func:`read_distributed_checkpoint` needs no process group and runs no code from the files.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch


def load_sharded_(state: dict[str, Any], path: Any) -> None:
    """Fill the (DTensor) entries of ``state`` in place from a torch distributed checkpoint at ``path``.

    Every rank of the checkpoint's process group must call this (it communicates); entries absent from ``state``
    are not read.
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    load(state, checkpoint_id=path)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of an FSDP2/TP-sharded ``module``, on the CPU of global rank 0 only.

    Every rank must call this (it gathers one parameter at a time); ranks other than 0 get an empty dict, so no rank
    but the writer ever holds the whole model, and none holds the optimizer state.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _dcp_metadata_global(module: str, name: str) -> bool:
    """The globals a ``torch.distributed.checkpoint`` ``.metadata`` pickle may name (its dataclasses, sizes, dtypes)."""
    if module == "torch.distributed.checkpoint.metadata":
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    if (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_distributed_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read a distributed checkpoint directory (``torch.distributed.checkpoint``) into one state dict in memory.

    Like torch's ``dcp_to_torch_save`` (one process, no process group), but without running code from the files:
    the ``.metadata`` pickle is read through an allow-list (its own dataclasses, sizes, dtypes), every shard file it
    names must lie inside ``directory``, and non-tensor entries load with ``torch.load(weights_only=True)``. Nothing is
    written.

    Args:
        directory: The checkpoint directory (e.g. written by Lightning's ``ModelParallelStrategy``).

    Returns:
        The full (unsharded) state dict, nested as it was saved.

    Raises:
        ValueError: If ``.metadata`` names an object outside the allow-list, a shard name leads outside
            ``directory``, or a file is truncated.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightning_pat.core.safe_io import confined, restricted_unpickle

    root = Path(directory)
    what = f"distributed checkpoint {root}"

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            name = Path(self._get_metadata_path(kwargs.get("rank"))).name
            path = confined(root, name, what=what)
            if not path.is_file():  # torch first asks for a rank-local file, then for the global one
                raise FileNotFoundError(f"{what}: no {name}")
            metadata = restricted_unpickle(path, allowed=_dcp_metadata_global, what=f"{what}: {name}")
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                confined(root, getattr(info, "relative_path", None), what=f"{what}: {name}")
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    state: dict[str, Any] = {}
    reader = SafeReader(root)
    reader.read_metadata()  # the refusals above, raised as they are (torch would wrap them)
    try:
        planner = SafePlanner()  # type: ignore[no-untyped-call]  # torch leaves the planner's __init__ unannotated
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - torch wraps reader errors in CheckpointException
        cause = getattr(err, "failures", None) or err
        raise ValueError(f"cannot read {what}: not a valid distributed checkpoint or truncated ({cause})") from None
    return state
