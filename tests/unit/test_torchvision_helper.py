"""The zoo's torchvision helper must not leak its folder into other processes (a CI failure of 2026-12-02).

Spawned workers inherit the parent's ``sys.path``; with the torchvision folder on it, every distributed test that ran
after a zoo test died importing torchmetrics ("operator torchvision::nms does not exist").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.common.torchvision_zoo import TORCHVISION_DIR, import_torchvision


def test_import_torchvision_leaves_sys_path_as_it_was_and_models_still_build():
    before = list(sys.path)
    tv = import_torchvision()
    assert sys.path == before
    assert str(TORCHVISION_DIR) not in sys.path
    model = tv.models.get_model("resnet18", weights=None, num_classes=10)  # submodules still resolve
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_a_process_started_with_our_sys_path_imports_torchmetrics():
    import_torchvision()
    code = f"import sys; sys.path[:] = {json.dumps(sys.path)}; import torchmetrics; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
