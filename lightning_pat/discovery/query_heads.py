"""GQA query heads inside their KV groups, for the whole query groups the trace found in a transformers attention.

The walk (:mod:`lightning_pat.discovery.attention`) proves a whole query group exact: one KV head and its ``n_rep``
query heads. A finer unit, one query head (its ``q_proj`` rows and bias and its output projection's columns;
``k/v_proj`` kept whole), is exact too when nothing inside the group mixes its query heads: a dropped query head's
query is zero, so it attends uniformly and returns the mean of its values, which its zero output columns ignore. The
trace cannot tell that apart from an op mixing the heads of one group (the group is one unit for it), so this
refinement is applied only where the attention module is a Hugging Face one (a class defined in
``transformers.models``) of the Llama layout (``nn.Linear`` ``q/k/v_proj`` and an output projection, ``o_proj`` or
Phi's ``dense``; an int ``head_dim`` and ``num_key_value_groups``): their attention functions compute every query
head on its own, and the shrink rewrites their head counts, so that every KV group must keep the same number of
query heads (``unit_groups`` = the KV head count). A gated ``q_proj`` (Qwen3.5, Qwen4-exp: each head's query and
gate rows side by side, ``2 * head_dim``) is refined the same way: a dropped head's query and gate are zero.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from lightning_pat.core.spec import Cluster


def _attention(model: nn.Module, cluster: Cluster) -> tuple[str, nn.Module] | None:
    """The transformers attention module whose whole query groups ``cluster`` is, or ``None``.

    The output projection is the cluster's one reader, an ``nn.Linear`` child of the attention module reading the
    query width, whatever its name (``o_proj``; Phi's ``dense``).
    """
    if not cluster.writers or not cluster.writers[0].endswith(".q_proj.weight"):
        return None
    path = cluster.writers[0][: -len(".q_proj.weight")]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    projections = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, nn.Linear) for p in projections) or not type(module).__module__.startswith(
        "transformers.models."
    ):
        return None
    if not all(isinstance(getattr(module, a, None), int) for a in ("head_dim", "num_key_value_groups")):
        return None
    expected = {f"{path}.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")}
    found = set(cluster.writers)
    if not {f"{path}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")} <= found <= expected:
        return None
    if (
        len(cluster.readers) != 1
        or not cluster.readers[0].startswith(f"{path}.")
        or "." in (out_name := cluster.readers[0][len(path) + 1 :].removesuffix(".weight"))
    ):
        return None
    out = getattr(module, out_name, None)
    q_rows = cast(nn.Linear, projections[0]).out_features  # a gated q_proj: a query and a gate per head (Qwen3.5)
    if not isinstance(out, nn.Linear) or q_rows not in (out.in_features, 2 * out.in_features):
        return None
    return path, module


def _fused(model: nn.Module, cluster: Cluster) -> Cluster | None:
    """The query-head cluster of a whole-query-group ``cluster`` of a transformers fused-QKV GQA attention, or ``None``.

    Phi-3's ``qkv_proj`` (q, k and v rows side by side, sliced apart in the forward) with ``o_proj``: the cluster's
    writers are the three slices of ``qkv_proj`` (and of its bias), one unit per KV head; the query heads are the
    first slice's rows (``num_attention_heads * head_dim``), one unit per query head, ``unit_groups`` = the KV heads.
    """
    first = cluster.writers[0] if cluster.writers else ""
    path = first.split(".qkv_proj.weight[")[0]
    if ".qkv_proj.weight[" not in first or cluster.readers != [f"{path}.o_proj.weight"]:
        return None
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    qkv, o_proj = getattr(module, "qkv_proj", None), getattr(module, "o_proj", None)
    head_dim, n_rep = getattr(module, "head_dim", None), getattr(module, "num_key_value_groups", None)
    if not isinstance(qkv, nn.Linear) or not isinstance(o_proj, nn.Linear) or not isinstance(head_dim, int):
        return None
    if not isinstance(n_rep, int) or n_rep < 2 or not type(module).__module__.startswith("transformers.models."):
        return None
    q_rows = o_proj.in_features
    num_kv = (qkv.out_features - q_rows) // (2 * head_dim)
    if cluster.num_units != num_kv or q_rows != num_kv * n_rep * head_dim:
        return None
    edges = [0, q_rows, q_rows + num_kv * head_dim, qkv.out_features]
    parts = [f"[{lo}:{hi}]" for lo, hi in zip(edges, edges[1:], strict=False)]
    expected = {f"{path}.qkv_proj.{kind}{part}" for kind in ("weight", "bias") for part in parts}
    if not {f"{path}.qkv_proj.weight{part}" for part in parts} <= set(cluster.writers) <= expected:
        return None
    writers = [w for w in cluster.writers if w.endswith(parts[0])]
    return Cluster(name=cluster.name, writers=writers, readers=list(cluster.readers), num_units=num_kv * n_rep,
                   unit_groups=num_kv)  # fmt: skip


def refine_query_heads(model: nn.Module, clusters: list[Cluster]) -> list[Cluster]:
    """Replace each whole-query-group cluster of a transformers GQA attention by its query-head cluster.

    Args:
        model: The traced model.
        clusters: The clusters found (whole channel axes, explicit ``num_units``).

    Returns:
        The clusters, those of GQA attention modules (``num_key_value_groups > 1``, one unit per KV head) replaced
        by ``q_proj`` rows (and bias) and ``o_proj`` columns with one unit per query head and ``unit_groups`` = the
        KV head count (a fused ``qkv_proj``: its query rows, :func:`_fused`); the others unchanged.
    """
    out = []
    for cluster in clusters:
        if (fused := _fused(model, cluster)) is not None:
            out.append(fused)
            continue
        found = _attention(model, cluster)
        if found is None:
            out.append(cluster)
            continue
        path, module = found
        q_proj, k_proj = cast(nn.Linear, module.q_proj), cast(nn.Linear, module.k_proj)  # checked by _attention
        head_dim = cast(int, module.head_dim)
        num_kv = k_proj.out_features // head_dim
        n_rep = cast(int, module.num_key_value_groups)
        per_head = (1, 2) if q_proj.out_features % (num_kv * n_rep * head_dim) == 0 else ()
        if (
            n_rep < 2
            or cluster.num_units != num_kv
            or q_proj.out_features // (num_kv * n_rep * head_dim) not in per_head
        ):
            out.append(cluster)
            continue
        writers = [w for w in cluster.writers if w.startswith(f"{path}.q_proj.")]
        out.append(
            Cluster(
                name=cluster.name,
                writers=writers,
                readers=list(cluster.readers),
                num_units=num_kv * n_rep,
                unit_groups=num_kv,
            )  # fmt: skip
        )
    return out
