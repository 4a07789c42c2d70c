"""Named recipes of :class:`~lightning_pat.training.callback.CoupledPruningCallback`: fixed option sets with a name.

A recipe is a subclass that only fixes or changes defaults, so it is a ``Callback`` LightningCLI can build from a
YAML ``class_path`` and every other option keeps its meaning (and its check) in
:class:`~lightning_pat.pruning.options.PruningOptions`.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_pat.core.choices import TrainingScore
from lightning_pat.core.spec import Cluster
from lightning_pat.training.callback import CoupledPruningCallback

#: The options a recipe fixes, and the value it fixes them to.
ONE_SHOT_FIXED: dict[str, Any] = {"ramp_steps": 1, "heal": True}


class OneShotPruningCallback(CoupledPruningCallback):
    """One-shot pruning, then healing during training with distillation from the dense model.

    After ``warmup_steps`` dense steps, the next optimizer step is the final one: the units are selected once, at the
    full ``target_sparsity`` (``ramp_steps=1``), and the mask is held from there on while training heals the pruned
    model (``heal=True``), distilling from a frozen copy of the model as it was when that step started
    (``distill_alpha``; ``distill_teacher=`` for your own). The score is the callback's default ``"auto"``:
    ``"activation"`` wherever it runs, whose statistics are an average over the training forwards up to the cut.
    With ``warmup_steps=0`` that is the first batch alone, which cost 0.0075 nats against a cut calibrated on 8
    batches in the benchmark; ``warmup_steps=8`` tied it.

    When to use it: when you want the final architecture early (e.g. ``shrink_on_freeze=True`` to heal on the small
    model). In the quality benchmark (BENCHMARKS.md, 75% of MLP channels and heads, 5 seeds, paired) this cut tied
    the distilled ramp (``CoupledPruningCallback(..., distill_alpha=0.5)``) on one budget and trailed it by
    0.017-0.020 nats on three, where a one-shot cut calibrated on the frozen model tied the ramp; the ramp with
    distillation is the recipe to start from. It is the same as
    ``CoupledPruningCallback(..., ramp_steps=1, distill_alpha=0.5)`` (``score="auto"``). Every other option
    of :class:`CoupledPruningCallback` is accepted and means the same; ``ramp_steps`` and ``heal`` are fixed (they are
    parameters only so that a config printed by ``lightning-pat fit --print_config`` loads again).

    In YAML (``lightning-pat fit --config ...``)::

        trainer:
          callbacks:
            - class_path: lightning_pat.OneShotPruningCallback
              init_args: {clusters: tiny_gpt, target_sparsity: 0.75, warmup_steps: 8}

    Raises:
        MisconfigurationException: If ``ramp_steps`` is not 1 or ``heal`` not True (the recipe fixes them), and for
            everything :class:`CoupledPruningCallback` refuses. Distillation is not supported under FSDP1
            (``FSDPStrategy``): pass ``distill_alpha=0`` there (``score="auto"`` scores by ``"rms"`` there).

    Example::

        >>> cb = OneShotPruningCallback("llama", 0.75, warmup_steps=8)
        >>> (cb.schedule.final_step, cb.options.score, cb.options.distill_alpha)
        (9, 'auto', 0.5)
    """

    def __init__(
        self,
        clusters: list[Cluster] | str = "auto",
        target_sparsity: float | None = None,
        *,
        warmup_steps: int = 0,
        score: TrainingScore = "auto",
        distill_alpha: float = 0.5,
        ramp_steps: int = 1,
        heal: bool = True,
        **options: Any,
    ) -> None:
        given = {"ramp_steps": ramp_steps, "heal": heal}
        wrong = [k for k, v in ONE_SHOT_FIXED.items() if type(given[k]) is not type(v) or given[k] != v]
        if wrong:
            raise MisconfigurationException(
                f"OneShotPruningCallback fixes {', '.join(f'{k}={ONE_SHOT_FIXED[k]!r}' for k in wrong)} (it prunes at "
                f"once and heals), got {', '.join(f'{k}={given[k]!r}' for k in wrong)}. Leave it out, or use "
                "CoupledPruningCallback for a ramp or no healing."
            )
        super().__init__(
            clusters, target_sparsity, warmup_steps=warmup_steps, score=score, distill_alpha=distill_alpha,
            **ONE_SHOT_FIXED, **options,
        )  # fmt: skip

    @property
    @override
    def state_key(self) -> str:
        """The key :class:`CoupledPruningCallback` with the same clusters has (not this class's name).

        A checkpoint of the recipe is a checkpoint of the callback: ``lightning-pat shrink`` finds its state, and a
        run started with either class resumes with the other.
        """
        key = {"clusters": self.options.key_names()}
        return f"{CoupledPruningCallback.__qualname__}{key!r}"
