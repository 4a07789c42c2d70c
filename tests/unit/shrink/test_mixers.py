"""Mamba-style mixers found by structure (their own ``A_log``/``D``/``dt_bias``), their sizes after a cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pat.shrink.mixers import mamba2_layout, mixer_config, mixer_kind, rewrite_mixer
from tests.common.tiny_families import zamba_mixer


class Mixer2(nn.Module):
    """A Mamba 2 mixer's parameters and sizes, named as transformers names them, in a class of any name."""

    def __init__(
        self, heads: int = 4, head_dim: int = 2, groups: int = 2, state: int = 3, hidden: int = 8, norm: bool = True
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size = heads, head_dim, groups, state
        self.intermediate_size = inner = heads * head_dim
        self.conv_dim = inner + 2 * groups * state
        self.in_proj = nn.Linear(hidden, 2 * inner + 2 * groups * state + heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, 4, groups=self.conv_dim, padding=3)
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.ones(heads)) for _ in range(3))
        self.norm = nn.Module()
        if norm:
            self.norm.weight = nn.Parameter(torch.ones(inner))
            self.norm.group_size = inner // groups
        # Falcon-H1's per-row multipliers of in_proj's parts [z, x, B, C, dt]
        parts = (inner, inner, groups * state, groups * state, heads)
        self.register_buffer("mup_vector", torch.cat([torch.full((n,), i + 1.0) for i, n in enumerate(parts)]))
        self.out_proj = nn.Linear(inner, hidden, bias=False)


def test_a_mixer_is_known_by_its_parameters_not_its_name():
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(hidden_size=8, state_size=3, num_hidden_layers=1, vocab_size=10)
    mamba = transformers.models.mamba.modeling_mamba.MambaMixer(config, 0)
    assert mixer_kind(mamba) == "mamba_mixer"
    assert mixer_kind(Mixer2()) == "mamba2_mixer"
    assert mamba2_layout(Mixer2()) == (8, 4, 2, 2, 3)
    plain = nn.Module()
    plain.A_log, plain.D = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    assert mixer_kind(plain) is None  # no in_proj, conv1d, out_proj


def test_a_mamba2_mixer_losing_a_group_loses_its_heads_and_the_config_follows():
    mixer = Mixer2()
    for p in (mixer.D, mixer.A_log, mixer.dt_bias):
        p.data = p.data[2:]  # one group of two heads kept, as the surgery leaves it
    rewrite_mixer(mixer)
    assert (mixer.num_heads, mixer.n_groups, mixer.intermediate_size, mixer.conv_dim) == (2, 1, 4, 4 + 2 * 3)
    config = type("Config", (), {"hidden_size": 4, "mamba_expand": 2, "mamba_n_heads": 4, "mamba_n_groups": 2})()
    assert mixer_config(mixer, config) == {"mamba_expand": 1, "mamba_n_heads": 2, "mamba_n_groups": 1}


def test_without_a_norm_a_mamba2_mixer_loses_heads_keeps_its_groups_and_rebuilds_its_row_multipliers():
    mixer = Mixer2(heads=4, groups=1, norm=False)
    for p in (mixer.D, mixer.A_log, mixer.dt_bias):
        p.data = p.data[1:]
    rewrite_mixer(mixer)
    assert (mixer.num_heads, mixer.n_groups, mixer.intermediate_size, mixer.conv_dim) == (3, 1, 6, 6 + 2 * 3)
    assert mixer.mup_vector.tolist() == [1.0] * 6 + [2.0] * 6 + [3.0] * 3 + [4.0] * 3 + [5.0] * 3


def test_a_zamba_mixer_split_into_heads_loses_heads_and_the_config_follows():
    mixer = zamba_mixer()
    assert mixer_kind(mixer) == "mamba_heads_mixer"  # D is [heads, head_dim]: not a Mamba 1 channel mixer
    for name in ("A_log", "D", "x_proj_weight", "dt_proj_weight", "dt_proj_bias"):
        p = getattr(mixer, name)
        p.data = p.data[2:]  # two of four heads kept, as the surgery leaves them
    mixer.in_proj, mixer.out_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 8, bias=False)
    mixer.conv1d = nn.Conv1d(8, 8, 4, groups=8, padding=3)
    rewrite_mixer(mixer)
    assert (mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.intermediate_size) == (2, 4, 8)
    assert mixer_config(mixer, mixer.config) == {"mamba_expand": 1, "n_mamba_heads": 2}
