"""One rank of the ModelParallelStrategy Trainer test (launched per rank by test_model_parallel.py).

A TinyGPT (Llama-style: RMSNorm, GQA, SwiGLU) is sharded in ``configure_model``: with a tensor-parallel size of 2
it first gets a sequence-parallel TP plan (q/k/v/gate/up/lm_head colwise, o/down rowwise, embedding rowwise,
norms sequence-parallel), then ``fully_shard`` over the data-parallel mesh axis; every parameter then lives on the
2-D (data_parallel, tensor_parallel) mesh, e.g. ``(_StridedShard(0), Shard(0))`` for colwise weights and
``(Shard(0), Shard(1))`` for rowwise ones. With a tensor-parallel size of 1 it is plain FSDP2 ``Shard(0)``.

Prints one ``RESULT {json}`` line per fit (each case, each executor), with the case as ``"mode:score"``.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from lightning_pat import Cluster, CoupledPruningCallback
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from lightning_pat.parallel.comm import dtensor, reduce
from tests.common.dist import finish_worker

CFG = TinyGPTConfig(
    vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=16, tie_embeddings=False
)
HEAD_DIM = CFG.d_model // CFG.n_head
L = r"layers\.(?P<layer>\d+)"
CLUSTERS = [
    Cluster(
        "mlp.{layer}",
        writers=[f"re:model\\.{L}\\.mlp\\.(gate|up)_proj\\.weight"],
        readers=[f"re:model\\.{L}\\.mlp\\.down_proj\\.weight"],
    ),
    Cluster(
        "heads.{layer}",
        writers=[f"re:model\\.{L}\\.attn\\.(q|k|v)_proj\\.weight"],
        readers=[f"re:model\\.{L}\\.attn\\.o_proj\\.weight"],
        head_dim=HEAD_DIM,
    ),
    Cluster(
        "resid",
        writers=[
            r"re:model\.layers\.\d+\.(attn\.o_proj|mlp\.down_proj)\.weight",
            r"re:model\.layers\.\d+\.(attn|mlp)_norm\.weight",
            "model.norm.weight",
        ],
        readers=[
            "model.embed.weight",
            "model.lm_head.weight",
            r"re:model\.layers\.\d+\.(attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.weight",
        ],
    ),
]


def _tp_plan(model: TinyGPT, tp_mesh) -> None:  # noqa: ANN001
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attn.q_proj": ColwiseParallel(),
                "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


class LitTiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(CFG)
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, CFG.vocab_size, (64, CFG.max_seq_len + 1), generator=g)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            _tp_plan(self.model, mesh["tensor_parallel"])
        dp = mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        (x,) = batch
        logits = self.model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), x[:, 1:].reshape(-1))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):  # noqa: ANN201
        return DataLoader(TensorDataset(self.tokens), batch_size=8)


def _count_calls(module, name: str, counter: dict[str, int]) -> None:  # noqa: ANN001
    original = getattr(module, name)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counter[name] = counter.get(name, 0) + 1
        return original(*args, **kwargs)

    wrapper.__wrapped_original__ = original
    setattr(module, name, wrapper)


def fit_once(dp: int, tp: int, mode: str, executor: str, score: str = "rms") -> dict:
    calls: dict[str, int] = {}
    counted = {"all_gather_packed": reduce, "reduce_counts": reduce, "full_tensor": dtensor, "write_back_": dtensor}
    for name, owner in counted.items():
        _count_calls(owner, name, calls)
    clusters = CLUSTERS  # the residual cluster too: data-aware scores take it from its nn.Linear readers
    cb = CoupledPruningCallback(
        clusters, target_sparsity=0.5, warmup_steps=0, ramp_steps=4, every_n_steps=1, executor=executor, mode=mode,
        score=score,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=dp * tp,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    module = LitTiny()
    trainer.fit(module)
    for name, owner in counted.items():  # undo the wrappers before the next fit
        setattr(owner, name, getattr(owner, name).__wrapped_original__)
    params = dict(module.named_parameters())
    placements = {n: [repr(p) for p in params[n].placements] for n in sorted(params)}
    zero_units = {}
    with torch.no_grad():
        full_weights = {n: params[n].full_tensor() for n in sorted(params)}
        for rc in cb.pruner.clusters:
            dead = set(range(rc.num_units))
            for m in rc.members:
                full = full_weights[m.name].narrow(m.dim, m.start, m.stop - m.start)
                other = 1 - m.dim if full.dim() == 2 else None
                per_channel = (full == 0).all(dim=other) if other is not None else full == 0
                per_unit = per_channel.view(rc.num_units, m.block).all(dim=1)
                dead &= set(torch.nonzero(per_unit).flatten().tolist())
            zero_units[rc.name] = sorted(dead)
    record = {"dropped": cb.dropped, "step": cb.step}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return {
        "rank": dist.get_rank(),
        "executor": executor,
        "routes": {k: list(v) for k, v in cb.pruner.routes.items()},
        "executors": [ex.kind for ex in cb.pruner.executors],
        "num_units": {rc.name: rc.num_units for rc in cb.pruner.clusters},
        "dropped": cb.dropped,
        "zero_units": zero_units,
        "all_ranks_equal": all(r == records[0] for r in records),
        "calls": calls,
        "step": cb.step,
        "placements": placements,
        "unit_sparsity": float(trainer.callback_metrics["pruning/unit_sparsity"]),
        "mesh": list(module.device_mesh.shape),
        "weights": {n: w.double().flatten().tolist() for n, w in full_weights.items()},
    }


def main(dp: int, tp: int, cases: list[tuple[str, str]], executors: list[str]) -> None:
    """Every ``(mode, score)`` case on this one world, each fitted once per executor (one process launch per rank)."""
    for mode, score in cases:
        for executor in executors:
            result = fit_once(dp, tp, mode, executor, score)
            print("RESULT " + json.dumps({"case": f"{mode}:{score}", **result}), flush=True)


if __name__ == "__main__":
    # argv: dp tp cases executors, e.g. ``2 2 latent:rms,direct:activation auto,materializing``
    main(
        int(sys.argv[1]), int(sys.argv[2]), [tuple(c.split(":")) for c in sys.argv[3].split(",")],
        sys.argv[4].split(",") if len(sys.argv) > 4 else ["auto"],
    )  # fmt: skip
    finish_worker()
