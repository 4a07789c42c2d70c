"""The training setups the callback cannot serve, refused before any step (no Lightning here).

:func:`check_environment` takes the strategy as plain facts (its class name and :data:`StrategyKind`, read from the
Trainer by :mod:`lightning_pat.training.trainer_facts`) and the run's
:class:`~lightning_pat.pruning.options.PruningOptions`, so it runs without a Trainer in the tests.
"""

from __future__ import annotations

from typing import Literal

from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.errors import WHO

#: How the training strategy holds parameters: one device, DDP replicas, FSDP1 flat shards, DTensors, DeepSpeed.
StrategyKind = Literal["single", "ddp", "fsdp1", "model_parallel", "deepspeed", "other"]


def check_environment(
    options: PruningOptions,
    *,
    strategy: str,
    kind: StrategyKind,
    automatic_optimization: bool,
    module: str,
    weight_averaging: str | None = None,
) -> None:
    """Refuse, before any step, a training setup the callback cannot serve with these options.

    Args:
        options: The run's options.
        strategy: The strategy's class name (for the messages).
        kind: How the strategy holds parameters.
        automatic_optimization: The LightningModule's ``automatic_optimization``.
        module: The LightningModule's class name (for the messages).
        weight_averaging: The class name of a weight-averaging callback (``StochasticWeightAveraging``) that runs
            too, if any. It copies averaged weights into the model; the callback then re-applies the mask after each
            copy (the average includes snapshots taken before units were dropped).

    Raises:
        ValueError: On DeepSpeed, manual optimization, ``score="activation"`` under FSDP1 (``FSDPStrategy``),
            ``shrink_on_freeze`` under another strategy than a single device, or ``shrink_on_freeze`` with weight
            averaging (its full-size average cannot be copied into the shrunk model).
    """
    if kind == "deepspeed":
        raise ValueError(
            f"{WHO} does not support {strategy}: DeepSpeed partitions parameters into flat buffers "
            "that have no per-tensor structure. Use strategy='ddp', or ModelParallelStrategy with fully_shard."
        )
    if not automatic_optimization:
        raise ValueError(
            f"{WHO} does not support manual optimization ({module}."
            "automatic_optimization is False): it must see every optimizer step between the backward and the "
            "update (a raw optimizer bypasses Lightning's hooks, and with several optimizers the schedule could not "
            "tell which step counts). Use automatic optimization with one optimizer (param groups may differ), or "
            "call lightning_pat.prune_clusters yourself after your optimizer steps."
        )
    if options.score == "activation" and kind == "fsdp1":
        raise ValueError(
            f"{WHO}(score='activation') supports a single device, DDP and ModelParallelStrategy "
            f"(FSDP2/tensor parallel), got {strategy}: FSDP1 keeps parameters in flat shards, where the readers' "
            "columns are not addressable. Use ModelParallelStrategy with fully_shard, or a weight score "
            "(score='rms', the default) under FSDPStrategy."
        )
    if options.score == "taylor" and kind == "fsdp1":
        raise ValueError(
            f"{WHO}(score='taylor') supports a single device, DDP and ModelParallelStrategy "
            f"(FSDP2/tensor parallel), got {strategy}: FSDP1 keeps gradients in flat shards, where a unit's "
            "gradient is not addressable without gathering every step. Use ModelParallelStrategy with fully_shard."
        )
    if options.distillation.on and kind not in ("single", "ddp", "model_parallel"):
        raise ValueError(
            f"{WHO}(distill_alpha={options.distillation.alpha}) supports a single device, DDP and "
            f"ModelParallelStrategy (FSDP2, tensor parallel), got {strategy}: FSDP1's flat parameters cannot be "
            "copied into a teacher sharded like the student. Use ModelParallelStrategy with fully_shard, or set "
            "distill_alpha=0."
        )
    if options.shrink_on_freeze and weight_averaging is not None:
        raise ValueError(
            f"{WHO}(shrink_on_freeze=True) cannot run with {weight_averaging}: it keeps a full-size "
            "averaged copy of the model and writes it back at the end of fit, which no longer fits the shrunk model. "
            "Use shrink_on_freeze=False and shrink after fit (lightning_pat.shrink(model, callback)), or drop the SWA "
            "callback."
        )
    if options.shrink_on_freeze and kind not in ("single", "model_parallel"):
        raise ValueError(
            f"{WHO}(shrink_on_freeze=True) runs on a single device or under ModelParallelStrategy (FSDP2, FSDP2 x "
            f"tensor parallel), got {strategy}: under DDP and FSDP1 the wrapped or flat-sharded parameters cannot be "
            "resized in place. Use ModelParallelStrategy with fully_shard, or shrink_on_freeze=False and shrink after "
            "fit (lightning_pat.shrink(model, callback))."
        )
