"""Physical shrink and export of a pruned model (no Lightning here).

Cut dropped units out of a model (``entry``, built from ``plan``, ``surgery`` and ``model_meta``), and save/load the
shrunk model (``export``).
"""

from lightning_pat.shrink.entry import restore_shrunk, shrink, shrink_for_training
from lightning_pat.shrink.plan import ShrinkPlan, build_plan, checkpoint_state, plan_for, read_source, state_source
from lightning_pat.shrink.surgery import (
    BASE_CONFIG_ATTR,
    LayerNormShrinkWarning,
    apply_plan,
    check_shrinkable,
    slice_optimizer_state,
)

__all__ = [
    "BASE_CONFIG_ATTR",
    "LayerNormShrinkWarning",
    "ShrinkPlan",
    "apply_plan",
    "build_plan",
    "check_shrinkable",
    "checkpoint_state",
    "state_source",
    "plan_for",
    "read_source",
    "restore_shrunk",
    "shrink",
    "shrink_for_training",
    "slice_optimizer_state",
]
