"""Attention checks of the shrink: an attention module must lose whole heads (or whole query groups), consistently.

Attention modules (``q/k/v/o_proj`` with ``head_dim``; GPT-2's packed ``c_attn``) are checked to lose whole heads /
whole query groups; ``nn.MultiheadAttention``, torchvision's Swin V1 and V2 window attention and MaxViT's attention
are checked the same way, every per-head part included (the surgery then replaces them by modules of
:mod:`lightning_pat.heads.replace`). Called by :func:`lightning_pat.shrink.edits.validate` before anything
changes; nothing here changes a module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_pat.heads import HeadsMultiheadAttention
from lightning_pat.shrink.cuts import Edit
from lightning_pat.shrink.model_meta import has_sinks, is_gpt2_attention, is_llama_attention, module_kind

#: Module kinds the surgery replaces by a module of ours (the model itself cannot be one).
_REPLACED = ("mha", "window_attention", "window_attention_v2", "maxvit_attention")


def _linear(module: nn.Module, name: str) -> nn.Linear:
    """``module``'s part ``name``, an ``nn.Linear`` (the kind checks of :func:`check_attention` made sure of it)."""
    return cast(nn.Linear, getattr(module, name))


def _kept(edits: Mapping[int, Edit], module: nn.Module, attr: str, dim: int, length: int) -> Tensor:
    edit = edits.get(id(module))
    idx = None if edit is None else edit.cuts.get(attr, {}).get(dim)
    return torch.arange(length) if idx is None else idx.cpu()


def _whole_heads(kept: Tensor, head_dim: int, where: str) -> Tensor:
    """Kept head indices, if ``kept`` channels form whole heads; else a ``ValueError``."""
    if kept.numel() % head_dim:
        raise ValueError(f"{where}: {kept.numel()} kept channels are not whole heads of head_dim {head_dim}.")
    blocks = kept.view(-1, head_dim)
    heads = blocks[:, 0] // head_dim
    if not torch.equal(blocks, heads[:, None] * head_dim + torch.arange(head_dim)):
        raise ValueError(f"{where}: the kept channels split heads of head_dim {head_dim}.")
    return heads


def _check_llama_attention(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    hd = cast(int, attn.head_dim)
    q, k, v, o = (_linear(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    fix = (
        "prune attention with a heads cluster (whole heads / whole GQA query groups: q, k, v rows and o columns; or "
        "GQA query heads: q rows and o columns, the same number in every KV group)"
    )
    # a gated q_proj (Qwen3.5, Qwen4-exp) holds each head's query and gate rows, 2 * head_dim, side by side
    gated = q.out_features == 2 * o.in_features
    q_rows = 2 * hd if gated else hd
    try:
        q_heads = _whole_heads(_kept(edits, q, "weight", 0, q.out_features), q_rows, f"{where}, q_proj rows")
        k_heads = _whole_heads(_kept(edits, k, "weight", 0, k.out_features), hd, f"{where}, k_proj rows")
        v_heads = _whole_heads(_kept(edits, v, "weight", 0, v.out_features), hd, f"{where}, v_proj rows")
        o_heads = _whole_heads(_kept(edits, o, "weight", 1, o.in_features), hd, f"{where}, o_proj columns")
    except ValueError as err:
        raise ValueError(f"{err} {fix[0].upper()}{fix[1:]}.") from err
    if q_heads.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0 (a per-cluster `target`), or fewer units in a shared budget."
        )
    if has_sinks(attn):  # gpt-oss: one sink logit per query head, kept with its head
        sinks = _kept(edits, attn, "sinks", 0, q.out_features // q_rows)
        if not torch.equal(sinks, q_heads):
            raise ValueError(
                f"{where}: the attention holds one sink logit per query head, and keeps sinks {sinks.tolist()} for "
                f"query heads {q_heads.tolist()}; put `sinks` in the heads cluster (presets.moe does)."
            )
    num_kv = k.out_features // hd
    n_rep = (q.out_features // q_rows) // num_kv
    if torch.equal(q_heads, o_heads) and k_heads.numel() == v_heads.numel() == num_kv:
        per_group = torch.bincount(q_heads // n_rep, minlength=num_kv)  # query heads inside the KV groups
        if bool((per_group == per_group[0]).all()):
            return
        raise ValueError(
            f"{where}: kept query heads {q_heads.tolist()} keep {per_group.tolist()} heads of the {num_kv} KV groups "
            f"(n_rep={n_rep}); a Llama attention needs the same number in every group. Select query heads with "
            "`unit_groups` set to the KV head count (the presets' query-head units do)."
        )
    groups = (q_heads // n_rep).unique_consecutive()  # type: ignore[no-untyped-call]  # unannotated in torch
    expected_q = (groups[:, None] * n_rep + torch.arange(n_rep)).flatten()
    if not (torch.equal(q_heads, o_heads) and torch.equal(k_heads, v_heads)) or not (
        torch.equal(q_heads, expected_q) and torch.equal(groups, k_heads)
    ):
        raise ValueError(
            f"{where}: kept query heads {q_heads.tolist()}, o heads {o_heads.tolist()}, kv heads k "
            f"{k_heads.tolist()} / v {v_heads.tolist()} do not keep whole query groups (n_rep={n_rep}); {fix}."
        )


def _check_gpt2_attention(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    if hasattr(attn, "q_attn"):
        if id(attn.c_attn) in edits or id(attn.q_attn) in edits or id(attn.c_proj) in edits:
            raise ValueError(f"{where}: cross-attention cannot be shrunk; exclude its parameters from the clusters.")
        return
    gpt2: Any = attn  # transformers' GPT2Attention: its Conv1D parts (nf, nx) are not a type the shrink imports
    if not isinstance(getattr(gpt2, "head_dim", None), int):
        if _kept(edits, gpt2.c_attn, "weight", 1, gpt2.c_attn.nf).numel() != gpt2.c_attn.nf:
            raise ValueError(
                f"{where}: holds no `head_dim` (GPT-1's attention splits `n_embd` by its head count), so it cannot "
                "lose heads; leave its c_attn/c_proj heads out of the clusters (the MLP can still be cut)."
            )
        return
    hd, width = gpt2.head_dim, gpt2.c_attn.nf // 3
    kept = _kept(edits, gpt2.c_attn, "weight", 1, gpt2.c_attn.nf)
    chunks = [kept[(kept >= i * width) & (kept < (i + 1) * width)] - i * width for i in range(3)]
    heads = [_whole_heads(c, hd, f"{where}, c_attn chunk {i}") for i, c in enumerate(chunks)]
    o_heads = _whole_heads(_kept(edits, gpt2.c_proj, "weight", 0, gpt2.c_proj.nx), hd, f"{where}, c_proj rows")
    if o_heads.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0."
        )
    if not all(torch.equal(h, o_heads) for h in heads):
        raise ValueError(
            f"{where}: the q, k, v chunks of c_attn and the c_proj rows keep different heads "
            f"({[h.tolist() for h in heads]} vs {o_heads.tolist()}); prune them with one heads cluster."
        )


def _same_heads(where: str, heads: Mapping[str, Tensor]) -> None:
    """Every part must keep the same heads, and at least one."""
    first = next(iter(heads.values()))
    if first.numel() == 0:
        raise ValueError(
            f"{where}: every head would be dropped, and an attention module with no heads cannot run; prune this "
            "layer's heads with a target below 1.0."
        )
    if not all(torch.equal(h, first) for h in heads.values()):
        shown = ", ".join(f"{k} {v.tolist()}" for k, v in heads.items())
        raise ValueError(f"{where}: the parts keep different heads ({shown}); prune them with one heads cluster.")


def _qkv_heads(kept: Tensor, inner: int, head_dim: int, where: str) -> dict[str, Tensor]:
    chunks = {p: kept[(kept >= i * inner) & (kept < (i + 1) * inner)] - i * inner for i, p in enumerate("qkv")}
    return {f"{p} rows": _whole_heads(c, head_dim, f"{where}, {p} rows") for p, c in chunks.items()}


def _check_mha(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    """An ``nn.MultiheadAttention`` (or ours) must lose whole heads, the same in q, k, v rows and out_proj columns."""
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    mha = cast("nn.MultiheadAttention | HeadsMultiheadAttention", attn)  # module_kind "mha"
    hd, rows = int(mha.head_dim), mha.in_proj_weight.shape[0]
    heads = _qkv_heads(_kept(edits, mha, "in_proj_weight", 0, rows), rows // 3, hd, where)
    cols = _kept(edits, mha.out_proj, "weight", 1, mha.out_proj.in_features)
    heads["out_proj columns"] = _whole_heads(cols, hd, f"{where}, out_proj columns")
    _same_heads(where, heads)


def _packed_heads(
    name: str, attn: nn.Module, qkv: nn.Linear, out: nn.Linear, out_name: str, num_heads: int,
    edits: Mapping[int, Edit],
) -> tuple[str, dict[str, Tensor]]:  # fmt: skip
    """The error prefix and the kept heads of a packed ``qkv`` Linear's q, k, v rows and its output Linear's columns.

    Shared by the window (Swin V1/V2) and MaxViT checks, which add their per-head parts before :func:`_same_heads`.
    """
    where = f"Shrink: attention {name!r} ({type(attn).__name__})"
    inner = out.in_features
    hd = inner // num_heads
    heads = _qkv_heads(_kept(edits, qkv, "weight", 0, qkv.out_features), inner, hd, where)
    heads[f"{out_name} columns"] = _whole_heads(
        _kept(edits, out, "weight", 1, inner), hd, f"{where}, {out_name} columns"
    )
    return where, heads


def _check_window_attention(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Swin's window attention: whole heads of qkv rows, proj columns and the bias table's columns, the same."""
    num_heads = int(cast(Tensor, attn.relative_position_bias_table).shape[1])
    where, heads = _packed_heads(name, attn, _linear(attn, "qkv"), _linear(attn, "proj"), "proj", num_heads, edits)
    heads["relative_position_bias_table columns"] = _kept(edits, attn, "relative_position_bias_table", 1, num_heads)
    _same_heads(where, heads)


def _check_window_attention_v2(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Swin V2's window attention: whole heads of qkv rows and proj columns, ``logit_scale``, ``cpb_mlp``'s last rows.

    The kept heads must be the same in every part: q, k and v rows of ``qkv``, ``proj`` columns, the entries of
    ``logit_scale`` and the rows of ``cpb_mlp``'s last ``Linear`` (its columns, the hidden units, are free).
    """
    num_heads = int(cast(Tensor, attn.logit_scale).shape[0])
    where, heads = _packed_heads(name, attn, _linear(attn, "qkv"), _linear(attn, "proj"), "proj", num_heads, edits)
    heads["logit_scale entries"] = _kept(edits, attn, "logit_scale", 0, num_heads)
    cpb_mlp = cast(nn.Sequential, attn.cpb_mlp)
    last = cast(nn.Linear, cpb_mlp[-1])
    heads[f"cpb_mlp.{len(cpb_mlp) - 1} rows"] = _kept(edits, last, "weight", 0, last.out_features)
    _same_heads(where, heads)


def _check_maxvit_attention(name: str, attn: nn.Module, edits: Mapping[int, Edit]) -> None:
    """MaxViT's attention: whole heads of to_qkv rows, merge columns and the bias table's columns, the same."""
    num_heads = int(cast(Tensor, attn.relative_position_bias_table).shape[1])
    where, heads = _packed_heads(name, attn, _linear(attn, "to_qkv"), _linear(attn, "merge"), "merge", num_heads, edits)
    heads["relative_position_bias_table columns"] = _kept(edits, attn, "relative_position_bias_table", 1, num_heads)
    _same_heads(where, heads)


def check_attention(model: nn.Module, edits: Mapping[int, Edit]) -> None:
    """Check every attention module the edits touch: whole heads / whole query groups, the same in every part.

    Args:
        model: The model being shrunk.
        edits: Module id -> its edit (see :func:`lightning_pat.shrink.edits.validate`).

    Raises:
        ValueError: Naming the attention module, what its parts keep and the fix.
    """
    for name, module in model.named_modules():
        kind = module_kind(module)
        if not name and kind in _REPLACED and id(module) in edits:
            raise ValueError(
                f"Shrink: the model itself is a {type(module).__name__}, whose heads are cut by putting another "
                "module in its place; wrap it in a container module to shrink it."
            )
        if kind == "mha" and (id(module) in edits or id(module.out_proj) in edits):
            _check_mha(name, module, edits)
        elif kind == "window_attention" and any(id(m) in edits for m in (module, module.qkv, module.proj)):
            _check_window_attention(name, module, edits)
        elif kind == "window_attention_v2" and any(
            id(m) in edits for m in (module, module.qkv, module.proj, cast(nn.Sequential, module.cpb_mlp)[-1])
        ):
            _check_window_attention_v2(name, module, edits)
        elif kind == "maxvit_attention" and any(id(m) in edits for m in (module, module.to_qkv, module.merge)):
            _check_maxvit_attention(name, module, edits)
        if is_llama_attention(module):
            parts = (module, module.q_proj, module.k_proj, module.v_proj, module.o_proj)  # the module: its sinks
            if any(id(p) in edits for p in parts):
                _check_llama_attention(name, module, edits)
        elif is_gpt2_attention(module) and (id(module.c_attn) in edits or id(module.c_proj) in edits):
            _check_gpt2_attention(name, module, edits)
