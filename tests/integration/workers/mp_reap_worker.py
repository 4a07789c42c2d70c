"""One rank of test_expert_score_sharded.py (launched per rank): a tiny Mixtral (4 experts, top-2) under FSDP2
(``fully_shard`` per decoder layer and the root, data-parallel size 2), pruned by ``expert_score`` (REAP).

    python mp_reap_worker.py KIND[+experts] ...

(``+experts``: ``fully_shard`` on each layer's experts module too, a group of its own that FSDP2 gathers only for
the experts' forward.)

Each rank trains on a batch of its own that depends only on its rank and the step (:func:`rank_tokens`), so the
one-process reference (:func:`fit` with ``devices=1``, run by the test) trains on both batches at once (the mean loss
over them is the mean of the ranks' losses, which FSDP2 averages). Each rank prints one ``RESULT {json}`` line per
kind: the scores the callback used at every selection and the dropped units.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_pat import CoupledPruningCallback
from tests.common.dist import finish_worker

VOCAB, EXPERTS, LAYERS, TOP_K, STEPS = 64, 4, 2, 2, 4


def rank_tokens(rank: int, step: int) -> torch.Tensor:
    """The batch of data-parallel rank ``rank`` at optimizer step ``step``."""
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + 7919 * rank + step))


class Step(pl.LightningModule):
    """A tiny Mixtral on its rank's batch; on one process (no mesh) unsharded, on both ranks' batches at once."""

    def __init__(self, *, shard_experts: bool = False) -> None:
        super().__init__()
        import transformers

        self.shard_experts = shard_experts
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=VOCAB,
            attn_implementation="eager", tie_word_embeddings=False,
        )  # fmt: skip
        self.model = transformers.MixtralForCausalLM(config)

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            dp = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                if self.shard_experts:
                    fully_shard(layer.mlp.experts, mesh=dp)
                fully_shard(layer, mesh=dp)
            fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.device_mesh is None:
            x = torch.cat([rank_tokens(r, self.global_step) for r in range(2)])
        else:
            x = rank_tokens(self.device_mesh["data_parallel"].get_local_rank(), self.global_step)
        logits = self.model(input_ids=x[:, :-1]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):  # noqa: ANN201
        return torch.utils.data.DataLoader(torch.zeros(STEPS, 1), batch_size=1)


class Used(pl.Callback):
    """The scores the pruning callback used at each selection, by step."""

    def __init__(self, pruning: CoupledPruningCallback) -> None:
        self.pruning, self.used = pruning, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001
        experts = self.pruning.controller.scorers.experts
        if experts is not None and experts.last:
            self.used[trainer.global_step] = {n: s.tolist() for n, s in experts.last.items()}
            experts.last = {}


def fit(kind: str, *, devices: int = 2, shard_experts: bool = False) -> tuple[CoupledPruningCallback, dict]:
    module = Step(shard_experts=shard_experts)
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=3, expert_score=kind, score="rms")
    used = Used(cb)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if devices == 2 else "auto"
    pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=devices, strategy=strategy, callbacks=[cb, used], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module)  # fmt: skip
    return cb, used.used


def main(kinds: list[str]) -> None:
    for run in kinds:
        kind, _, where = run.partition("+")
        cb, used = fit(kind, shard_experts=where == "experts")
        out = {"kind": run, "rank": dist.get_rank(), "dropped": cb.dropped, "used": used}
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    finish_worker()
