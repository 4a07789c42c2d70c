"""An independent dense float64 reference of one coupled pruning step.

Written from the formulas in DESIGN.md / reference/pat-algorithm.md with plain torch and Python; it imports
nothing from ``lightning_pat`` so that the engine can be checked against it.

A reference cluster lists its members explicitly (parameter name, channel dim, channel range); the block of a
member is its range length divided by the number of units ``C``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

SCORE_TYPES = ("rms", "l2", "param_cost")


@dataclass(frozen=True)
class RefMember:
    name: str
    dim: int
    start: int
    stop: int


@dataclass
class RefCluster:
    name: str
    members: list[RefMember]
    num_units: int
    target: float | None = None
    multiple_of: int = 1
    budget: str | None = None


@dataclass
class RefResult:
    dropped: dict[str, list[int]]
    num_units: dict[str, int]
    zeros: dict[str, int]
    numel: dict[str, int]
    weights: dict[str, torch.Tensor]
    # diagnostics for the test's own preconditions
    scores: dict[str, list[float]] = field(default_factory=dict)
    norms: dict[str, list[float]] = field(default_factory=dict)


def _block(member: RefMember, num_units: int) -> int:
    length = member.stop - member.start
    assert length % num_units == 0, (member, num_units)
    return length // num_units


def unit_slice(weight: torch.Tensor, member: RefMember, num_units: int, unit: int) -> torch.Tensor:
    """The slice of ``weight`` (a view) that belongs to ``unit`` of ``member``."""
    block = _block(member, num_units)
    return weight.narrow(member.dim, member.start + unit * block, block)


def elements_per_unit(cluster: RefCluster, shapes: dict[str, tuple[int, ...]]) -> int:
    """``G``: elements of one unit summed over all members."""
    total = 0
    for m in cluster.members:
        other = 1
        for d, size in enumerate(shapes[m.name]):
            if d != m.dim:
                other *= size
        total += _block(m, cluster.num_units) * other
    return total


def unit_sq_norms(weights: dict[str, torch.Tensor], cluster: RefCluster) -> list[float]:
    """``Q_c``: sum over members of the squared l2 norm of unit ``c``'s slices, in float64."""
    out = []
    for c in range(cluster.num_units):
        total = 0.0
        for m in cluster.members:
            piece = unit_slice(weights[m.name], m, cluster.num_units, c).to(torch.float64)
            total += float((piece * piece).sum())
        out.append(total)
    return out


def score_values(q: list[float], *, unit_numel: int, score: str) -> list[float]:
    """Normalised scores: ``sqrt(Q) / sqrt(G)`` (rms), ``sqrt(Q)`` (l2), ``sqrt(Q) / G`` (param_cost)."""
    if score == "rms":
        return [math.sqrt(v) / math.sqrt(unit_numel) for v in q]
    if score == "l2":
        return [math.sqrt(v) for v in q]
    if score == "param_cost":
        return [math.sqrt(v) / unit_numel for v in q]
    raise AssertionError(score)


def drop_count(target: float, num_units: int, multiple_of: int = 1) -> int:
    """``ceil(target * C)`` (decimal-exact), then the kept count rounded down to a multiple when anything drops."""
    drop = math.ceil(Fraction(repr(float(target))) * num_units)
    drop = min(drop, num_units)
    if drop == 0:
        return 0
    keep = (num_units - drop) // multiple_of * multiple_of
    return num_units - keep


def lowest(scores: list[float], count: int, *, exclude: set[int] = frozenset()) -> list[int]:
    """Indices of the ``count`` lowest scores (ties: lowest index first), skipping ``exclude``."""
    order = sorted((s, i) for i, s in enumerate(scores) if i not in exclude)
    return [i for _, i in order[:count]]


def _round_kept(dropped: set[int], scores: list[float], multiple_of: int) -> set[int]:
    num_units = len(scores)
    if not dropped:
        return dropped
    keep = (num_units - len(dropped)) // multiple_of * multiple_of
    extra = num_units - keep - len(dropped)
    return dropped | set(lowest(scores, extra, exclude=dropped))


def reference_step(
    weights: dict[str, torch.Tensor],
    clusters: list[RefCluster],
    sparsity: float,
    *,
    score: str = "rms",
    method: str = "hard",
    reg_lambda: float = 0.0,
    gamma: float = 1.0,
    group_count_ref: int | None = None,
) -> RefResult:
    """One projection step on copies of ``weights`` (name -> tensor; tied names should appear once)."""
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    orig = {n: w.detach().to(torch.float64).clone() for n, w in weights.items()}
    q = {rc.name: unit_sq_norms(orig, rc) for rc in clusters}
    g = {rc.name: elements_per_unit(rc, shapes) for rc in clusters}
    scores = {rc.name: score_values(q[rc.name], unit_numel=g[rc.name], score=score) for rc in clusters}
    for rc in clusters:
        for v in scores[rc.name]:
            if not math.isfinite(v):
                raise ValueError(f"non-finite score in {rc.name}")

    def target_of(rc: RefCluster) -> float:
        return sparsity if rc.target is None else rc.target

    # hard floor
    floor: dict[str, set[int]] = {}
    budgets: dict[str, list[RefCluster]] = {}
    for rc in clusters:
        if rc.budget is None:
            n = drop_count(target_of(rc), rc.num_units, rc.multiple_of)
            floor[rc.name] = set(lowest(scores[rc.name], n))
        else:
            budgets.setdefault(rc.budget, []).append(rc)
    for group in budgets.values():
        total = sum(rc.num_units for rc in group)
        n = drop_count(target_of(group[0]), total)
        joint = []
        for order, rc in enumerate(group):
            factor = 1.0 if group_count_ref is None else math.sqrt(rc.num_units / group_count_ref)
            joint += [(s * factor, order, i) for i, s in enumerate(scores[rc.name])]
        picked = sorted(joint)[:n]
        for order, rc in enumerate(group):
            sel = {i for _, o, i in picked if o == order}
            floor[rc.name] = _round_kept(sel, scores[rc.name], rc.multiple_of)

    # factors per unit
    factors: dict[str, list[float]] = {}
    norms: dict[str, list[float]] = {}
    for rc in clusters:
        norms[rc.name] = [math.sqrt(v) for v in q[rc.name]]
        if method == "hard":
            f = [0.0 if c in floor[rc.name] else 1.0 for c in range(rc.num_units)]
        elif method == "group_lasso":
            thr = reg_lambda * gamma * math.sqrt(g[rc.name])
            f = [max(0.0, 1.0 - thr / nrm) if nrm > 0 else 0.0 for nrm in norms[rc.name]]
            f = [0.0 if c in floor[rc.name] else v for c, v in enumerate(f)]
        else:
            raise AssertionError(method)
        factors[rc.name] = f

    new = {n: w.clone() for n, w in orig.items()}
    for rc in clusters:
        for m in rc.members:
            for c, f in enumerate(factors[rc.name]):
                if f == 1.0:
                    continue
                piece = unit_slice(new[m.name], m, rc.num_units, c)
                if f == 0.0:
                    piece.zero_()
                else:
                    piece.mul_(f)

    names = list(dict.fromkeys(m.name for rc in clusters for m in rc.members))
    return RefResult(
        dropped={rc.name: sorted(c for c, f in enumerate(factors[rc.name]) if f == 0.0) for rc in clusters},
        num_units={rc.name: rc.num_units for rc in clusters},
        zeros={n: int((new[n] == 0).sum()) for n in names},
        numel={n: new[n].numel() for n in names},
        weights=new,
        scores=scores,
        norms=norms,
    )
