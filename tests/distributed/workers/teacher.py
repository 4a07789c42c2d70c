"""Workers of test_sharded_teacher.py: copy a TinyGPT sharded by FSDP2, tensor parallel or both, then compare."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_pat.demo.model import TinyGPT
from lightning_pat.parallel.teacher import local_nbytes, sharded_frozen_copy
from tests.distributed.workers.model_parallel import CFG, _tp_plan


def _sharded(layout: str, world: int) -> TinyGPT:
    dp, tp = {"fsdp2": (world, 1), "tp": (1, world), "tp+fsdp2": (1, world), "2x2": (2, 2)}[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if tp > 1:
        _tp_plan(model, mesh["tensor_parallel"])
    if layout != "tp":
        for block in model.layers:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
    return model


def copy_and_compare(rank: int, world: int, layout: str) -> dict:
    torch.manual_seed(0)
    student = _sharded(layout, world)
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    student(ids).float().pow(2).mean().backward()  # one real step first: FSDP2 is initialized and resharded
    opt.step()
    opt.zero_grad()
    teacher = sharded_frozen_copy(student)
    s_params, t_params = dict(student.named_parameters()), dict(teacher.named_parameters())
    out: dict = {"same_names": sorted(s_params) == sorted(t_params), "layout_mismatch": [], "value_mismatch": []}
    for name, p in s_params.items():
        q = t_params[name]
        if (type(q).__name__, q.device_mesh, q.placements) != (type(p).__name__, p.device_mesh, p.placements):
            out["layout_mismatch"].append(name)
        if not torch.equal(q.to_local(), p.detach().to_local()) or q.to_local().data_ptr() == p.to_local().data_ptr():
            out["value_mismatch"].append(name)
    out["fsdp_modules"] = sum(isinstance(m, FSDPModule) for m in teacher.modules())
    out["requires_grad"] = any(p.requires_grad for p in teacher.parameters())
    out["nbytes_equal"] = local_nbytes(teacher) == local_nbytes(student)
    out["nbytes_vs_full"] = local_nbytes(teacher) / sum(p.numel() * 4 for p in s_params.values())
    with torch.no_grad():
        want = student(ids)
        got = teacher(ids)
    out["forward_max_diff"] = (got - want).abs().max().item()
    out["forward_is_plain"] = type(got) is torch.Tensor
    before = {n: q.to_local().clone() for n, q in t_params.items()}
    student(ids).float().pow(2).mean().backward()  # the student trains on; the teacher does not move
    opt.step()
    out["teacher_moved"] = [n for n, q in t_params.items() if not torch.equal(q.to_local(), before[n])]
    out["teacher_grads"] = sum(q.grad is not None for q in t_params.values())
    out["student_moved"] = any(not torch.equal(p.detach().to_local(), before[n]) for n, p in s_params.items())
    with torch.no_grad():
        out["shards_back"] = all(type(q).__name__ == "DTensor" for q in teacher.parameters())
    return out


def dtensor_logits_error(rank: int, world: int) -> str:
    """A logits module whose output is a DTensor (vocabulary-sharded, as for loss_parallel): the hook's error."""
    from torch.distributed.tensor import DTensor, Shard

    from lightning_pat.training.distill import Distiller

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",))

    class VocabSharded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 8)

        def forward(self, x):  # noqa: ANN001, ANN201
            return DTensor.from_local(self.fc(x).chunk(world, dim=1)[rank], mesh, [Shard(1)])

    distiller = Distiller(alpha=0.5, temperature=1.0, teacher=VocabSharded())
    distiller.bind(VocabSharded(), "")
    distiller.ensure_teacher(step=0, start=0)
    distiller.open()
    try:
        distiller.student(torch.randn(3, 4))
    except ValueError as err:
        return str(err)
    return "no error"


def _fsdp_groups(model: torch.nn.Module) -> int:
    """``fully_shard`` modules that own parameters (FSDP2 gathers each such group once per forward)."""
    from torch.distributed.fsdp import fully_shard

    return sum(isinstance(m, FSDPModule) and fully_shard.state(m)._fsdp_param_group is not None
               for m in model.modules())  # fmt: skip


def teacher_forward_gathers(rank: int, world: int, layout: str, param_dtype: str | None = None) -> dict:
    """The teacher's forward under the collective recorder, and its logits against the student's (no step taken)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tests.distributed.workers.recorder import Recorder

    dp, tp = {"fsdp2": (world, 1), "tp": (1, world), "2x2": (2, 2)}[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype)) if param_dtype else MixedPrecisionPolicy()
    torch.manual_seed(0)
    student = TinyGPT(CFG)
    if tp > 1:
        _tp_plan(student, mesh["tensor_parallel"])
    if dp > 1:
        for block in student.layers:
            fully_shard(block, mesh=mesh["data_parallel"], mp_policy=policy)
        fully_shard(student, mesh=mesh["data_parallel"], mp_policy=policy)
    ids = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank // tp))
    teacher = sharded_frozen_copy(student)  # before any forward: the root keeps its parameters gathered after one
    with Recorder() as ref, torch.no_grad():
        want = student(ids)
    with Recorder() as rec, torch.no_grad():
        got = teacher(ids)
    dp_ranks = sorted({r for r in range(world) if r % tp == rank % tp})
    return {
        "groups": _fsdp_groups(student) if dp > 1 else 0,
        "calls": [(c.name, list(c.group), c.dtype) for c in rec.calls],
        "dp_ranks": dp_ranks,
        "materialized": rec.materialized,
        "student_materialized": ref.materialized,  # tensor parallelism's layout hooks redistribute activations
        "dtype": (str(got.dtype), str(want.dtype)),
        "max_diff": (got.float() - want.float()).abs().max().item(),
        "shards_back": all(type(q).__name__ == "DTensor" for q in teacher.parameters()),
    }


def packed_gather_matches_full_tensor(rank: int, world: int) -> dict:
    """``gather_packed`` on a 2x2 mesh: mixed dtypes, uneven and empty shards, FSDP-style and other layouts."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_pat.parallel.comm.fsdp2 import gather_packed
    from tests.distributed.workers.recorder import Recorder

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    cases = [  # (global tensor, placements); every rank builds the same global tensors
        (torch.randn(5, 6, generator=g), [Shard(0), Shard(1)]),  # uneven along dp, tp on another dim
        (torch.randn(3, generator=g, dtype=torch.float64), [Shard(0), Replicate()]),  # float64, 2 + 1 rows
        (torch.randn(1, 4, generator=g).to(torch.bfloat16), [Shard(0), Replicate()]),  # an empty shard on dp 1
        (torch.randint(0, 9, (4, 3), generator=g), [Shard(1), Replicate()]),  # int64, sharded along dim 1
        (torch.randn(6, 2, generator=g), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 + colwise TP
        (torch.randn(6, 2, generator=g), [Replicate(), Shard(0)]),  # not sharded along dp: no communication
        (torch.randn(6, 2, generator=g), [Shard(0), Shard(0)]),  # dp split first: not FSDP2's, redistributed
        (torch.randn(2, 3, generator=g), None),  # a plain tensor
    ]
    tensors = [t if p is None else distribute_tensor(t, mesh, p, src_data_rank=None) for t, p in cases]
    tp = mesh.get_local_rank("tp")
    with Recorder() as rec:
        out = gather_packed(tensors, ("dp",))
    mismatched = []
    for i, ((full, placements), got) in enumerate(zip(cases, out, strict=True)):
        want_type = "Tensor" if placements is None else "DTensor"  # a DTensor stays one on the tp sub-mesh
        split = placements is not None and placements[1] != Replicate()
        want = full.chunk(2, dim=placements[1].dim)[tp] if split else full  # tp's piece
        mine = got.to_local() if type(got).__name__ == "DTensor" else got
        layout = None if want_type == "Tensor" else (got.device_mesh.mesh_dim_names, tuple(got.placements))
        ok = type(got).__name__ == want_type and mine.dtype == full.dtype and torch.equal(mine, want)
        if not ok or layout != (None if want_type == "Tensor" else (("tp",), (placements[1],))):
            mismatched.append(i)
    with torch.no_grad():
        cast = gather_packed(tensors[:3], ("dp",), dtype=torch.bfloat16)
    wants = [cases[0][0].chunk(2, dim=1)[tp], cases[1][0], cases[2][0]]  # the first is split along tp
    cast_ok = [c.dtype == torch.bfloat16 for c in cast] + [torch.equal(
        (c.to_local() if type(c).__name__ == "DTensor" else c), want.to(torch.bfloat16)
    ) for c, want in zip(cast, wants, strict=True)]  # fmt: skip
    return {"mismatched": mismatched, "calls": [(c.name, list(c.group), c.dtype) for c in rec.calls],
            "materialized": rec.materialized, "cast_ok": all(cast_ok)}  # fmt: skip
