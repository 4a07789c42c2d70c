"""The thread count of the demo, the examples and the notebooks (lightning_pat.demo.threads)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_pat.demo import threads


@pytest.fixture
def machine(monkeypatch):
    """A machine of 2 usable CPUs whose 1-minute load the test sets."""
    state = {"load": 0.0}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (state["load"], 0.0, 0.0), raising=False)
    return state


def test_omp_num_threads_is_respected(machine):
    machine["load"] = 9.0
    assert threads.cpu_threads(env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3")


@pytest.mark.parametrize(
    ("load", "processes", "cap", "want"),
    [
        (0.0, 1, 8, 2),  # idle: every usable CPU
        (1.0, 1, 8, 2),  # the process's own start
        (2.5, 1, 8, 1),  # another busy process: one thread, never oversubscribed
        (6.0, 1, 8, 1),  # a shared machine far over its CPUs: still at least one
        (0.0, 2, 8, 1),  # two ranks share the two CPUs
        (0.0, 1, 1, 1),  # the cap
    ],
)
def test_usable_cpus_less_the_others_load(machine, load, processes, cap, want):
    machine["load"] = load
    n, reason = threads.cpu_threads(env={"OMP_NUM_THREADS": ""}, processes=processes, cap=cap)
    assert n == want
    assert "2 CPUs this process may use" in reason
    assert f"1-minute load {load:.1f}" in reason
    assert "OMP_NUM_THREADS" in reason


def test_use_cpu_threads_sets_torch_and_says_so(machine, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        assert threads.use_cpu_threads() == "torch CPU threads: 1 (OMP_NUM_THREADS=1)"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
