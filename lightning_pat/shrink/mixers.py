"""Mamba-style state-space mixers: their own per-channel parameters, their size attributes and config fields.

Found by structure (:func:`mixer_kind`), not by family name: a module holding ``A_log`` and ``D`` itself, with an
``in_proj`` and ``out_proj`` ``nn.Linear`` and a depthwise ``conv1d``:

* ``"mamba_mixer"`` (Mamba 1: Mamba, Falcon-Mamba, Jamba): ``A_log`` is ``[inner, state]``, ``D`` ``[inner]``, with
  ``x_proj`` and ``dt_proj``; an inner channel is one exact unit (its ``x`` and ``z`` rows of ``in_proj``, its conv
  channel, ``dt_proj`` row, ``A_log``/``D`` rows, its ``x_proj`` and ``out_proj`` columns). The mixer's
  ``intermediate_size`` follows, and the config's ``expand`` / ``mamba_expand`` (with Mamba's derived
  ``intermediate_size``) where the new width is a whole multiple of the hidden size;
* ``"mamba2_mixer"`` (Mamba 2: Mamba2, Nemotron-H, Bamba, Zamba2, Falcon-H1, GraniteMoE-hybrid): ``A_log``, ``D``
  and ``dt_bias`` are ``[heads]``; the gated norm normalises over each of ``n_groups`` groups, so a whole group (its
  heads' ``x``/``z``/``dt`` rows, its ``B``/``C`` rows and conv channels, its norm weights and ``out_proj``
  columns) is the exact unit; without a norm (Falcon-H1's default), a head is. ``num_heads``, ``n_groups``,
  ``intermediate_size`` and ``conv_dim`` follow, and the config's head, group, expand and ``mamba_d_ssm`` fields.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pat.shrink.layer_config import config_value, has_field

#: (kind, attribute) -> the dims of a mixer's own parameters that may be cut.
MIXER_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("mamba_mixer", "A_log"): (0,),
    ("mamba_mixer", "D"): (0,),
    ("mamba2_mixer", "A_log"): (0,),
    ("mamba2_mixer", "D"): (0,),
    ("mamba2_mixer", "dt_bias"): (0,),
}
#: The kinds this module rewrites.
MIXER_KINDS: frozenset[str] = frozenset(kind for kind, _ in MIXER_DIMS)
#: Config fields of a Mamba 2 mixer's head count, group count, and of the expand factor (inner = expand * hidden).
HEAD_FIELDS = ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
GROUP_FIELDS = ("n_groups", "mamba_n_groups", "mamba_ngroups")
EXPAND_FIELDS = ("expand", "mamba_expand")


def mixer_kind(module: nn.Module) -> str | None:
    """``"mamba_mixer"``, ``"mamba2_mixer"`` (see the module's docs) or ``None``."""
    own = module._parameters  # noqa: SLF001 - the module's own parameters, not its children's
    a_log, d = own.get("A_log"), own.get("D")
    conv = getattr(module, "conv1d", None)
    linear = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("in_proj", "out_proj"))
    if a_log is None or d is None or d.dim() != 1 or not linear or not isinstance(conv, nn.Conv1d):
        return None
    if conv.groups != conv.in_channels or conv.groups != conv.out_channels:
        return None
    one = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("x_proj", "dt_proj"))
    if one and a_log.dim() == 2 and a_log.shape[0] == d.shape[0] == conv.in_channels:
        return "mamba_mixer"
    if a_log.dim() == 1 and a_log.shape == d.shape and isinstance(own.get("dt_bias"), nn.Parameter):
        return "mamba2_mixer"
    return None


def has_norm(module: nn.Module) -> bool:
    """Whether a Mamba 2 mixer gates through a norm with a weight (Falcon-H1's is optional: ``mamba_rms_norm``)."""
    return isinstance(getattr(getattr(module, "norm", None), "weight", None), Tensor)


def mamba2_layout(module: nn.Module) -> tuple[int, int, int, int, int] | None:
    """``(inner, heads, head_dim, groups, state)`` of a Mamba 2 mixer whose ``in_proj`` is ``[z, x, B, C, dt]``.

    ``None`` where the sizes do not add up (an extra MLP part of ``in_proj``, a norm that is not per group).
    """
    m: Any = module
    sizes = [getattr(m, a, None) for a in ("intermediate_size", "num_heads", "head_dim", "n_groups", "ssm_state_size")]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        return None
    inner, heads, head_dim, groups, state = cast("list[int]", sizes)
    if has_norm(module):
        norm = m.norm
        grouped = getattr(norm, "group_size", None) == inner // groups or groups == 1
        if tuple(norm.weight.shape) != (inner,) or not grouped:
            return None
    if (
        inner != heads * head_dim
        or heads % groups
        or m.in_proj.out_features != 2 * inner + 2 * groups * state + heads
        or m.conv1d.in_channels != inner + 2 * groups * state
    ):
        return None
    return inner, heads, head_dim, groups, state


def rewrite_mixer(module: nn.Module) -> None:
    """A mixer's size attributes after its parameters were cut (see the module's docs).

    A Mamba 2 mixer with a norm loses whole groups with their heads; one without (Falcon-H1's default) loses heads
    and keeps its groups. A per-row buffer over ``in_proj``'s parts that is constant on each part (Falcon-H1's
    ``mup_vector``, rebuilt from the config on load) is rebuilt with the new part sizes.
    """
    m: Any = module
    kind = mixer_kind(module)
    if kind == "mamba_mixer":
        m.intermediate_size = int(m.D.shape[0])
        return
    heads, old_heads, old_groups = int(m.D.shape[0]), int(m.num_heads), int(m.n_groups)
    old = (m.intermediate_size, m.intermediate_size, old_groups * m.ssm_state_size, old_groups * m.ssm_state_size)
    if has_norm(module):
        m.n_groups = old_groups * heads // old_heads
    m.num_heads = heads
    m.intermediate_size = heads * m.head_dim
    m.conv_dim = m.intermediate_size + 2 * m.n_groups * m.ssm_state_size
    bc = m.n_groups * m.ssm_state_size
    _rebuild_parts(m, "mup_vector", (*old, old_heads), (m.intermediate_size, m.intermediate_size, bc, bc, heads))


def _rebuild_parts(module: nn.Module, name: str, old: tuple[int, ...], new: tuple[int, ...]) -> None:
    """Buffer ``name`` (last dim: the parts ``old``, each constant) rebuilt with the part sizes ``new``."""
    buf = module._buffers.get(name)  # noqa: SLF001 - the module's own buffer
    if buf is None or buf.shape[-1] != sum(old):
        return
    parts = torch.split(buf, list(old), dim=-1)
    if not buf.is_meta and not all(bool((p == p[..., :1]).all()) for p in parts if p.shape[-1]):
        raise ValueError(
            f"Shrink: buffer {name!r} of {type(module).__name__} is not constant on each part of in_proj's rows; "
            "its rows cannot be rebuilt for the new sizes. Leave this mixer out of the clusters."
        )
    module._buffers[name] = torch.cat(
        [p[..., :1].expand(*p.shape[:-1], n) for p, n in zip(parts, new, strict=True)], -1
    )  # noqa: SLF001


def mixer_config(model: nn.Module, config: Any) -> dict[str, int]:
    """The config fields of the model's mixers with their new values (uniform across layers; else left out)."""
    hidden = config_value(config, "hidden_size")
    ones = [m for m in model.modules() if mixer_kind(m) == "mamba_mixer"]
    twos = [m for m in model.modules() if mixer_kind(m) == "mamba2_mixer"]
    out: dict[str, int] = {}
    inners = {int(cast(Any, m).intermediate_size) for m in ones + twos}
    if len(inners) == 1 and isinstance(hidden, int) and hidden > 0:
        inner = inners.pop()
        for field in EXPAND_FIELDS:
            old = config_value(config, field)
            if isinstance(old, (int, float)) and not isinstance(old, bool) and inner % hidden == 0:
                out[field] = inner // hidden
        old_inner = config_value(config, "intermediate_size")
        expand = config_value(config, "expand")
        if ones and isinstance(expand, (int, float)) and old_inner == int(expand * hidden):
            out["intermediate_size"] = inner  # Mamba, Falcon-Mamba: derived from expand, read by the cache
        if isinstance(config_value(config, "mamba_d_ssm"), int):
            out["mamba_d_ssm"] = inner  # Falcon-H1
    heads = {int(cast(Any, m).num_heads) for m in twos}
    groups = {int(cast(Any, m).n_groups) for m in twos}
    if len(heads) == 1 and len(groups) == 1:
        head_count, group_count = heads.pop(), groups.pop()
        fields = [*HEAD_FIELDS, *(("num_heads",) if not has_field(config, "num_attention_heads") else ())]
        out.update((f, head_count) for f in fields if isinstance(config_value(config, f), int))
        out.update((f, group_count) for f in GROUP_FIELDS if isinstance(config_value(config, f), int))
    return out
