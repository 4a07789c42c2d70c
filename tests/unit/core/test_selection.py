"""Selection, scoring and masking primitives against hand values and the independent reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_pat.core.masking import count_zeros, scale_units_, zero_units_
from lightning_pat.core.norms import channel_sq_sums, group_count_correction, normalise
from lightning_pat.core.selection import bottom_k, bottom_k_shared, num_to_drop, round_kept, shrink_factors
from lightning_pat.core.spec import Member
from lightning_pat.core.units import fold_to_units, unit_of_channels
from tests.common.reference import drop_count, lowest

# ---------------------------------------------------------------------------------------------------- num_to_drop


@pytest.mark.parametrize(
    ("target", "num_units", "multiple_of", "expected"),
    [
        (0.0, 10, 1, 0),
        (0.3, 10, 1, 3),
        (0.7, 10, 1, 7),  # 0.7 * 10 == 7.000000000000001 in floating point
        (0.29, 100, 1, 29),
        (0.57, 100, 1, 57),
        (0.1, 3, 1, 1),  # ceil
        (0.34, 3, 1, 2),
        (1.0, 10, 1, 10),
        (0.3, 10, 4, 6),  # keep 7 -> 4
        (0.1, 10, 4, 2),  # keep 9 -> 8
        (0.2, 10, 4, 2),  # keep 8 already a multiple
        (0.0, 10, 4, 0),  # nothing dropped: no rounding
        (1.0, 10, 4, 10),
        (0.1, 5, 8, 5),  # multiple_of larger than what is kept: everything goes
        (0.5, 0, 1, 0),
    ],
)
def test_num_to_drop(target, num_units, multiple_of, expected):
    assert num_to_drop(target, num_units, multiple_of=multiple_of) == expected
    assert drop_count(target, num_units, multiple_of) == expected  # the reference agrees on the table


def test_num_to_drop_matches_reference_on_a_grid():
    for num_units in range(1, 40):
        for pct in range(0, 101):
            target = pct / 100
            for multiple_of in (1, 2, 3, 8):
                got = num_to_drop(target, num_units, multiple_of=multiple_of)
                assert got == drop_count(target, num_units, multiple_of), (target, num_units, multiple_of)


@pytest.mark.parametrize(
    ("target", "multiple_of", "match"),
    [
        (-0.01, 1, r"`target` must be in \[0, 1\], got -0\.01"),
        (1.01, 1, r"`target` must be in \[0, 1\]"),
        (math.nan, 1, r"`target` must be in \[0, 1\]"),
        (0.5, 0, r"`multiple_of` must be >= 1, got 0"),
    ],
)
def test_num_to_drop_errors(target, multiple_of, match):
    with pytest.raises(ValueError, match=match):
        num_to_drop(target, 10, multiple_of=multiple_of)


# ---------------------------------------------------------------------------------------------------- bottom_k


def test_bottom_k_lowest_first_sorted_output():
    scores = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0])
    assert bottom_k(scores, num_drop=3).tolist() == [1, 3, 4]
    assert bottom_k(scores, num_drop=0).tolist() == []
    assert bottom_k(scores, num_drop=0).dtype == torch.long
    assert bottom_k(scores, num_drop=-1).tolist() == []
    assert bottom_k(scores, num_drop=5).tolist() == [0, 1, 2, 3, 4]
    assert bottom_k(scores, num_drop=9).tolist() == [0, 1, 2, 3, 4]


def test_bottom_k_ties_drop_lowest_index_first():
    assert bottom_k(torch.zeros(6), num_drop=2).tolist() == [0, 1]
    assert bottom_k(torch.tensor([2.0, 1.0, 1.0, 0.0, 1.0]), num_drop=3).tolist() == [1, 2, 3]
    # large tensors with many ties (sort kernels may use other algorithms above small sizes)
    scores = torch.tensor([float(i % 3) for i in range(5000)], dtype=torch.float64)
    assert bottom_k(scores, num_drop=10).tolist() == [3 * i for i in range(10)]


@pytest.mark.parametrize("seed", range(20))
def test_bottom_k_matches_reference_with_many_ties(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    values = [float(rng.randint(0, 5)) for _ in range(n)]
    k = rng.randint(0, n)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        got = bottom_k(torch.tensor(values, dtype=dtype), num_drop=k).tolist()
        assert got == sorted(lowest(values, k)), dtype


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_bottom_k_rejects_non_finite_scores(bad):
    with pytest.raises(ValueError, match=r"Cluster 'mlp': non-finite scores at units \[2\]"):
        bottom_k(torch.tensor([1.0, 2.0, bad]), num_drop=0, what="Cluster 'mlp'")


def test_bottom_k_shared_joint_ranking_and_tie_order():
    a = torch.tensor([1.0, 5.0, 2.0])
    b = torch.tensor([1.0, 0.5], dtype=torch.float64)
    c = torch.tensor([2.0, 1.0, 9.0])
    picked = bottom_k_shared([a, b, c], num_drop=3)
    # 0.5 (b1); then 1.0 ties: a0, b0, c1 in cluster order -> a0, b0
    assert [p.tolist() for p in picked] == [[0], [0, 1], []]
    picked = bottom_k_shared([a, b, c], num_drop=4)
    assert [p.tolist() for p in picked] == [[0], [0, 1], [1]]
    picked = bottom_k_shared([a, b, c], num_drop=5)  # 2.0 ties: a2 before c0
    assert [p.tolist() for p in picked] == [[0, 2], [0, 1], [1]]
    assert bottom_k_shared([], num_drop=3) == []
    with pytest.raises(ValueError, match=r"Budget 'x': non-finite"):
        bottom_k_shared([a, torch.tensor([math.nan])], num_drop=1, what="Budget 'x'")


def test_bottom_k_shared_does_not_round_float32_against_float64():
    # 1 - 2**-40 rounds to 1.0 in float32 (a tie, cluster a first); compared in float64 b is strictly lower
    a = torch.tensor([1.0], dtype=torch.float32)
    b = torch.tensor([1.0 - 2.0**-40], dtype=torch.float64)
    assert [p.tolist() for p in bottom_k_shared([a, b], num_drop=1)] == [[], [0]]


# ---------------------------------------------------------------------------------------------------- round_kept


def test_round_kept():
    scores = torch.tensor([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0, 0.5])
    dropped = torch.tensor([1, 9])
    # 10 units, 2 dropped, keep 8 -> multiple of 3 -> keep 6: drop the two lowest kept: 3 (2.0), 5 (3.0)
    assert round_kept(dropped, scores, multiple_of=3).tolist() == [1, 3, 5, 9]
    assert round_kept(dropped, scores, multiple_of=4).tolist() == [1, 9]  # 8 already a multiple
    assert round_kept(dropped, scores, multiple_of=1).tolist() == [1, 9]
    empty = torch.zeros(0, dtype=torch.long)
    assert round_kept(empty, scores, multiple_of=3).tolist() == []  # nothing dropped: nothing rounded
    # ties among the kept units: lowest index first
    assert round_kept(torch.tensor([0]), torch.ones(6), multiple_of=4).tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------------- shrinkage


def test_shrink_factors():
    norms = torch.tensor([0.0, 1.0, 2.0, 4.0], dtype=torch.float64)
    assert shrink_factors(norms, threshold=2.0).tolist() == [0.0, 0.0, 0.0, 0.5]
    assert shrink_factors(norms, threshold=0.0).tolist() == [0.0, 1.0, 1.0, 1.0]  # a zero unit stays zero
    assert shrink_factors(norms, threshold=torch.tensor(1.0, dtype=torch.float64)).tolist() == [0.0, 0.0, 0.5, 0.75]


# ---------------------------------------------------------------------------------------------------- scoring


def test_normalise_score_types():
    q = torch.tensor([4.0, 16.0], dtype=torch.float64)
    assert normalise(q, unit_numel=4, score="rms").tolist() == [1.0, 2.0]
    assert normalise(q, unit_numel=4, score="l2").tolist() == [2.0, 4.0]
    assert normalise(q, unit_numel=4, score="param_cost").tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"`score` must be one of \('rms', 'l2', 'param_cost'\), got 'max'"):
        normalise(q, unit_numel=4, score="max")


def test_group_count_correction():
    s = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert group_count_correction(s, reference=None) is s
    assert group_count_correction(s, reference=1).tolist() == [2.0, 4.0, 6.0, 8.0]  # sqrt(4 / 1)
    assert group_count_correction(s, reference=16).tolist() == [0.5, 1.0, 1.5, 2.0]  # sqrt(4 / 16)


def test_channel_sums_and_units():
    w = torch.arange(12.0, dtype=torch.float64).view(3, 4)
    assert channel_sq_sums(w, dim=0, acc_dtype=torch.float64).tolist() == pytest.approx(
        [float((w[i] ** 2).sum()) for i in range(3)], rel=1e-15
    )
    assert channel_sq_sums(w, dim=1, acc_dtype=torch.float64).tolist() == pytest.approx(
        [float((w[:, j] ** 2).sum()) for j in range(4)], rel=1e-15
    )
    assert channel_sq_sums(w, dim=1, acc_dtype=torch.float64).dtype == torch.float64
    assert channel_sq_sums(torch.tensor([3.0, -2.0]), dim=0, acc_dtype=torch.float32).tolist() == [9.0, 4.0]
    assert channel_sq_sums(torch.zeros(0, 5), dim=0, acc_dtype=torch.float32).shape == (0,)
    assert channel_sq_sums(torch.zeros(3, 0), dim=0, acc_dtype=torch.float32).tolist() == [0.0, 0.0, 0.0]
    # a shard holding global channels 4..9 of a member that starts at channel 6 with blocks of 2
    units = unit_of_channels(start=6, block=2, offset=4, length=6, device=torch.device("cpu"))
    assert units.tolist() == [-1, -1, 0, 0, 1, 1]
    sums = torch.tensor([100.0, 100.0, 1.0, 2.0, 3.0, 4.0])
    assert fold_to_units(sums, units, num_units=2).tolist() == [3.0, 7.0]
    assert fold_to_units(sums, units, num_units=1).tolist() == [3.0]  # units >= C are outside


# ---------------------------------------------------------------------------------------------------- masking


def _member(dim: int, start: int, stop: int, block: int, shape: tuple) -> Member:
    role = "writer" if dim == 0 else "reader"
    return Member("w", role, dim, start, stop, block, shape)


def test_zero_units_on_a_slice_and_on_a_local_shard():
    w = torch.arange(1.0, 25.0).view(12, 2)
    m = _member(0, 4, 10, 2, (12, 2))  # 3 units of 2 rows, rows 4..9
    full = w.clone()
    zero_units_(full, m, torch.tensor([0, 2]), num_units=3)
    zero_rows = [i for i in range(12) if bool((full[i] == 0).all())]
    assert zero_rows == [4, 5, 8, 9]
    assert torch.equal(full[[0, 1, 2, 3, 6, 7, 10, 11]], w[[0, 1, 2, 3, 6, 7, 10, 11]])
    # the same on a shard holding rows 6..11: only its own part of unit 2 changes
    shard = w[6:].clone()
    zero_units_(shard, m, torch.tensor([0, 2]), num_units=3, offset=6)
    assert [i + 6 for i in range(6) if bool((shard[i] == 0).all())] == [8, 9]
    assert int(count_zeros(shard)) == 4
    assert int(count_zeros(full)) == 8
    # nothing to zero
    untouched = w.clone()
    zero_units_(untouched, m, torch.zeros(0, dtype=torch.long), num_units=3)
    assert torch.equal(untouched, w)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "dim"), [((5, 64), 1), ((64, 5), 0), ((3, 64, 4), 1), ((4, 64, 3, 3), 1), ((64,), 0)]
)
@pytest.mark.parametrize("fraction", [1 / 64, 0.25, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_zero_channels_sets_exactly_the_bits_of_a_per_channel_fill(dtype, shape, dim, fraction, layout):
    """Rows by index, columns (from 1/32 of them on) by a bitwise AND: either way the dropped channels hold +0.0
    whatever they held (NaN, -inf), and every other element keeps its bits (-0.0 included)."""
    from lightning_pat.core.masking import zero_channels_

    torch.manual_seed(0)
    t = torch.randn(shape).to(dtype)
    flat = t.view(-1)
    flat[::7], flat[::11], flat[::13] = -0.0, float("nan"), float("-inf")
    if layout == "transposed":  # the same values, the channel axis elsewhere in memory
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    channels = torch.randperm(shape[dim])[: max(1, int(fraction * shape[dim]))].sort().values
    want = t.clone()
    for c in channels.tolist():  # the plain computation, one channel at a time
        want.select(dim, c).fill_(0.0)
    member = Member("w", "reader" if dim else "writer", dim, 0, shape[dim], 1, shape)
    got = t.clone()
    zero_channels_(got, member, channels)
    assert torch.equal(_bits(got), _bits(want))
    assert got.stride() == t.stride()


def test_scale_units_columns_with_zero_factor():
    w = torch.ones(2, 6, dtype=torch.float64)
    m = _member(1, 0, 6, 2, (2, 6))
    scale_units_(w, m, torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64))
    assert w[0].tolist() == [0.5, 0.5, 0.0, 0.0, 1.0, 1.0]
    assert int(count_zeros(w)) == 4


def test_scale_units_bfloat16_keeps_dtype():
    w = torch.full((4, 3), 2.0, dtype=torch.bfloat16)
    m = _member(0, 0, 4, 1, (4, 3))
    scale_units_(w, m, torch.tensor([0.5, 1.0, 0.0, 0.25], dtype=torch.float32))
    assert w.dtype == torch.bfloat16
    assert w[:, 0].tolist() == [1.0, 2.0, 0.0, 0.5]
