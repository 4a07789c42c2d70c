"""CUDA checks: skipped cleanly on machines without a GPU (CI has none); run them where one is lent."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_pat import prune_clusters
from lightning_pat.demo import preset as demo_preset
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_selection_matches_cpu(dtype):
    torch.manual_seed(0)
    cpu = TinyGPT(TinyGPTConfig(n_layer=2, d_model=64, d_ff=256))
    with torch.no_grad():  # well-separated MLP unit norms (5% apart), so device rounding cannot reorder them
        for block in cpu.layers:
            scale = 1.05 ** torch.randperm(256).double()
            for w in (block.mlp.gate_proj.weight, block.mlp.up_proj.weight):
                w.copy_(w.sign() * 0.02 * scale[:, None])
            block.mlp.down_proj.weight.copy_(block.mlp.down_proj.weight.sign() * 0.02 * scale[None, :])
    cpu = cpu.to(dtype)
    gpu = copy.deepcopy(cpu).cuda()
    clusters = demo_preset.tiny_gpt(cpu, heads=False)
    want = prune_clusters(cpu, clusters, 0.5)
    got = prune_clusters(gpu, clusters, 0.5)
    assert got.dropped == want.dropped  # stable (score, index) order does not depend on the device
    assert got.zeros == want.zeros
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values(), strict=True):
        assert torch.equal(a, b.cpu()), name
