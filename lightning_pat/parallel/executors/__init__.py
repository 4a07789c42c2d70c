"""Executors: how unit norms are computed and selections applied, per layout (see :mod:`.routing` for the choice)."""

from lightning_pat.core.choices import EXECUTOR_KINDS, ExecutorKind
from lightning_pat.parallel.executors.base import Evidence, Executor, Reduced, UnitAction
from lightning_pat.parallel.executors.materializing import MaterializingExecutor
from lightning_pat.parallel.executors.routing import (
    build_executors,
    materializing_reason,
    route,
    sharded_reason,
)
from lightning_pat.parallel.executors.sharded import ShardedExecutor

__all__ = [
    "EXECUTOR_KINDS",
    "Evidence",
    "Executor",
    "ExecutorKind",
    "MaterializingExecutor",
    "Reduced",
    "ShardedExecutor",
    "UnitAction",
    "build_executors",
    "materializing_reason",
    "route",
    "sharded_reason",
]
