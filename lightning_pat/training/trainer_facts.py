"""What the callback reads from a Lightning Trainer: the strategy's kind, the first batch, a checkpoint being restored.

Each function reads one fact and hands plain values (or a hook handle) to the Lightning-free
:class:`~lightning_pat.training.controller.PruningController` and
:func:`~lightning_pat.training.environment.check_environment`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)

from lightning_pat.core.safe_io import confined, load_torch_file
from lightning_pat.training.environment import StrategyKind

if TYPE_CHECKING:
    import lightning.pytorch as pl


def first_batch_input(trainer: pl.Trainer) -> Any:
    """What ``forward`` takes, from the first training batch (``None`` if there is no training data to read yet).

    ``batch[0]`` of a tuple or list, a mapping (keyword arguments) or the batch itself. The loader gets a fresh
    iterator (training starts its own later) and the global torch RNG state is restored afterwards, so a shuffling
    sampler draws the same order as without this peek.
    """
    try:
        source = trainer.fit_loop._data_source  # noqa: SLF001 - Lightning keeps fit's train data here before setup_data
        loader = source.dataloader() if source.is_defined() else None
    except Exception:  # noqa: BLE001 - any failure means "no batch to trace": the caller says how to fix it
        return None
    if loader is None:
        return None
    rng = torch.random.get_rng_state()
    try:
        batch = next(iter(loader))
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        torch.random.set_rng_state(rng)
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0]
    return batch


def strategy_kind(strategy: Strategy) -> StrategyKind:
    """How ``strategy`` holds the parameters (see :data:`~lightning_pat.training.environment.StrategyKind`)."""
    if "DeepSpeed" in type(strategy).__name__:
        return "deepspeed"
    kinds: tuple[tuple[type, StrategyKind], ...] = (
        (FSDPStrategy, "fsdp1"), (ModelParallelStrategy, "model_parallel"), (DDPStrategy, "ddp"),
        (SingleDeviceStrategy, "single"),
    )  # fmt: skip
    return next((kind for cls, kind in kinds if isinstance(strategy, cls)), "other")


def weight_averaging(trainer: pl.Trainer) -> str | None:
    """The class name of a ``StochasticWeightAveraging`` callback of ``trainer``, if any."""
    callbacks = getattr(trainer, "callbacks", ())  # a stand-in Trainer may have none
    return next((type(cb).__name__ for cb in callbacks if isinstance(cb, StochasticWeightAveraging)), None)


def fsdp1_root(strategy: Strategy) -> torch.nn.Module | None:
    """The FSDP1-wrapped root module under ``FSDPStrategy``, else ``None``."""
    return strategy.model if isinstance(strategy, FSDPStrategy) else None


def sharded_checkpoints(strategy: Strategy) -> bool:
    """Whether ``strategy`` is ``ModelParallelStrategy(save_distributed_checkpoint=True)`` (sharded checkpoints)."""
    saves_shards = bool(getattr(strategy, "_save_distributed_checkpoint", False))
    return isinstance(strategy, ModelParallelStrategy) and saves_shards


def watch_restore(
    trainer: pl.Trainer,
    module: torch.nn.Module,
    before: Callable[[torch.nn.Module, Mapping[str, Any] | None, Mapping[str, Any]], None],
) -> Any:
    """Call ``before(module, checkpoint, weights)`` before a checkpoint's weights load into ``module``.

    Lightning restores the weights before any callback hook of the restore runs, so this is a load-state-dict pre-hook
    on ``module`` (its root call only); ``checkpoint`` is the whole checkpoint being restored, if Lightning holds one.

    Returns:
        The hook's handle (``handle.remove()`` stops watching).
    """
    connector = trainer._checkpoint_connector  # the checkpoint being restored is kept only here

    def hook(mod: torch.nn.Module, weights: Mapping[str, Any], prefix: str, *_: Any) -> None:
        if not prefix:
            before(mod, getattr(connector, "_loaded_checkpoint", None), weights)

    return module.register_load_state_dict_pre_hook(hook)  # type: ignore[no-untyped-call]  # untyped in torch


class _StrategyRestoreWatch:
    """The handle of :func:`watch_sharded_restore`: ``remove()`` gives the strategy its own ``load_checkpoint`` back."""

    def __init__(self, strategy: Strategy, wrapper: Callable[..., Any]) -> None:
        self._strategy = strategy
        strategy.load_checkpoint = wrapper  # type: ignore[method-assign]  # this instance only, until remove()

    def remove(self) -> None:
        """Stop watching (idempotent)."""
        if "load_checkpoint" in vars(self._strategy):
            del self._strategy.load_checkpoint


def checkpoint_globals() -> list[Any]:
    """The classes besides tensors, containers and plain values that Lightning writes into checkpoints."""
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict]


def checkpoint_meta(path: Any) -> Mapping[str, Any]:
    """Everything but the weights of the Lightning checkpoint at ``path``, read without running code from it.

    A distributed checkpoint directory (``ModelParallelStrategy(save_distributed_checkpoint=True)``) keeps it in
    ``meta.pt`` (the shards are not read); a ``.ckpt`` file is read whole. Only :func:`checkpoint_globals` besides
    tensors, containers and plain values are allowed (the one allow-list of the callback and ``lightning-pat shrink``).

    Raises:
        FileNotFoundError: If ``path`` does not exist, or is a directory without ``meta.pt``.
        ValueError: As for :func:`~lightning_pat.core.safe_io.load_torch_file`, or if ``meta.pt`` leads outside the
            directory.
    """
    source = Path(path)
    if source.is_dir():
        source = confined(source, "meta.pt", what="checkpoint")
    loaded = load_torch_file(source, what="checkpoint", allowed=checkpoint_globals())
    return loaded if isinstance(loaded, Mapping) else {}


def watch_sharded_restore(trainer: pl.Trainer, before: Callable[[Mapping[str, Any]], None]) -> Any:
    """Call ``before(checkpoint)`` before ``ModelParallelStrategy`` loads a checkpoint (its weights included).

    Under ``ModelParallelStrategy`` Lightning restores the checkpoint after ``on_fit_start``, loading the weights
    into the module's current state dict (a distributed checkpoint's shapes must already match), and no callback hook
    runs in between; so this wraps the strategy's ``load_checkpoint`` (this instance only) and hands ``before`` the
    checkpoint without its weights (:func:`checkpoint_meta`), on every rank.

    Returns:
        The handle (``handle.remove()`` stops watching).
    """
    strategy = trainer.strategy
    load = strategy.load_checkpoint

    def wrapper(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        before(checkpoint_meta(checkpoint_path))
        return load(checkpoint_path, *args, **kwargs)

    return _StrategyRestoreWatch(strategy, wrapper)


def teacher_dirs(trainer: pl.Trainer, configured: str | None) -> list[str]:
    """Where the distillation teacher file is written (``distill_teacher_store="file"``) and looked up.

    ``configured`` (``distill_teacher_dir``) if given; else the ``dirpath`` of every ``ModelCheckpoint`` (resolved
    in its setup); else the Trainer's ``default_root_dir``.
    """
    if configured is not None:
        return [configured]
    found = [str(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", ()) if getattr(cb, "dirpath", None)]
    return list(dict.fromkeys(found)) or [str(trainer.default_root_dir)]
