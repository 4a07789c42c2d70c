"""The cut: physically remove dropped units from a model (no Lightning here).

The package is also the public function: ``lightning_pat.shrink(model, source)`` calls
:func:`lightning_pat.shrink.entry.shrink`. The package's module object is callable (below), so the public name
``lightning_pat.shrink`` is this package and hides none of its modules: ``lightning_pat.shrink.entry`` and
``lightning_pat.shrink(model, source)`` both work.

``entry`` (shrink, shrink_for_training, restore_shrunk) is built from ``plan``, ``edits``, ``attention_checks``,
``optimizer_state``, ``surgery`` and ``model_meta``. Writing and reading a shrunk model is :mod:`lightning_pat.export`;
attention modules with explicit heads are :mod:`lightning_pat.heads`.
"""

import inspect
import sys
import types
from typing import Any

from lightning_pat.shrink.edits import check_shrinkable
from lightning_pat.shrink.entry import restore_shrunk, shrink, shrink_for_training
from lightning_pat.shrink.hf_entry import BASE_CONFIG_ATTR
from lightning_pat.shrink.optimizer_state import slice_optimizer_state
from lightning_pat.shrink.plan import ShrinkPlan, build_plan, plan_for, read_source
from lightning_pat.shrink.surgery import LayerNormShrinkWarning, apply_plan

__all__ = [
    "BASE_CONFIG_ATTR",
    "LayerNormShrinkWarning",
    "ShrinkPlan",
    "apply_plan",
    "build_plan",
    "check_shrinkable",
    "plan_for",
    "read_source",
    "restore_shrunk",
    "shrink",
    "shrink_for_training",
    "slice_optimizer_state",
]


class CallablePackage(types.ModuleType):
    """This package's module type: calling it calls :func:`~lightning_pat.shrink.entry.shrink`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``lightning_pat.shrink(model, source, ...)``: see :func:`lightning_pat.shrink.entry.shrink`."""
        return shrink(*args, **kwargs)


__signature__ = inspect.signature(shrink)
sys.modules[__name__].__class__ = CallablePackage
