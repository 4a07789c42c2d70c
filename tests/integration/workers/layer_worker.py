"""One rank of the layer-unit tests under DDP, FSDP2 and tensor parallelism (launched per rank by test_layer_units).

    python layer_worker.py {ddp|fsdp2|tp} [VARIANT,VARIANT,...]    (variants of :func:`callback`; default layers)

A TinyGPT with 4 layers is pruned with the ``tiny_gpt`` preset, layer units and ``target_params`` (layer scores
``1 - cos(input, output)`` from the training forwards). ``ddp`` and ``fsdp2`` (``ModelParallelStrategy`` with a
data-parallel size of 2) give each rank half of every global batch of 16 sequences; ``tp`` (a tensor-parallel size of
2, sequence parallel) gives both ranks the whole batch, each holding half of the tokens (batches are chosen by the
step and the rank, not by a sampler). Every layout therefore
computes the same global batch as one process with ``batch_size=16`` (:func:`fit_single`). After the fit every rank
copies the full weights into a plain model, shrinks it with the callback's state and reports the parameter count and
the outputs. Fits the variants in sequence in this one process; prints one ``RESULT {json}`` line per variant.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_pat import CoupledPruningCallback, shrink
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from lightning_pat.parallel.comm import dtensor

CFG = TinyGPTConfig(
    vocab_size=64, n_layer=4, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=16, tie_embeddings=False
)
GLOBAL_BATCH = 16
MAX_STEPS = 6


class LitLayers(pl.LightningModule):
    def __init__(self, parallel: str = "none", batch_size: int = GLOBAL_BATCH) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(dataclasses.replace(CFG))  # shrink rewrites the model's config
        self.parallel, self.batch_size = parallel, batch_size
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH * MAX_STEPS, CFG.max_seq_len + 1), generator=g)

    def configure_model(self) -> None:
        if self.parallel != "none":  # the sequence-parallel TP plan (tp > 1), then fully_shard per block and root
            from tests.distributed.workers.model_parallel import LitTiny

            LitTiny.configure_model(self)

    def training_step(self, batch, batch_idx):
        # the batch is chosen by the step (and the data-parallel rank), so that every layout and a resumed run
        # see the same global batches (Lightning's distributed sampler would shuffle them)
        part = 0 if self.batch_size == GLOBAL_BATCH else self.global_rank
        start = GLOBAL_BATCH * self.global_step + part * self.batch_size
        x = self.tokens[start : start + self.batch_size]
        logits = self.model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), x[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    def train_dataloader(self):
        return DataLoader(list(range(4 * MAX_STEPS)), batch_size=1)


def callback(variant: str = "layers") -> CoupledPruningCallback:
    """``layers``: layer units in a parameter target; ``ranked``: non-uniform widths (no layer units);
    ``flops``: layer units in a FLOP target."""
    size = {
        "layers": {"target_params": 0.6, "target_layers": 3, "preset_options": {"layers": True}},
        "ranked": {"target_params": 0.6, "target_widths": "ranked"},
        "flops": {"target_flops": 0.6, "seq_len": CFG.max_seq_len, "preset_options": {"layers": True}},
    }[variant]
    return CoupledPruningCallback("tiny_gpt", warmup_steps=1, ramp_steps=3, mode="latent", **size)


def trainer(cb: CoupledPruningCallback, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_steps=MAX_STEPS, callbacks=[cb], accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def ids() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=torch.Generator().manual_seed(5))


def report(lit: LitLayers, cb: CoupledPruningCallback, state: dict) -> dict:
    from lightning_pat.sizing.flops import count_flops

    """Shrink a plain copy of ``lit``'s full weights with ``state``; what the tests compare."""
    plain = LitLayers()
    with torch.no_grad():
        full = {n: dtensor.full_tensor(p).detach().clone() for n, p in lit.named_parameters()}
        plain.load_state_dict(full)
        plain.eval()
        masked = plain.model(ids())
        small = shrink(plain, state)
        out = small.model(ids())
    return {
        "dropped": cb.dropped,
        "step": cb.step,
        "achieved": cb.size.achieved,
        "layer_scores": {} if cb.controller.run.collectors.layers is None else cb.controller.run.collectors.layers.last,
        "shrunk_params": sum(p.numel() for p in small.parameters()),
        "shrunk_flops": count_flops(small, seq_len=CFG.max_seq_len),
        "num_layers": len(small.model.layers),
        "widths": sorted([n, list(p.shape)] for n, p in small.named_parameters()),
        "rel": float((out - masked).abs().max() / masked.abs().max()),
        "checksum": float(sum(v.double().sum() for v in full.values())),
    }


def fit_single(variant: str = "layers") -> dict:
    """The one-process reference: the same global batches on one device."""
    lit, cb = LitLayers(), callback(variant)
    trainer(cb).fit(lit)
    return report(lit, cb, cb.state_dict())


def fit_distributed(kind: str, variant: str = "layers") -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if kind == "ddp":
        lit = LitLayers("none", GLOBAL_BATCH // 2)
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        dp, tp = (2, 1) if kind == "fsdp2" else (1, 2)
        lit = LitLayers(kind, GLOBAL_BATCH // dp)
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    cb = callback(variant)
    trainer(cb, strategy=strategy, devices=2).fit(lit)
    state = cb.state_dict()  # every rank: the layer sums are gathered
    result = report(lit, cb, state)
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (result["dropped"], result["layer_scores"], result["achieved"]))
    result["all_ranks_equal"] = all(r == records[0] for r in records)
    result["rank"] = dist.get_rank()
    result["variant"] = variant
    print("RESULT " + json.dumps(result), flush=True)


def main(kind: str, variants: str = "layers") -> None:
    """Every variant of the comma-separated list in sequence, in this one process (one launch per rank for all)."""
    for variant in variants.split(","):
        fit_distributed(kind, variant)


if __name__ == "__main__":
    from tests.common.dist import finish_worker

    main(*sys.argv[1:])
    finish_worker()
