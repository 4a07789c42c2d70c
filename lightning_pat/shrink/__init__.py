"""Physical shrink and export of a pruned model (no Lightning here).

Cut dropped units out of a model (``entry``, built from ``plan``, ``edits``, ``attention_checks``, ``optimizer_state``,
``surgery`` and ``model_meta``), and save/load the shrunk model (``export``).
"""

from lightning_pat.shrink.edits import check_shrinkable
from lightning_pat.shrink.entry import restore_shrunk, shrink, shrink_for_training
from lightning_pat.shrink.hf_entry import BASE_CONFIG_ATTR
from lightning_pat.shrink.optimizer_state import slice_optimizer_state
from lightning_pat.shrink.plan import ShrinkPlan, build_plan, checkpoint_state, plan_for, read_source, state_source
from lightning_pat.shrink.surgery import LayerNormShrinkWarning, apply_plan

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
