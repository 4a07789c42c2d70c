"""A small Llama-like set of weights, its cluster declarations, and an independent dense float64 reference.

The reference below is written from the formulas (DESIGN.md, pat-algorithm.md §1.4, §5, §9.11/13) with plain
Python and torch; it imports nothing from ``lightning_pat`` and writes every cluster's membership out by hand.

Weights are ``base * outer(row_scale, col_scale)`` with ``base`` in ``±[0.8, 1.2]`` and every unit's scale a
distinct power of two, so that unit squared norms of one cluster (and of clusters that share a budget) differ by
at least a factor ``4 / 2.25``: rounding can never reorder them, and sharded, materializing and reference paths
must agree exactly on the dropped units.

Shapes (d=10 hidden, ffn 14, vocab 4 in / 7 out; sizes chosen so that world sizes 3 and 4 give uneven and empty
shards): layer 0 has GQA attention (4 query heads, 2 kv heads, head_dim 3), layer 1 a fused ``qkv`` weight with
3 heads of head_dim 2 whose q/k/v slices are separate members (shard boundaries cut heads in half).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from tests.common import reference as R

D, FFN, V_IN, V_OUT = 10, 14, 4, 7

SHAPES: dict[str, tuple[int, ...]] = {
    "embed": (V_IN, D),
    "l0.q": (12, D),
    "l0.k": (6, D),
    "l0.v": (6, D),
    "l0.o": (D, 12),
    "l0.norm": (D,),
    "l0.gate": (FFN, D),
    "l0.up": (FFN, D),
    "l0.up_b": (FFN,),
    "l0.down": (D, FFN),
    "l1.qkv": (18, D),
    "l1.o": (D, 6),
    "l1.norm": (D,),
    "l1.gate": (FFN, D),
    "l1.up": (FFN, D),
    "l1.down": (D, FFN),
    "norm": (D,),
    "head": (V_OUT, D),
}
COLWISE = ("l0.q", "l0.k", "l0.v", "l0.gate", "l0.up", "l1.qkv", "l1.gate", "l1.up", "head", "embed")
ROWWISE = ("l0.o", "l0.down", "l1.o", "l1.down")


RefMember = R.RefMember  # one member type for both references


@dataclass(frozen=True)
class RefCluster:
    name: str
    members: tuple[RefMember, ...]
    num_units: int
    budget: str | None = None
    multiple_of: int = 1


def _w(name: str, dim: int, start: int = 0, stop: int | None = None) -> RefMember:
    return RefMember(name, dim, start, SHAPES[name][dim] if stop is None else stop)


def ref_clusters(*, shared_mlp: bool = False, resid_multiple_of: int = 1) -> list[RefCluster]:
    budget = "mlp" if shared_mlp else None
    return [
        RefCluster("heads.0", (_w("l0.q", 0), _w("l0.k", 0), _w("l0.v", 0), _w("l0.o", 1)), 2),
        RefCluster(
            "heads.1", (_w("l1.qkv", 0, 0, 6), _w("l1.qkv", 0, 6, 12), _w("l1.qkv", 0, 12, 18), _w("l1.o", 1)), 3
        ),
        RefCluster("mlp.0", (_w("l0.gate", 0), _w("l0.up", 0), _w("l0.up_b", 0), _w("l0.down", 1)), FFN, budget),
        RefCluster("mlp.1", (_w("l1.gate", 0), _w("l1.up", 0), _w("l1.down", 1)), FFN, budget),
        RefCluster(
            "resid",
            tuple(
                [_w(n, 0) for n in ("l0.o", "l0.down", "l1.o", "l1.down", "l0.norm", "l1.norm", "norm")]
                + [
                    _w(n, 1)
                    for n in ("embed", "l0.q", "l0.k", "l0.v", "l0.gate", "l0.up", "l1.qkv", "l1.gate", "l1.up", "head")
                ]
            ),
            D,
            multiple_of=resid_multiple_of,
        ),
    ]


def declarations(*, shared_mlp: bool = False, resid_multiple_of: int = 1) -> list:
    from lightning_pat import Cluster

    budget = "mlp" if shared_mlp else None
    return [
        Cluster("heads.0", writers=["l0.q", "l0.k", "l0.v"], readers=["l0.o"], head_dim=3),
        Cluster("heads.1", writers=["l1.qkv[0:6]", "l1.qkv[6:12]", "l1.qkv[12:18]"], readers=["l1.o"], head_dim=2),
        Cluster("mlp.0", writers=["l0.gate", "l0.up", "l0.up_b"], readers=["l0.down"], budget=budget),
        Cluster("mlp.1", writers=["l1.gate", "l1.up"], readers=["l1.down"], budget=budget),
        Cluster(
            "resid",
            writers=["l0.o", "l0.down", "l1.o", "l1.down", "l0.norm", "l1.norm", "norm"],
            readers=["embed", "l0.q", "l0.k", "l0.v", "l0.gate", "l0.up", "l1.qkv", "l1.gate", "l1.up", "head"],
            multiple_of=resid_multiple_of,
        ),
    ]


def full_weights(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Identical on every rank (seeded)."""
    rng = random.Random(seed)
    powers = list(range(D))
    rng.shuffle(powers)
    s = [2.0**p for p in powers]
    mlp_powers = list(range(2 * FFN))
    rng.shuffle(mlp_powers)
    t = {0: [2.0**p for p in mlp_powers[:FFN]], 1: [2.0**p for p in mlp_powers[FFN:]]}
    h0 = [2.0**3, 1.0]
    h1 = [4.0, 32.0, 1.0]
    rows: dict[str, list[float]] = {
        "embed": [1.0] * V_IN,
        "head": [1.0] * V_OUT,
        "l0.q": [a for a in h0 for _ in range(6)],
        "l0.k": [a for a in h0 for _ in range(3)],
        "l0.v": [a for a in h0 for _ in range(3)],
        "l0.o": s,
        "l1.qkv": [a for _ in range(3) for a in h1 for _ in range(2)],
        "l1.o": s,
        "l0.gate": t[0],
        "l0.up": t[0],
        "l0.up_b": t[0],
        "l0.down": s,
        "l1.gate": t[1],
        "l1.up": t[1],
        "l1.down": s,
        "l0.norm": s,
        "l1.norm": s,
        "norm": s,
    }
    cols: dict[str, list[float]] = {
        "l0.o": [a for a in h0 for _ in range(6)],
        "l1.o": [a for a in h1 for _ in range(2)],
        "l0.down": t[0],
        "l1.down": t[1],
    }
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        base = 0.8 + 0.4 * torch.rand(shape, generator=gen, dtype=torch.float64)
        base = base * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        scale = torch.tensor(rows[name], dtype=torch.float64)
        if len(shape) == 2:
            scale = scale[:, None] * torch.tensor(cols.get(name, s), dtype=torch.float64)[None, :]
        out[name] = (base * scale).to(dtype)
    out["embed"][1, 3] = 0.0  # an isolated literal zero, counted once
    return out


# ---------------------------------------------------------------------------------------------- dense reference
def _common(rc: RefCluster, target: float | None = None) -> R.RefCluster:
    return R.RefCluster(
        rc.name, list(rc.members), rc.num_units, target=target, multiple_of=rc.multiple_of, budget=rc.budget
    )


def unit_view(w: torch.Tensor, m: RefMember, c: int, unit: int) -> torch.Tensor:
    return R.unit_slice(w, m, c, unit)


def unit_numel(rc: RefCluster) -> int:
    return R.elements_per_unit(_common(rc), SHAPES)


def sq_norms(weights: dict[str, torch.Tensor], rc: RefCluster) -> list[float]:
    return R.unit_sq_norms({n: t.to(torch.float64) for n, t in weights.items()}, _common(rc))


@dataclass
class RefOut:
    dropped: dict[str, list[int]]
    weights: dict[str, torch.Tensor]
    zeros: dict[str, int]
    q: dict[str, list[float]]


def reference(
    weights: dict[str, torch.Tensor],
    clusters: list[RefCluster],
    targets: dict[str, float],
    *,
    score: str = "rms",
    method: str = "hard",
    threshold: float = 0.0,
) -> RefOut:
    """The independent dense float64 reference of tests/common/reference.py, with per-cluster targets."""
    common = [_common(rc, target=targets[rc.name]) for rc in clusters]
    out = R.reference_step(weights, common, 0.0, score=score, method=method, reg_lambda=threshold, gamma=1.0)
    new = {n: out.weights.get(n, t.to(torch.float64)) for n, t in weights.items()}
    q = {rc.name: sq_norms(weights, rc) for rc in clusters}
    return RefOut(out.dropped, new, {n: int((t == 0).sum()) for n, t in new.items()}, q)


def scores_of(q: list[float], g: int, score: str) -> list[float]:
    return R.score_values(q, unit_numel=g, score=score)


def lasso_threshold(weights: dict[str, torch.Tensor], clusters: list[RefCluster]) -> float:
    """A threshold that zeroes a few units, scales the rest, and stays far (>1%) from every unit's boundary."""
    ratios = sorted(math.sqrt(v) / math.sqrt(unit_numel(rc)) for rc in clusters for v in sq_norms(weights, rc))
    for i in range(len(ratios) // 4, len(ratios) - 1):
        cand = math.sqrt(ratios[i] * ratios[i + 1])
        if ratios[i + 1] / ratios[i] > 1.05:
            return cand
    raise AssertionError("no well-separated threshold")
