"""Suite-wide settings of the pytest process.

One intra-op torch thread (issue 26): the tests' models are tiny, so a second thread only spins; on the 2-core CI
machine it also competes with the rank processes and console scripts the tests start. Measured on
tests/integration/test_resume.py (Trainer fits in this process): the same wall time within noise, about 27% less CPU
time (18.5 s instead of 25.8 s, two runs each). Worker processes set their own (``tests.common.dist``: one thread per
rank); subprocesses are not affected. ``tests/unit/conftest.py``'s ``single_thread`` fixture stays correct: it
restores the count it found.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
