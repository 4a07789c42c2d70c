"""What the attention modules share (``heads/parts.py``): the relative position index and the hooks taken over.

References written here: the index of every (query, key) pair computed by a plain double loop over the window's
positions (row-major), and hooks counted by the calls they receive.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat.heads.parts import move_hooks, relative_index


@pytest.mark.parametrize(("wh", "ww"), [(1, 1), (2, 3), (3, 2), (4, 4)])
def test_relative_index_against_a_double_loop(wh, ww):
    positions = [(y, x) for y in range(wh) for x in range(ww)]
    expected = [(qy - ky + wh - 1) * (2 * ww - 1) + (qx - kx + ww - 1) for qy, qx in positions for ky, kx in positions]
    index = relative_index(wh, ww, "cpu")
    assert index.tolist() == expected
    assert (index.dtype, int(index.min()), int(index.max())) == (torch.int64, 0, (2 * wh - 1) * (2 * ww - 1) - 1)


def test_move_hooks_hands_the_hooks_and_the_training_flag_to_the_new_module():
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    calls = []
    old.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    old.register_forward_hook(lambda m, args, kwargs, out: calls.append("post"), with_kwargs=True)
    old.eval()
    move_hooks(old, new)
    new(torch.zeros(1, 2))
    assert calls == ["pre", "post"]
    assert new.training is False
