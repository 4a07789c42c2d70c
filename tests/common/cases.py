"""Random coupled-pruning cases: a module, the library declarations and the matching reference clusters.

The ground truth of every cluster (members, channel dims, ranges, C) is written down here by construction, not
derived from the library's resolution, so the reference stays independent.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_pat import Cluster
from tests.common.reference import RefCluster, RefMember, elements_per_unit, unit_slice, unit_sq_norms


def make_module(tensors: dict[str, torch.Tensor], *, requires_grad: bool = True) -> nn.Module:
    """A module whose ``named_parameters`` are exactly ``tensors`` (dotted names become submodules)."""
    root = nn.Module()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(value.clone(), requires_grad=requires_grad))
    return root


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True, msg=f"{k} changed")


@dataclass
class Case:
    tensors: dict[str, torch.Tensor]
    decls: list[Cluster]
    refs: list[RefCluster]
    sparsity: float = 0.5
    kwargs: dict = field(default_factory=dict)
    description: str = ""


class _Builder:
    def __init__(self, rng: random.Random, gen: torch.Generator) -> None:
        self.rng = rng
        self.gen = gen
        self.tensors: dict[str, torch.Tensor] = {}
        self.decls: list[Cluster] = []
        self.refs: list[RefCluster] = []
        self.res_writers: list[str] = []
        self.res_readers: list[str] = []
        self.kinds: list[str] = []

    def param(self, name: str, *shape: int) -> str:
        # magnitudes in [0.85, 1.15] with random signs: per-unit norms differ by < 1.35x before scaling
        mag = 0.85 + 0.3 * torch.rand(shape, generator=self.gen, dtype=torch.float64)
        sign = torch.where(torch.rand(shape, generator=self.gen) < 0.5, -1.0, 1.0).to(torch.float64)
        self.tensors[name] = mag * sign
        return name

    def cluster(self, name: str, writers: list, readers: list, num_units: int, head_dim: int | None = None) -> None:
        """``writers`` / ``readers``: (param name, slice suffix or None, start, stop)."""
        members = []
        w_pat, r_pat = [], []
        for role_list, pats, dim_of in ((writers, w_pat, "w"), (readers, r_pat, "r")):
            for pname, suffix, start, stop in role_list:
                dim = 1 if dim_of == "r" else 0
                if start is None:
                    start, stop = 0, self.tensors[pname].shape[dim]
                pats.append(pname + (suffix or ""))
                members.append(RefMember(pname, dim, start, stop))
        self.decls.append(Cluster(name=name, writers=w_pat, readers=r_pat, head_dim=head_dim))
        self.refs.append(RefCluster(name=name, members=members, num_units=num_units))

    # ---------------------------------------------------------------- blocks
    def mlp(self, i: int, d: int) -> None:
        f = self.rng.randint(3, 8)
        up = self.param(f"b{i}.up.weight", f, d)
        bias = self.param(f"b{i}.up.bias", f)
        gate = self.param(f"b{i}.gate.weight", f, d)
        down = self.param(f"b{i}.down.weight", d, f)
        self.cluster(
            f"mlp{i}",
            [(up, None, None, None), (bias, None, None, None), (gate, None, None, None)],
            [(down, None, None, None)],
            f,
        )
        self.res_readers += [up, gate]
        self.res_writers += [down]

    def fused_mlp(self, i: int, d: int) -> None:
        f = self.rng.randint(3, 8)
        gu = self.param(f"b{i}.gate_up.weight", 2 * f, d)
        down = self.param(f"b{i}.down.weight", d, f)
        if self.rng.random() < 0.5:
            slices = [("[0/2]", 0, f), ("[1/2]", f, 2 * f)]
        else:
            slices = [(f"[0:{f}]", 0, f), (f"[{f}:{2 * f}]", f, 2 * f)]
        self.cluster(f"mlp{i}", [(gu, s, a, b) for s, a, b in slices], [(down, None, None, None)], f)
        self.res_readers += [gu]
        self.res_writers += [down]

    def split_mlp(self, i: int, d: int) -> None:
        fa, fb = self.rng.randint(2, 5), self.rng.randint(2, 5)
        ua = self.param(f"b{i}.up_a.weight", fa, d)
        ub = self.param(f"b{i}.up_b.weight", fb, d)
        down = self.param(f"b{i}.down.weight", d, fa + fb)
        self.cluster(f"mlp{i}a", [(ua, None, None, None)], [(down, f"[0:{fa}]", 0, fa)], fa)
        self.cluster(f"mlp{i}b", [(ub, None, None, None)], [(down, f"[{fa}:{fa + fb}]", fa, fa + fb)], fb)
        self.res_readers += [ua, ub]
        self.res_writers += [down]

    def heads(self, i: int, d: int) -> None:
        h, hd = self.rng.randint(2, 5), self.rng.randint(1, 3)
        v = self.param(f"b{i}.v.weight", h * hd, d)
        vb = self.param(f"b{i}.v.bias", h * hd)
        o = self.param(f"b{i}.o.weight", d, h * hd)
        self.cluster(
            f"heads{i}", [(v, None, None, None), (vb, None, None, None)], [(o, None, None, None)], h, head_dim=hd
        )
        self.res_readers += [v]
        self.res_writers += [o]

    def gqa(self, i: int, d: int) -> None:
        nkv, rep, hd = self.rng.randint(2, 3), self.rng.randint(2, 3), self.rng.randint(1, 2)
        q = self.param(f"b{i}.q.weight", nkv * rep * hd, d)
        k = self.param(f"b{i}.k.weight", nkv * hd, d)
        v = self.param(f"b{i}.v.weight", nkv * hd, d)
        o = self.param(f"b{i}.o.weight", d, nkv * rep * hd)
        self.cluster(
            f"gqa{i}",
            [(q, None, None, None), (k, None, None, None), (v, None, None, None)],
            [(o, None, None, None)],
            nkv,
            head_dim=hd,
        )
        self.res_readers += [q, k, v]
        self.res_writers += [o]

    def fused_gqa(self, i: int, d: int) -> None:
        nkv, rep, hd = self.rng.randint(2, 3), self.rng.randint(2, 3), self.rng.randint(1, 2)
        ql, kl = nkv * rep * hd, nkv * hd
        qkv = self.param(f"b{i}.qkv.weight", ql + 2 * kl, d)
        o = self.param(f"b{i}.o.weight", d, ql)
        bounds = [(0, ql), (ql, ql + kl), (ql + kl, ql + 2 * kl)]
        self.cluster(
            f"gqa{i}", [(qkv, f"[{a}:{b}]", a, b) for a, b in bounds], [(o, None, None, None)], nkv, head_dim=hd
        )
        self.res_readers += [qkv]
        self.res_writers += [o]

    def residual(self, d: int) -> None:
        vocab = self.rng.randint(3, 6)
        norm = self.param("norm.weight", d)
        embed = self.param("embed.weight", vocab, d)
        head = self.param("lm_head.weight", vocab, d)
        writers = [(norm, None, None, None)] + [(n, None, None, None) for n in self.res_writers]
        readers = [(embed, None, None, None)] + [(n, None, None, None) for n in self.res_readers]
        readers.append((head, None, None, None))
        self.cluster("residual", writers, readers, d)


BLOCKS = ("mlp", "fused_mlp", "split_mlp", "heads", "gqa", "fused_gqa")
TARGETS = (0.0, 0.2, 0.25, 0.3, 0.5, 0.6, 0.75, 1.0)


def _separate(b: _Builder, step: float) -> None:
    """Scale unit c of every cluster by 2**(step * e_c), e a random permutation of range(C).

    Units of one cluster are then well separated; clusters of a shared budget overlap in range, so their joint
    ranking depends on the score type and the group-count correction (``_well_separated`` rejects near ties).
    """
    for rc in b.refs:
        exps = list(range(rc.num_units))
        b.rng.shuffle(exps)
        offset = b.rng.random()  # clusters do not line up on one grid of powers of two
        for c in range(rc.num_units):
            for m in rc.members:
                unit_slice(b.tensors[m.name], m, rc.num_units, c).mul_(2.0 ** (step * (exps[c] + offset)))


def _incidental_zeros(b: _Builder) -> None:
    for t in b.tensors.values():
        if b.rng.random() < 0.35:
            flat = t.view(-1)
            for _ in range(b.rng.randint(1, 2)):
                flat[b.rng.randrange(flat.numel())] = 0.0


def _well_separated(case: Case, rel: float) -> bool:
    """Precondition: every ranking and every group-lasso threshold decision has a clear margin."""
    tensors = case.tensors
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    score = case.kwargs.get("score", "rms")
    ref_count = case.kwargs.get("group_count_ref")
    vals: dict[str, list[float]] = {}
    for rc in case.refs:
        q = unit_sq_norms(tensors, rc)
        g = elements_per_unit(rc, shapes)
        h = {"rms": math.sqrt(g), "l2": 1.0, "param_cost": float(g)}[score]
        vals[rc.name] = [math.sqrt(v) / h for v in q]
        if case.kwargs.get("method") == "group_lasso":
            thr = case.kwargs["reg_lambda"] * case.kwargs["gamma"] * math.sqrt(g)
            if any(abs(math.sqrt(v) / thr - 1.0) < rel for v in q):
                return False
    domains: dict[str, list[float]] = {}
    for rc in case.refs:
        key = rc.name if rc.budget is None else f"budget:{rc.budget}"
        corr = 1.0 if rc.budget is None or ref_count is None else math.sqrt(rc.num_units / ref_count)
        domains.setdefault(key, []).extend(v * corr for v in vals[rc.name])
    for scores in domains.values():
        s = sorted(scores)
        for lo, hi in zip(s, s[1:], strict=False):
            if hi - lo <= rel * abs(hi):
                return False
    return True


def random_case(seed: int, *, dtype: torch.dtype = torch.float64, method: str | None = None) -> Case:
    """A random case whose scores are well separated at the precision of ``dtype``."""
    # float64: small steps between unit scales (jitter of 1.35x can reorder neighbours, and clusters of a budget
    # interleave densely) with a 1e-6 margin; lower precisions: octave steps and a 1% margin
    rel, step = (1e-6, 0.25) if dtype == torch.float64 else (1e-2, 1.0)
    for attempt in range(50):
        case = _draw(seed * 1000 + attempt, method=method, step=step)
        if dtype != torch.float64:
            case.tensors = {n: t.to(dtype).to(torch.float64) for n, t in case.tensors.items()}
        if _well_separated(case, rel):
            return case
    raise AssertionError(f"could not draw a well-separated case for seed {seed}")


def _empties(target: float, units: int, multiple_of: int) -> bool:
    """Whether a target strictly between 0 and 1 keeps no unit (``ceil``, then the kept count rounded down)."""
    if not 0.0 < target < 1.0:
        return False
    kept = units - min(units, math.ceil(round(target * units, 9)))
    return kept // multiple_of * multiple_of == 0


def _no_silent_empty(b: _Builder, sparsity: float) -> None:
    """Make a draw that would empty a cluster with a target below 1 (refused, DESIGN invariant 11) say target 1.0.

    The dropped units are the same (all of them), so the draw's reference result does not change; a shared budget's
    member whose ``multiple_of`` exceeds its units (which would keep all or nothing) gets ``multiple_of=1``.
    """
    groups: dict[str | None, list[int]] = {}
    for i, rc in enumerate(b.refs):
        groups.setdefault(rc.budget, []).append(i)
    for budget, idx in groups.items():
        if budget is None:
            for i in idx:
                rc = b.refs[i]
                if _empties(sparsity if rc.target is None else rc.target, rc.num_units, rc.multiple_of):
                    b.decls[i].target = b.refs[i].target = 1.0
            continue
        target = sparsity if b.refs[idx[0]].target is None else b.refs[idx[0]].target
        if _empties(target, sum(b.refs[i].num_units for i in idx), 1):
            for i in idx:
                b.decls[i].target = b.refs[i].target = 1.0
        elif 0.0 < target < 1.0:
            for i in idx:
                if b.refs[i].multiple_of > b.refs[i].num_units:
                    b.decls[i].multiple_of = b.refs[i].multiple_of = 1


def _draw(seed: int, *, method: str | None, step: float = 1.0) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b = _Builder(rng, gen)
    d = rng.randint(3, 6)
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(BLOCKS)
        b.kinds.append(kind)
        getattr(b, kind)(i, d)
    if rng.random() < 0.6:
        b.residual(d)
        b.kinds.append("residual")
    n = len(b.refs)
    # per-cluster options
    for decl, rc in zip(b.decls, b.refs, strict=True):
        if rng.random() < 0.3:
            decl.multiple_of = rc.multiple_of = rng.choice([2, 3])
        if rng.random() < 0.3:
            decl.target = rc.target = rng.choice(TARGETS)
    budgets: dict[str, list[int]] = {}
    if n >= 2 and rng.random() < 0.7:
        idx = sorted(rng.sample(range(n), rng.randint(2, n)))
        target = rng.choice((None, *TARGETS))
        for i in idx:
            b.decls[i].budget = b.refs[i].budget = "shared"
            b.decls[i].target = b.refs[i].target = target
        budgets["shared"] = idx
    _separate(b, step)
    _incidental_zeros(b)
    kwargs: dict = {
        "score": rng.choice(["rms", "l2", "param_cost"]),
        "method": method or rng.choice(["hard", "hard", "group_lasso"]),
        "executor": rng.choice(["auto", "materializing"]),
    }
    if budgets and rng.random() < 0.6:
        kwargs["group_count_ref"] = rng.randint(1, 8)
    sparsity = rng.choice(TARGETS)
    _no_silent_empty(b, sparsity)
    case = Case(
        b.tensors,
        b.decls,
        b.refs,
        sparsity=sparsity,
        kwargs=kwargs,
        description=f"seed={seed} blocks={b.kinds} budgets={budgets} {kwargs}",
    )
    if kwargs["method"] == "group_lasso":
        pooled = []
        shapes = {k: tuple(t.shape) for k, t in b.tensors.items()}
        for rc in b.refs:
            g = elements_per_unit(rc, shapes)
            pooled += [math.sqrt(v / g) for v in unit_sq_norms(b.tensors, rc)]
        pooled = sorted(v for v in pooled if v > 0)
        k = rng.randrange(len(pooled) - 1) if len(pooled) > 1 else 0
        thr = math.sqrt(pooled[k] * pooled[min(k + 1, len(pooled) - 1)])
        gamma = rng.choice([0.5, 1.0, 2.0])
        kwargs["gamma"] = gamma
        kwargs["reg_lambda"] = thr / gamma
    return case
