"""One rank of the cross-rank agreement test under DDP (launched per rank by test_agreement.py).

Runs three fits in one process, each expected to fail on every rank with the same error and quickly:

* ``declaration``: rank 1 declares a different per-cluster target (resolves fine, but the digests differ);
* ``typo``: rank 1's declaration has a pattern typo (rank 1 fails to resolve; the others must not hang);
* ``debug``: ``debug_check_selection=True`` and rank 1's selection is altered after the step.

Prints one ``RESULT {json}`` line: per scenario, the exception type and message and the seconds it took.
"""

from __future__ import annotations

import json
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_pat import Cluster, CoupledPruningCallback
from tests.common.dist import finish_worker
from tests.common.lit_models import MLPModule, mlp_cluster


class SkewedSelection(CoupledPruningCallback):
    """On rank 1, flips one unit of the mask right after each fresh selection (a simulated divergence)."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        if trainer.global_rank == 1:
            step = self.pruner.step

            def skewed(*args, **kwargs):
                out = step(*args, **kwargs)
                for action in self.pruner.last.values():
                    action.dropped[:1] = (action.dropped[:1] + 1) % 32
                return out

            self.pruner.step = skewed


def run(cb: CoupledPruningCallback) -> dict:
    trainer = pl.Trainer(
        max_steps=4,
        strategy=DDPStrategy(process_group_backend="gloo"),
        accelerator="cpu",
        devices=2,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    module = MLPModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    try:
        trainer.fit(module)
        return {"error": None, "seconds": time.monotonic() - start}
    except Exception as err:  # noqa: BLE001 - reported
        unchanged = all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
        return {
            "type": type(err).__name__,
            "error": str(err),
            "seconds": time.monotonic() - start,
            "unchanged": unchanged,
        }


def main() -> None:
    rank = int(__import__("os").environ["RANK"])
    out = {}
    target = 0.5 if rank == 0 else 0.25
    decl = [Cluster(name="hidden", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"], target=target)]
    out["declaration"] = run(CoupledPruningCallback(decl, 0.5, warmup_steps=0, ramp_steps=2))
    writer = "fc1.weight" if rank == 0 else "fc1.wieght"
    typo = [Cluster(name="hidden", writers=[writer], readers=["fc2.weight"])]
    out["typo"] = run(CoupledPruningCallback(typo, 0.5, warmup_steps=0, ramp_steps=2))
    one = [Cluster(name="hidden", writers=["fc1.weight", "fc1.bias"], readers=["fc2.weight"], num_units=1)]
    out["empties"] = run(CoupledPruningCallback(one, 0.25, warmup_steps=0, ramp_steps=2))
    out["debug"] = run(SkewedSelection(mlp_cluster(), 0.5, warmup_steps=0, ramp_steps=2, debug_check_selection=True))
    out["debug_off"] = run(SkewedSelection(mlp_cluster(), 0.5, warmup_steps=0, ramp_steps=2))
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **out}), flush=True)


if __name__ == "__main__":
    main()
    finish_worker()
