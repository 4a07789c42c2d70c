"""The gate math of bench_quality's ``gates*`` variants (bench/hard_concrete.py), against independent references."""

from __future__ import annotations

import math

import pytest
import torch

from tests.common.bench_modules import load_bench

hc = load_bench("hard_concrete")


@pytest.mark.parametrize("log_alpha", [-3.0, -0.5, 0.0, 1.0, 3.0])
def test_prob_open_matches_monte_carlo(log_alpha):
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    z = hc.sample_gate(torch.full((n,), log_alpha, dtype=torch.float64), generator=gen)
    assert z.min() >= 0
    assert z.max() <= 1
    mc = (z > 0).double().mean().item()
    p = hc.prob_open(torch.tensor(log_alpha, dtype=torch.float64)).item()
    assert abs(mc - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-4
    # the closed form, written independently: P(s_bar > 0) = P(s > -gamma / (zeta - gamma))
    s0 = 0.1 / 1.2
    ref = 1 / (1 + math.exp(-(log_alpha - (2 / 3) * math.log(s0 / (1 - s0)))))
    assert p == pytest.approx(ref, rel=1e-9)
    assert hc.expected_sparsity(torch.full((4,), log_alpha)).item() == pytest.approx(1 - ref, abs=1e-6)


def test_sample_is_differentiable_and_deterministic_gate_is_its_noise_free_value():
    la = torch.tensor([-5.0, 0.0, 5.0], requires_grad=True)
    hc.sample_gate(la, generator=torch.Generator().manual_seed(1)).sum().backward()
    assert la.grad is not None
    det = hc.deterministic_gate(torch.tensor([-5.0, 0.0, 5.0]))
    # sigmoid(0) * 1.2 - 0.1 = 0.5; large |log_alpha| saturates to exactly 0 and 1
    assert det.tolist() == pytest.approx([0.0, 0.5, 1.0])


def test_snap_keeps_exactly_k_by_log_alpha():
    gen = torch.Generator().manual_seed(2)
    for n, drop in [(256, 192), (4, 3), (10, 0), (7, 7), (512, 384)]:
        la = torch.randn(n, generator=gen)
        kept, dropped = hc.snap_top_k(la, drop)
        assert len(kept) == n - drop
        assert len(dropped) == drop
        assert sorted(kept + dropped) == list(range(n))
        if kept and dropped:
            assert la[kept].min() >= la[dropped].max()
    kept, dropped = hc.snap_top_k(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)  # ties: the lower index is kept
    assert (kept, dropped) == ([0, 1], [2, 3])
    with pytest.raises(ValueError, match="drop"):
        hc.snap_top_k(torch.zeros(3), 4)


def test_ramped_target():
    assert [hc.ramped_target(s, target=0.75, ramp_steps=4) for s in (0, 2, 4, 9)] == [0.0, 0.375, 0.75, 0.75]


def test_lagrangian_multipliers_ascend_and_gates_descend_toward_the_target():
    lag = hc.Lagrangian(["a", "b"])
    la = torch.nn.Parameter(torch.full((2, 8), 3.0))  # gates open: expected sparsity ~0.01 < target 0.5
    gate_opt = torch.optim.Adam([la], lr=0.2)
    opt = torch.optim.SGD([lag.lambdas], lr=0.5)  # plain SGD: one step changes the term by exactly lr * grad^2 >= 0
    values, sparsity = [], []
    for _ in range(40):
        expected = torch.stack([hc.expected_sparsity(row) for row in la])
        term = lag(expected, 0.5)
        opt.zero_grad()
        gate_opt.zero_grad()
        term.backward()
        opt.step()
        gate_opt.step()
        with torch.no_grad():  # the term at the new multipliers, the same gates: the multiplier step ascended it
            after = lag(expected.detach(), 0.5).item()
        values.append((term.item(), after))
        sparsity.append(expected.detach().mean().item())
    assert all(a >= t - 1e-12 for t, a in values)
    assert values[0][1] > values[0][0]  # the first step strictly increases the term (lambdas 0 -> not 0)
    # lambda1 went negative (s < t): the gates are pushed to close, the expected sparsity rises toward 0.5
    assert lag.lambdas[:, 0].max() < 0
    assert sparsity[-1] > sparsity[0] + 0.2
