"""CUDA checks: skipped cleanly on machines without a GPU (CI has none); run them where one is lent."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_pat import prune_clusters
from lightning_pat.demo import preset as demo_preset
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from tests.common.bench_modules import load_bench

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


def test_cuda_refit_matches_cpu():
    """refit_readers keeps its solve on the calibration device (it once built the ridge term on the CPU)."""
    from torch import nn

    from lightning_pat import Cluster
    from lightning_pat.pruning.repair import calibrate_readers, refit_readers

    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    gpu = copy.deepcopy(cpu).cuda()
    hidden = Cluster("h", writers=["0.weight", "0.bias"], readers=["2.weight"])
    batches = [torch.randn(64, 8) for _ in range(3)]
    reports = []
    for net, dev in ((cpu, "cpu"), (gpu, "cuda")):
        grams = calibrate_readers(net, hidden, [b.to(dev) for b in batches])
        result = prune_clusters(net, hidden, 0.5)
        reports.append(refit_readers(net, result, grams))
    assert reports[1].modules == reports[0].modules == {"2": (16, 16)}
    assert reports[1].error["2"][1] < reports[1].error["2"][0]
    torch.testing.assert_close(gpu[2].weight.cpu(), cpu[2].weight, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arm", ["act_mlp_refit", "act_refit", "mix_refit", "act_mlp_bias", "depth", "llmpruner",
                                 "shortgpt", "tp_taylor", "ramp", "scratch"])  # fmt: skip
def test_bench_pretrained_arms_on_cuda(arm):
    """Every arm of bench/gpu_pretrained.py cuts, heals (bf16) and evaluates on CUDA (the quick model, 3 steps)."""
    if arm.startswith("tp_"):
        pytest.importorskip("torch_pruning")
    bench = load_bench("bench_pretrained")
    (rec,) = bench.main(["--one", arm, "--size", "0.75", "--quick", "--device", "cuda", "--precision", "bf16-mixed",
                         "--steps", "3", "--batch", "4", "--no-samples", "--threads", "2"])  # fmt: skip
    assert rec["device"] == "cuda"
    assert rec["params"] < rec["dense_params"] * 0.8
    assert 0 < rec["code"] < 10
    assert 0 < rec["eng"] < 10
