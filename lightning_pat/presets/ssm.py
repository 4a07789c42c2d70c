"""Mamba-style state-space mixers: their exact units, found by structure (:func:`mixers`).

A mixer (:func:`~lightning_pat.shrink.mixers.mixer_kind`: ``A_log`` and ``D`` of its own, ``in_proj``, a depthwise
``conv1d``, ``out_proj``) has one cluster, ``<mixer>.inner``:

* Mamba 1 (Mamba, Falcon-Mamba, Jamba): one unit per inner channel: its rows of both halves of ``in_proj`` (``x``
  and the gate ``z``), its conv channel, its ``dt_proj`` row and bias, its ``A_log`` and ``D`` rows (writers), and
  its columns of ``x_proj`` and ``out_proj`` (readers). A dropped channel's ``x`` is zero after the conv, so its
  state and output stay zero: the cut is exact. The config's ``expand`` holds the new width when it is a whole
  multiple of the hidden size (else the stock-config probe drops the cut);
* Mamba 2 (Mamba2, Nemotron-H, Bamba, Zamba2, Falcon-H1, GraniteMoE-hybrid): one unit per group of
  ``n_groups`` (the gated norm normalises over a group, so a group is the smallest exact unit): its heads' ``z``,
  ``x`` and ``dt`` rows of ``in_proj``, its ``B`` and ``C`` rows and conv channels, its heads' ``dt_bias``,
  ``A_log``, ``D`` and norm weights, and its ``out_proj`` columns. A mixer with one group and a norm has no exact
  unit (the norm spans every head); one without a norm (Falcon-H1's default ``mamba_rms_norm=False``) and one group
  has one unit per head: its ``z``, ``x`` and ``dt`` rows, conv channels, ``dt_bias``/``A_log``/``D`` and
  ``out_proj`` columns (``B`` and ``C`` serve every head and stay).

``clusters="auto"`` adds these to the clusters it discovers by tracing (tracing sees neither the scan nor the
mixer's own parameters: :func:`lightning_pat.discovery.entry.with_experts`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch import nn

from lightning_pat.core.spec import Cluster
from lightning_pat.shrink.layer_config import config_value
from lightning_pat.shrink.mixers import EXPAND_FIELDS, has_norm, mamba2_layout, mixer_kind

log = logging.getLogger(__name__)


def _config_multiple(model: nn.Module, per_unit: int) -> int:
    """The kept-unit multiple a config holding the inner width as ``expand * hidden`` (an int) can express.

    1 where the config holds the width itself (Falcon-H1's ``mamba_d_ssm``) or has no expand field.
    """
    config = next((c for m in model.modules() if (c := getattr(m, "config", None)) is not None), None)
    hidden = config_value(config, "hidden_size")
    expand = [config_value(config, f) for f in EXPAND_FIELDS]
    if isinstance(config_value(config, "mamba_d_ssm"), int) or not isinstance(hidden, int) or hidden <= 0:
        return 1
    if not any(isinstance(e, int) and not isinstance(e, bool) for e in expand):
        return 1
    return hidden // math.gcd(hidden, per_unit)


def _mamba(prefix: str, m: Any, multiple: int) -> Cluster:
    inner = int(m.D.shape[0])
    halves = [f"{prefix}in_proj.weight[{i}/2]" for i in range(2)]
    if m.in_proj.bias is not None:
        halves += [f"{prefix}in_proj.bias[{i}/2]" for i in range(2)]
    conv = [f"{prefix}conv1d.{p}" for p, t in m.conv1d.named_parameters(recurse=False) if t is not None]
    dt = [f"{prefix}dt_proj.{p}" for p, _ in m.dt_proj.named_parameters(recurse=False)]
    return Cluster(
        name=f"{prefix}inner",
        writers=[*halves, *conv, *dt, f"{prefix}A_log", f"{prefix}D"],
        readers=[f"{prefix}x_proj.weight", f"{prefix}out_proj.weight"],
        num_units=inner,
        multiple_of=multiple,
    )


def _mamba2(prefix: str, m: Any, model: nn.Module) -> Cluster | None:
    layout = mamba2_layout(m)
    if layout is None:
        return None
    inner, heads, head_dim, groups, state = layout
    normed = has_norm(m)
    if normed and groups < 2 or not normed and groups != 1:
        return None
    bc = groups * state
    dt = (2 * inner + 2 * bc, 2 * inner + 2 * bc + heads)
    if normed:  # whole groups: their heads' rows, their B and C rows
        rows = [(0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + bc), (2 * inner + bc, 2 * inner + 2 * bc), dt]
        channels = [(0, inner), (inner, inner + bc), (inner + bc, inner + 2 * bc)]
    else:  # heads: their z, x and dt rows (B and C are every head's)
        rows, channels = [(0, inner), (inner, 2 * inner), dt], [(0, inner)]
    proj = [f"{prefix}in_proj.{p}" for p, _ in m.in_proj.named_parameters(recurse=False)]
    conv = [f"{prefix}conv1d.{p}" for p, _ in m.conv1d.named_parameters(recurse=False)]
    return Cluster(
        name=f"{prefix}inner",
        writers=[
            *(f"{p}[{a}:{b}]" for p in proj for a, b in rows),
            *(f"{p}[{a}:{b}]" for p in conv for a, b in channels),
            f"{prefix}dt_bias",
            f"{prefix}A_log",
            f"{prefix}D",
            *([f"{prefix}norm.weight"] if normed else []),
        ],
        readers=[f"{prefix}out_proj.weight"],
        num_units=groups if normed else heads,
        multiple_of=_config_multiple(model, inner // groups if normed else head_dim),
    )


def mixers(model: nn.Module) -> list[Cluster]:
    """One cluster per state-space mixer of ``model`` that has an exact unit (see the module's docs).

    Args:
        model: Any module; its Mamba-style mixers are found by structure.

    Returns:
        The clusters, in module order (empty if the model holds no such mixer).
    """
    out: list[Cluster] = []
    for name, module in model.named_modules():
        kind = mixer_kind(module)
        prefix = f"{name}." if name else ""  # the names below are relative to the mixer
        if kind == "mamba_mixer":
            out.append(_mamba(prefix, module, _config_multiple(model, 1)))
        elif kind == "mamba2_mixer":
            cluster = _mamba2(prefix, module, model)
            if cluster is None:
                log.info("presets.mixers: %s (Mamba 2) has one group or an unknown layout; its heads are not cut", name)
            else:
                out.append(cluster)
    return out
