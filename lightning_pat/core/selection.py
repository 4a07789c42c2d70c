"""Deterministic unit selection (pure torch).

Lowest score first; equal scores drop the lowest index first (stable sort), so the result is a pure function of
the scores and identical on every rank that holds bitwise-identical scores.

Legend: ``C`` units of one cluster, ``T`` units over all clusters of a shared budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def num_to_drop(target: float, num_units: int, *, multiple_of: int = 1) -> int:
    """How many of ``num_units`` units to drop for ``target`` sparsity.

    ``ceil(target * num_units)`` (robust to float noise such as ``0.3 * 10``); when anything is dropped, the kept
    count is rounded down to a multiple of ``multiple_of``.

    Raises:
        ValueError: If ``target`` is outside ``[0, 1]`` or ``multiple_of`` < 1.

    Example::

        >>> num_to_drop(0.3, 10), num_to_drop(0.3, 10, multiple_of=4), num_to_drop(0.0, 10, multiple_of=4)
        (3, 6, 0)
    """
    if not 0.0 <= target <= 1.0 or math.isnan(target):
        raise ValueError(f"`target` must be in [0, 1], got {target!r}.")
    if multiple_of < 1:
        raise ValueError(f"`multiple_of` must be >= 1, got {multiple_of!r}.")
    drop = min(num_units, math.ceil(round(target * num_units, 9)))
    if drop == 0:
        return 0
    keep = (num_units - drop) // multiple_of * multiple_of
    return num_units - keep


def check_finite(scores: Tensor, what: str) -> None:
    """Reject NaN/Inf scores with an error that starts with ``what`` (the cluster or budget).

    Raises:
        ValueError: If any score is not finite.
    """
    if not bool(torch.isfinite(scores).all()):
        bad = torch.nonzero(~torch.isfinite(scores)).flatten()[:8].tolist()
        raise ValueError(
            f"{what}: non-finite scores at units {bad}; the weights contain NaN/Inf (check the learning rate or "
            "loss scaling) and no units were pruned."
        )


def bottom_k(scores_C: Tensor, *, num_drop: int, what: str = "scores") -> Tensor:
    """Indices (sorted ascending) of the ``num_drop`` lowest scores; ties drop the lower index first.

    Raises:
        ValueError: If a score is NaN or infinite (``what`` names the cluster in the message).

    Example::

        >>> bottom_k(torch.tensor([1.0, 0.5, 0.5, 2.0]), num_drop=2)
        tensor([1, 2])
    """
    check_finite(scores_C, what)
    if num_drop <= 0:
        return torch.zeros(0, dtype=torch.long, device=scores_C.device)
    order = torch.sort(scores_C, stable=True).indices
    return torch.sort(order[:num_drop]).values


def bottom_k_rows(scores_KC: Tensor, *, num_drop: int) -> Tensor:
    """Row by row, what :func:`bottom_k` returns: ``[K, num_drop]`` sorted indices of the lowest scores per row.

    One stable sort over ``K`` stacked clusters of equal size (ties drop the lower index first, as in
    :func:`bottom_k`); scores must already be checked finite.

    Example::

        >>> bottom_k_rows(torch.tensor([[1.0, 0.5, 0.5, 2.0], [0.0, 3.0, 1.0, 0.0]]), num_drop=2)
        tensor([[1, 2],
                [0, 3]])
    """
    num_drop = max(0, min(num_drop, scores_KC.shape[1]))
    if num_drop == 0:
        return torch.zeros(scores_KC.shape[0], 0, dtype=torch.long, device=scores_KC.device)
    order_KC = torch.sort(scores_KC, dim=1, stable=True).indices
    return torch.sort(order_KC[:, :num_drop], dim=1).values


def bottom_k_balanced(scores_KC: Tensor, *, num_drop: int, groups: int) -> Tensor:
    """Per row, the ``num_drop`` dropped units when the ``C`` units form ``groups`` equal groups of consecutive units.

    The balanced rule (GQA query heads inside their KV groups): every group loses ``num_drop / groups`` units, its
    lowest-scored ones, ties by the lower index. ``num_drop`` must be a multiple of ``groups`` (the cluster's
    ``multiple_of`` is, see :class:`~lightning_pat.core.spec.ResolvedCluster`); scores must already be checked
    finite.

    Args:
        scores_KC: ``[K, C]`` scores of ``K`` clusters of equal size (``[C]``: one cluster).
        num_drop: Units to drop per cluster.
        groups: Groups per cluster (dividing ``C``).

    Returns:
        ``[K, num_drop]`` (``[num_drop]`` for a ``[C]`` input) sorted dropped indices.

    Raises:
        ValueError: If ``groups`` does not divide ``C`` or ``num_drop``.

    Example::

        >>> bottom_k_balanced(torch.tensor([0.1, 0.2, 0.3, 0.9, 0.8, 0.7]), num_drop=2, groups=2)
        tensor([0, 5])
    """
    one = scores_KC.dim() == 1
    scores_KC = scores_KC[None] if one else scores_KC
    num_clusters, num_units = scores_KC.shape
    if num_units % groups or num_drop % groups:
        raise ValueError(
            f"balanced selection: {groups} groups must divide the {num_units} units and the {num_drop} dropped ones."
        )
    per = num_units // groups
    picked = bottom_k_rows(scores_KC.reshape(num_clusters * groups, per), num_drop=num_drop // groups)
    offsets = (torch.arange(num_clusters * groups, device=scores_KC.device) % groups * per)[:, None]
    out_KN = (picked + offsets).reshape(num_clusters, -1)  # group-major, each group's indices sorted: sorted rows
    return out_KN[0] if one else out_KN


def elimination_order(scores_C: Tensor, *, groups: int = 1) -> Tensor:
    """The order in which a cluster's units leave as its drop count grows: the lowest score first (ties: index).

    With ``groups`` (the balanced rule of :func:`bottom_k_balanced`) the lowest unit of every group leaves first
    (groups in order), then the second lowest of every group, and so on; any prefix of a multiple of ``groups``
    units is then the balanced selection of that many units.

    Example::

        >>> elimination_order(torch.tensor([0.3, 0.1, 0.2, 0.9, 0.8, 0.7]), groups=2).tolist()
        [1, 5, 2, 4, 0, 3]
    """
    if groups == 1:
        return torch.sort(scores_C, stable=True).indices
    per = scores_C.numel() // groups
    order_GP = torch.sort(scores_C.reshape(groups, per), dim=1, stable=True).indices
    order_GP = order_GP + torch.arange(groups, device=scores_C.device)[:, None] * per
    return order_GP.T.flatten()


def bottom_k_shared(scores: Sequence[Tensor], *, num_drop: int, what: str = "budget") -> list[Tensor]:
    """Joint bottom-k over several clusters; ties break by (cluster order, unit index).

    Returns:
        Per cluster, the sorted dropped indices.
    """
    if not scores:
        return []
    joint_T = torch.cat([s.to(torch.float64) if s.dtype != torch.float64 else s for s in scores])
    picked_T = bottom_k(joint_T, num_drop=num_drop, what=what)
    out, offset = [], 0
    for s in scores:
        n = s.numel()
        sel = picked_T[(picked_T >= offset) & (picked_T < offset + n)] - offset
        out.append(sel)
        offset += n
    return out


def bottom_k_floored(
    scores: Sequence[Tensor],
    *,
    num_drop: int,
    floors: Sequence[int],
    multiples: Sequence[int],
    groups: Sequence[int] | None = None,
) -> list[Tensor]:
    """Joint bottom-k over a shared budget where every cluster keeps at least its floor, in multiples.

    Each cluster's units, in their :func:`elimination_order` (sorted by score, stable; balanced over ``groups``),
    leave in *chunks*: its kept count steps from ``C`` to the multiples of its ``multiple_of`` below ``C``, down to
    its floor. A chunk's score is the highest score in it and in the chunks before it (the same as the highest in it:
    a cluster's chunks have non-decreasing scores); all chunks are ranked jointly (ties: cluster order, then chunk
    order) and taken in that order while the dropped units stay within ``num_drop``. With ``multiple_of=1`` and no
    floor this is :func:`bottom_k_shared`; with equal chunks of ``m`` units and ``num_drop`` a multiple of ``m``
    exactly ``num_drop`` units go (if the floors allow). Scores must already be checked finite.

    Args:
        scores: Per cluster, the ``[C]`` unit scores.
        num_drop: The most units to drop over all clusters.
        floors: Per cluster, the units it keeps at least.
        multiples: Per cluster, its ``multiple_of`` (a multiple of its ``groups``).
        groups: Per cluster, its ``unit_groups`` (default: 1 each).

    Returns:
        Per cluster, the sorted dropped indices.

    Example::

        >>> [t.tolist() for t in bottom_k_floored([torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.9, 0.8, 0.7])],
        ...                                         num_drop=4, floors=[2, 0], multiples=[1, 1])]
        [[0], [0, 1, 2]]
    """
    orders, kept_levels, chunk_scores, chunk_sizes, owners = [], [], [], [], []
    groups = [1] * len(scores) if groups is None else groups
    for c, (s, floor, mult, num_groups) in enumerate(zip(scores, floors, multiples, groups, strict=True)):
        num_units = s.numel()
        order = elimination_order(s, groups=num_groups)
        top = (num_units - 1) // mult * mult
        levels = [num_units] + [k for k in range(top, max(floor, 1) - 1, -mult) if k >= floor and k > 0]
        if floor == 0 and levels[-1] != 0:
            levels.append(0)
        lv = torch.tensor(levels, dtype=torch.long, device=s.device)
        ordered = torch.cummax(s[order].to(torch.float64), dim=0).values  # sorted already unless grouped
        orders.append(order)
        kept_levels.append(lv)
        chunk_scores.append(ordered[num_units - lv[1:] - 1])
        chunk_sizes.append(lv[:-1] - lv[1:])
        owners.append(torch.full((len(levels) - 1,), c, dtype=torch.long, device=s.device))
    if not scores:
        return []
    joint = torch.cat(chunk_scores)
    rank = torch.sort(joint, stable=True).indices  # ties: cluster order, then chunk order (the concatenation order)
    taken = torch.cumsum(torch.cat(chunk_sizes)[rank], 0) <= num_drop  # a prefix: sizes are positive
    counts = torch.bincount(torch.cat(owners)[rank][taken], minlength=len(scores)).tolist()
    out = []
    for order, lv, n in zip(orders, kept_levels, counts, strict=True):
        drop = int(order.numel() - lv[n])
        out.append(torch.sort(order[:drop]).values)
    return out


def round_kept(dropped_C: Tensor, scores_C: Tensor, *, multiple_of: int) -> Tensor:
    """Drop further lowest-scoring units until the kept count is a multiple of ``multiple_of`` (if any dropped)."""
    num_units = scores_C.numel()
    drop = dropped_C.numel()
    if drop == 0 or multiple_of == 1:
        return dropped_C
    keep = (num_units - drop) // multiple_of * multiple_of
    extra = num_units - keep - drop
    if extra == 0:
        return dropped_C
    kept_mask = torch.ones(num_units, dtype=torch.bool, device=scores_C.device)
    kept_mask[dropped_C] = False
    kept_idx = torch.nonzero(kept_mask).flatten()  # ascending, so a stable sort breaks ties by index
    order = torch.sort(scores_C[kept_idx], stable=True).indices
    return torch.sort(torch.cat([dropped_C, kept_idx[order[:extra]]])).values


def shrink_factors(norms_C: Tensor, *, threshold: Tensor | float) -> Tensor:
    """Group-lasso factors ``max(0, 1 - threshold / ||unit||)``; a zero-norm unit gets factor 0.

    Args:
        norms_C: The l2 norm of every unit over all members.
        threshold: ``lambda * gamma * sqrt(G)``.
    """
    safe = torch.where(norms_C > 0, norms_C, torch.ones_like(norms_C))
    factors = torch.clamp(1.0 - threshold / safe, min=0.0)
    return torch.where(norms_C > 0, factors, torch.zeros_like(factors))
