"""Workers of test_sharded_teacher.py: copy a TinyGPT sharded by FSDP2, tensor parallel or both, then compare."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_pat.demo.model import TinyGPT
from lightning_pat.parallel.teacher import local_nbytes, sharded_frozen_copy
from tests.distributed.model_parallel_worker import CFG, _tp_plan


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
