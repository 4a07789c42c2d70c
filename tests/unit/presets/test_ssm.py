"""The exact units of Mamba-style mixers: a Mamba 2 group's rows of every packed part of ``in_proj``."""

from __future__ import annotations

from lightning_pat.core.spec import resolve_clusters
from lightning_pat.presets.ssm import mixers
from lightning_pat.shrink.plan import build_plan
from tests.common.tiny_families import zamba_mixer
from tests.unit.shrink.test_mixers import Mixer2


def test_a_mamba2_group_is_its_heads_z_x_dt_rows_its_b_c_rows_and_its_norm():
    model = Mixer2(heads=4, head_dim=2, groups=2, state=3)
    (cluster,) = mixers(model)
    (rc,) = resolve_clusters(model, [cluster])
    assert rc.num_units == 2
    keep = build_plan([rc], {rc.name: [0]}).keep  # group 1 (heads 2, 3) kept
    # in_proj rows [z 0:8 | x 8:16 | B 16:22 | C 22:28 | dt 28:32], written out by hand
    assert keep["in_proj.weight"][0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 19, 20, 21, 25, 26, 27, 30, 31]
    assert keep["conv1d.weight"][0].tolist() == [4, 5, 6, 7, 11, 12, 13, 17, 18, 19]
    assert keep["A_log"][0].tolist() == keep["D"][0].tolist() == keep["dt_bias"][0].tolist() == [2, 3]
    assert keep["norm.weight"][0].tolist() == keep["out_proj.weight"][1].tolist() == [4, 5, 6, 7]


def test_one_group_has_no_exact_unit_under_a_norm_and_one_per_head_without():
    assert mixers(Mixer2(groups=1)) == []
    model = Mixer2(heads=4, head_dim=2, groups=1, state=3, norm=False)
    (rc,) = resolve_clusters(model, mixers(model))
    keep = build_plan([rc], {rc.name: [1]}).keep  # head 1 dropped
    # in_proj rows [z 0:8 | x 8:16 | B 16:19 | C 19:22 | dt 22:26]: B and C serve every head
    assert keep["in_proj.weight"][0].tolist() == [0, 1, 4, 5, 6, 7, 8, 9, *range(12, 22), 22, 24, 25]
    assert keep["conv1d.weight"][0].tolist() == [0, 1, 4, 5, 6, 7, *range(8, 14)]
    assert keep["out_proj.weight"][1].tolist() == [0, 1, 4, 5, 6, 7]


def test_a_zamba_head_is_its_interleaved_x_and_gate_rows_and_its_per_head_parameters():
    model = zamba_mixer()
    (cluster,) = mixers(model)
    assert (cluster.num_units, cluster.multiple_of) == (4, 2)  # heads of 4 channels: 2 heads make one hidden
    (rc,) = resolve_clusters(model, [cluster])
    keep = build_plan([rc], {rc.name: [1]}).keep  # head 1 (channels 4:8) dropped
    # in_proj rows 2c (x) and 2c + 1 (gate) of each channel c, written out by hand
    assert keep["in_proj.weight"][0].tolist() == [*range(0, 8), *range(16, 32)]
    assert keep["conv1d.weight"][0].tolist() == keep["out_proj.weight"][1].tolist() == [0, 1, 2, 3, *range(8, 16)]
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
        assert keep[name][0].tolist() == [0, 2, 3]
