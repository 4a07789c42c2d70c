"""Suite-wide settings of the pytest process.

One intra-op torch thread (issue 26): the tests' models are tiny, so a second thread only spins; on the 2-core CI
machine it also competes with the rank processes and console scripts the tests start. Measured on
tests/integration/test_resume.py (Trainer fits in this process): the same wall time within noise, about 27% less CPU
time (18.5 s instead of 25.8 s, two runs each). Worker processes set their own (``tests.common.dist``: one thread per
rank). ``tests/unit/conftest.py``'s ``single_thread`` fixture stays correct: it restores the count it found.

The processes the tests start (examples, console scripts, notebooks, bench smoke runs) inherit
``OMP_NUM_THREADS=1`` unless the caller set it: with two xdist workers on two cores, each starting processes with a
thread per core, the intra-op threads spin against each other. Measured: two ``examples/cnn_digits.py`` runs side by
side took 37.6 s with the default threads and 15.0 s with one each; the same example inside the suite took 168 s.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test starts a process (see the module docstring)
torch.set_num_threads(1)
