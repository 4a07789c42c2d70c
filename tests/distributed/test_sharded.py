"""The sharded executor on CPU gloo: parity with the materializing path and a dense reference, collective
accounting, cross-rank agreement at ties, replica-aware counts, sub-meshes.

One spawned run per mesh config (``run_distributed``) executes every check (``workers/sharded.py: suite``); the tests
below each assert one aspect of its result, so a failure names what broke.
"""

from __future__ import annotations

import pytest

from tests.common.dist import run_distributed
from tests.distributed.workers import model as M
from tests.distributed.workers.sharded import suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIGS = {"w2-1d": (2, "1d"), "w3-1d": (3, "1d"), "w4-1d": (4, "1d"), "w4-2x2": (4, "2x2")}


_RESULTS: dict[str, list[dict]] = {}


def _results(name: str) -> list[dict]:
    """Per-rank results of the config's spawned run (run once per test session, then cached)."""
    if name not in _RESULTS:
        world, kind = CONFIGS[name]
        _RESULTS[name] = run_distributed(suite, world, kind, timeout=240)
    return _RESULTS[name]


@pytest.fixture(params=list(CONFIGS))
def run(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param, _results(request.param)


def test_parity_with_materializing_and_dense_reference(run):
    """Same dropped units, same weights (bitwise for hard masks, 1e-11 for group lasso), same literal-zero
    counts as the float64 reference, for every layout, score type, budget and method; also hold()/zero_grads()."""
    name, ranks = run
    for rank, out in enumerate(ranks):
        parity = out["parity"]
        assert parity["num_cases"] >= 30, parity["num_cases"]
        assert parity["failures"] == [], f"{name} rank {rank}: " + "\n".join(parity["failures"][:20])


def test_every_rank_selects_and_scores_bitwise_identically(run):
    """all_gather_object of (dropped, Q bits) for every case: identical on every rank of every replica group."""
    name, ranks = run
    assert all(out["parity"]["ranks_agree"] for out in ranks), name
    assert all(out["agreement"]["ranks_agree"] for out in ranks), name


def _expected_calls(acc: dict, *, counted: bool) -> list[tuple]:
    calls = [("all_gather_single", tuple(group), "torch.float64", numel) for group, numel in acc["expect_gathers"]]
    if counted:
        calls.append(("all_reduce", tuple(acc["whole_mesh"]), "torch.int64", acc["num_params"]))
    return calls


def test_one_all_gather_per_group_and_one_int64_reduce_only_when_counting(run):
    """Per pruning step: exactly one all_gather per distinct gather group (carrying every cluster's C units),
    nothing else; with counts one more int64 all_reduce over the whole mesh. No full_tensor / redistribute /
    distribute_tensor, and no DTensor-internal (functional) collective either."""
    name, ranks = run
    for rank, out in enumerate(ranks):
        accounting = out["parity"]["accounting"]
        assert accounting, f"{name}: no all-sharded layout was accounted"
        for layout, acc in accounting.items():
            where = f"{name} rank {rank} {layout}"
            for key, counted in (("plain", False), ("counted", True)):
                got = acc[key]
                calls = [tuple(c[:1]) + (tuple(c[1]),) + tuple(c[2:]) for c in got["calls"]]
                assert sorted(calls) == sorted(_expected_calls(acc, counted=counted)), where
                assert got["materialized"] == [], where
                assert set(got["comm_counts"]) <= {"c10d._allgather_base_", "c10d.allreduce_"}, where
                assert sum(got["comm_counts"].values()) == len(calls), where


def test_two_phase_reduction_same_bits_fewer_bytes(run):
    """Forced for groups of more than two ranks: one all_to_all of blocks plus one all_gather of the summed blocks
    per group, bitwise the same Q as the one-collective path, the reference's selection, nothing materialized."""
    name, ranks = run
    exercised = 0
    for out in ranks:
        for layout, acc in out["parity"]["accounting"].items():
            assert acc["two_phase_same_bits"], (name, layout)
            assert acc["two_phase_dropped_ok"], (name, layout)
            want = []
            for group, numel in acc["expect_gathers"]:
                n = len(group)
                if n > 2:
                    block = -(-numel // n)
                    want += [
                        ("all_to_all_single", tuple(group), "torch.float64", n * block),
                        ("all_gather_single", tuple(group), "torch.float64", block),
                    ]
                    exercised += 1
                else:
                    want.append(("all_gather_single", tuple(group), "torch.float64", numel))
            got = acc["two_phase"]
            calls = [(c[0], tuple(c[1]), c[2], c[3]) for c in got["calls"]]
            assert sorted(calls) == sorted(want), (name, layout)
            assert got["materialized"] == [], (name, layout)
    if name != "w2-1d":
        assert exercised, name


def test_collectives_do_not_grow_with_cluster_count(run):
    """Five clusters (heads, GQA heads, two MLPs, residual) share one packed buffer per gather group."""
    name, ranks = run
    for out in ranks:
        for layout, acc in out["parity"]["accounting"].items():
            gathers = [c for c in acc["plain"]["calls"] if c[0] == "all_gather_single"]
            assert len(gathers) == len(acc["expect_gathers"]) <= 3, (name, layout)
            assert sum(c[3] for c in gathers) <= sum(rc.num_units for rc in M.ref_clusters()), (name, layout)


def test_ties_drop_lowest_index_and_near_ties_agree(run):
    """Exact ties drop the lowest index first on every path; 1-ulp-apart values are ordered by value; values
    that tie only mathematically (permuted columns, rounding differs by summation order) agree on all ranks."""
    name, ranks = run
    for out in ranks:
        for tag, routes, dropped, _ in out["agreement"]["records"]:
            assert dropped["tie"] == [0, 1, 3, 5], (name, tag)  # Q = 13*[4,1,4,1,9,1,4,9]: ties 1,3,5 then 0
            assert dropped["ulp"] == [1, 2, 4, 5], (name, tag)  # x = 1.5*(1+2^-23)^[2,1,0,3,1,0,2,4]
            if tag.endswith("/auto"):
                assert set(routes.values()) == {"sharded"}, (name, tag)


def test_literal_zeros_not_multiplied_by_replicas(run):
    """Zero counts equal the reference's literal zeros (an isolated zero plus dropped slices, overlaps once) on
    every layout; replicated mesh axes and replicated 1-D members are counted once, not once per replica."""
    name, ranks = run
    for out in ranks:
        zeros = out["parity"]["zeros"]
        assert zeros, name
        for layout, (got, want, _) in zeros.items():
            assert got == want, (name, layout)
            assert want["embed"] >= 1
    placements = {p for _, _, layout in ranks[0]["parity"]["zeros"].values() for ps in layout for p in ps}
    assert "Replicate()" in placements, name


def test_submesh_nonparticipant_is_silent():
    """World 3, mesh over ranks [1, 2]: rank 0 gets no clusters and issues no collective; ranks 1-2 match the
    reference with one all_gather and one int64 all_reduce on their own group."""
    ranks = _results("w3-1d")
    assert ranks[0]["submesh"]["clusters"] == []
    assert ranks[0]["submesh"]["calls"] == {"calls": [], "materialized": [], "comm_counts": {}}
    for out in ranks[1:]:
        sub = out["submesh"]
        assert sub["match"], sub
        assert [(c[0], tuple(c[1]), c[2]) for c in sub["calls"]["calls"]] == [
            ("all_gather_single", (1, 2), "torch.float64"),
            ("all_reduce", (1, 2), "torch.int64"),
        ]
