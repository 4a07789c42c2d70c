"""Worker of test_lm_tensor_parallel.py: a tiny non-Llama Hugging Face LM sharded by ``shard_causal_lm`` from its
config's ``base_model_tp_plan`` (tensor parallel over 2 ranks, FSDP2 over a data-parallel axis of 1), against the
same model on one process (built on every rank from the same seed)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.common import lm_zoo


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def logits_and_grads(rank: int, world: int, model_type: str) -> dict:
    """One forward and backward of the model on one process and sharded: the largest differences, and what was split."""
    from lightning_pat.lm.sharding import shard_causal_lm

    ref = lm_zoo.build(model_type).float()
    sharded = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
    shard_causal_lm(sharded, mesh)
    ids = lm_zoo.token_ids(batch=2, seq=10)  # the same batch on every rank
    out = {}
    for name, model in (("ref", ref), ("sharded", sharded)):
        logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        out[name] = logits.detach()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    split = sorted(
        n for n, p in sharded.named_parameters()
        if any("Shard" in type(pl).__name__ for pl in p.placements[1:])  # the tensor-parallel mesh axis
    ) if hasattr(next(sharded.parameters()), "placements") else []  # fmt: skip
    grad_rel = {
        n: float((_full(p.grad) - grads_ref[n]).abs().max() / grads_ref[n].abs().max().clamp_min(1e-12))
        for n, p in sharded.named_parameters()
    }
    return {
        "logits_rel": float((out["sharded"] - out["ref"]).abs().max() / out["ref"].abs().max()),
        "grad_rel": max(grad_rel.values()),
        "worst_grad": max(grad_rel, key=grad_rel.__getitem__),
        "split": split,
        "replicated_norms": sorted(
            n
            for n, p in sharded.named_parameters()
            if n.endswith(("q_norm.weight", "k_norm.weight"))
            and [type(pl).__name__ for pl in p.placements] == ["Shard", "Replicate"]
        ),  # fmt: skip
    }
