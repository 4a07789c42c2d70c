"""Workers of test_sharded_shrink.py: a tiny GQA Llama under FSDP2, cut and sharded again (shrink_sharded), against
the same model shrunk on one device (shrink_for_training) in the same process."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_pat import presets, resolve_clusters
from lightning_pat.parallel.comm.fsdp2 import shard_settings
from lightning_pat.shrink.entry import shrink_for_training
from lightning_pat.training.sharded_shrink import shrink_sharded
from tests.distributed.workers.recorder import Recorder

VOCAB = 64


def tiny_llama(*, layers: int = 2, tied: bool = True, kv: int = 3) -> torch.nn.Module:
    """A GQA Llama: ``kv`` query groups of 2 heads of 8 channels, 40 MLP channels, a residual of 48."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=layers, num_attention_heads=2 * kv,
        num_key_value_heads=kv, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


#: cluster -> dropped units: kept counts 1 and 2 of 3 KV groups, 27 and 32 of 40 MLP channels, 43 of 48 residual
#: channels (odd kept counts: uneven shards at world 2)
DROPPED = {
    "heads.0": [0, 2],
    "heads.1": [1],
    "mlp.0": [0, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 39],
    "mlp.1": [1, 2, 4, 8, 16, 32, 33, 34],
    "residual": [2, 9, 20, 30, 47],
}


#: the same under tensor parallelism over 2 ranks (4 query groups): every kept count along a split dim is even
DROPPED_TP = {
    "heads.0": [0, 2],
    "heads.1": [],
    "mlp.0": [0, 3, 5, 7, 11, 13, 17, 19, 23, 29],
    "mlp.1": [1, 2, 4, 8],
    "residual": [2, 9, 20, 30, 47],
}


def _sharded_copy(ref: torch.nn.Module, layout: str, world: int) -> torch.nn.Module:
    """A copy of ``ref`` sharded: ``fsdp2`` (every layer, then the root), or FSDP2 x TP on a 2-D mesh (``2x2``)."""
    sharded = copy.deepcopy(ref)
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # a policy of its own, kept by the reshard
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(sharded, mesh=mesh)
        return sharded
    from lightning_pat.lm.sharding import shard_causal_lm

    tp = 2
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    shard_causal_lm(sharded, mesh)
    return sharded


def _tp_then_dp_bytes(param: torch.Tensor) -> int:
    mesh, shape = param.device_mesh, list(param.shape)
    names = mesh.mesh_dim_names
    coord = dict(zip(names, mesh.get_coordinate(), strict=True))
    if "tensor_parallel" in names:
        placement = param.placements[names.index("tensor_parallel")]
        if placement.is_shard():
            shape[placement.dim] = _chunk_rows(shape[placement.dim], 2, coord["tensor_parallel"])
    shape[0] = _chunk_rows(shape[0], mesh.size(names.index("data_parallel")), coord["data_parallel"])
    n = 1
    for size in shape:
        n *= size
    return n * 4


def _sync(ref: torch.nn.Module, opt_ref: torch.optim.Optimizer, sharded: torch.nn.Module, opt_sh: Any) -> None:
    """``ref`` and its optimizer state set to the sharded model's, gathered (the reshard is compared bitwise)."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            ref_params[name].copy_(p.full_tensor())
            for key, value in opt_sh.state[p].items():
                target = opt_ref.state[ref_params[name]][key]
                target.copy_(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _slot_bytes(module: torch.nn.Module, opt: Any, world: int) -> int:
    """The bytes one rank packs to gather one kind of tensor of a group (1-D FSDP2): every parameter (or its Adam
    moment) of the module that no nested fully_shard module holds, each the largest rank's rows, 16-byte aligned."""
    nested = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    inner = {id(p) for m in nested for p in m.parameters()}
    total = 0
    for p in module.parameters():
        if id(p) in inner:
            continue
        rows = -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * 4
        total += -(-rows // 16) * 16
    return total


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _chunk_rows(n: int, world: int, rank: int) -> int:
    pieces = torch.arange(n).chunk(world)
    return len(pieces[rank]) if rank < len(pieces) else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def shrink_and_compare(rank: int, world: int, layout: str, dropped_keys: tuple[str, ...], tied: bool) -> dict:
    table = DROPPED if layout == "fsdp2" else DROPPED_TP
    dropped = {k: v for k, v in table.items() if k in dropped_keys}
    ref = tiny_llama(tied=tied, kv=3 if layout == "fsdp2" else 4)
    clusters = resolve_clusters(ref, presets.llama(ref, residual=True, query_heads=False))
    sharded = _sharded_copy(ref, layout, world)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt_sh = torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    for model, opt in ((ref, opt_ref), (sharded, opt_sh)):
        for _ in range(2):
            _loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
    _sync(ref, opt_ref, sharded, opt_sh)
    settings_before = [shard_settings(m) for m in sharded.modules() if isinstance(m, FSDPModule)]
    slots = [_slot_bytes(m, opt_sh, world) for m in sharded.modules() if isinstance(m, FSDPModule)]
    full_bytes = sum(_local(p).numel() * 4 for p in sharded.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped units are not zero here (no pruning ran): the cut is compared
        shrink_for_training(ref, clusters, dropped, optimizers=[opt_ref])
    with Recorder() as rec:
        new = shrink_sharded(sharded, clusters, dropped, optimizers=[opt_sh])
    out: dict = {"calls": [(c.name, list(c.group), c.dtype) for c in rec.calls], "materialized": rec.materialized}
    ref_params = dict(ref.named_parameters())
    sh_params = dict(sharded.named_parameters())
    out["names_equal"] = sorted(ref_params) == sorted(sh_params) and set(new) >= set(sh_params)
    out["shapes"] = {n: (tuple(p.shape), tuple(ref_params[n].shape)) for n, p in sh_params.items()}
    out["not_dtensor"] = [n for n, p in sh_params.items() if type(p.data).__name__ != "DTensor"]
    out["fsdp_modules"] = sum(isinstance(m, FSDPModule) for m in sharded.modules())
    out["settings_kept"] = settings_before == [
        shard_settings(m) for m in sharded.modules() if isinstance(m, FSDPModule)
    ]
    out["gather_bytes"], out["group_slot_bytes"] = [c.numel for c in rec.calls], slots
    out["config_equal"] = sharded.config.to_dict() == ref.config.to_dict()
    out["param_rel"] = max(_rel(p.full_tensor(), ref_params[n].detach()) for n, p in sh_params.items())
    # (b) the optimizer state, parameter by parameter
    state_rel, steps_equal, in_groups = 0.0, True, True
    sh_in_opt = {id(p) for g in opt_sh.param_groups for p in g["params"]}
    for name, p in sh_params.items():
        in_groups &= id(p) in sh_in_opt
        s, r = opt_sh.state[p], opt_ref.state[ref_params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert s[key].placements == p.placements, (name, key)
            assert s[key].shape == p.shape, (name, key)
            assert s[key].to_local().shape == p.to_local().shape, (name, key)
            state_rel = max(state_rel, _rel(s[key].full_tensor(), r[key]))
        steps_equal &= float(s["step"]) == float(r["step"])
    out.update(state_rel=state_rel, steps_equal=steps_equal, in_groups=in_groups)
    out["optimizer_params"] = sum(len(g["params"]) for g in opt_sh.param_groups) == len(sh_params)
    # (d) per-rank bytes: this rank's torch.chunk share of every small tensor
    want = sum(_chunk_rows(p.shape[0], world, rank) * (p.numel() // max(p.shape[0], 1)) * 4 for p in ref.parameters())
    if layout != "fsdp2":  # tensor parallelism's piece (torch.chunk along its dim), then FSDP2's rows of it
        want = sum(_tp_then_dp_bytes(p) for p in sharded.parameters())
    got = sum(p.to_local().numel() * 4 for p in sharded.parameters())
    out.update(bytes_got=got, bytes_want=want, bytes_full=full_bytes)
    out["state_bytes"] = sum(opt_sh.state[p]["exp_avg"].to_local().numel() * 4 for p in sharded.parameters())
    # (a) logits
    with torch.no_grad():
        out["logits_rel"] = _rel(sharded(input_ids=ids).logits, ref(input_ids=ids).logits)
    # (c) one more step on both
    for model, opt in ((ref, opt_ref), (sharded, opt_sh)):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
    out["step_rel"] = max(
        _rel(p.full_tensor(), ref_params[n].detach()) for n, p in dict(sharded.named_parameters()).items()
    )
    with torch.no_grad():
        out["logits_rel_after_step"] = _rel(sharded(input_ids=ids).logits, ref(input_ids=ids).logits)
    return out


def refused_under_tensor_parallel(rank: int, world: int) -> tuple[str, bool]:
    """Tensor parallel over 2 ranks (FSDP2 over 1), 3 of 4 query groups kept in layer 0: refused, nothing changed."""
    ref = tiny_llama(kv=4)
    clusters = resolve_clusters(ref, presets.llama(ref, residual=True, query_heads=False))
    sharded = _sharded_copy(ref, "2x2", world)
    before = {n: p.to_local().clone() for n, p in sharded.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = sharded(input_ids=ids).logits
    try:
        shrink_sharded(sharded, clusters, {"heads.0": [1], "mlp.0": [0, 1]})
    except ValueError as err:
        message = str(err)
    else:
        message = "not refused"
    with torch.no_grad():
        same = torch.equal(sharded(input_ids=ids).logits, want)
    sharded.reshard()  # the root keeps its gathered parameters after a forward (reshard_after_forward=False)
    after = dict(sharded.named_parameters())
    unchanged = (
        same
        and all(isinstance(m, FSDPModule) for m in (sharded, *sharded.model.layers))
        and all(torch.equal(after[n].to_local(), v) for n, v in before.items())
    )
    return message, unchanged


def resume_after_the_freeze(rank: int, world: int, layout: str, path: str) -> dict:
    """Shrunk and sharded again, one step, saved as a torch distributed checkpoint; a fresh full-size sharded model
    given the small layout by restore_shrunk_sharded loads it and continues bitwise like the original."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_pat.training.sharded_shrink import restore_shrunk_sharded

    table = DROPPED if layout == "fsdp2" else DROPPED_TP
    kv = 3 if layout == "fsdp2" else 4
    ref = tiny_llama(kv=kv)
    clusters = resolve_clusters(ref, presets.llama(ref, residual=True, query_heads=False))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    first = _sharded_copy(ref, layout, world)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        _loss(first, ids).backward()
        opt.step()
        opt.zero_grad()
    shrink_sharded(first, clusters, table, optimizers=[opt])
    _loss(first, ids).backward()
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(first, [opt])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    shapes = {k: tuple(v.shape) for k, v in model_sd.items()}
    second = _sharded_copy(tiny_llama(kv=kv), layout, world)  # the resumed run: full size, sharded, a fresh optimizer
    opt2 = torch.optim.AdamW(second.parameters(), lr=1e-2, weight_decay=0.1)
    with Recorder() as rec:
        restore_shrunk_sharded(second, clusters, table, optimizers=[opt2])
    model_sd2, optim_sd2 = get_state_dict(second, [opt2])
    out: dict = {"shapes_equal": {k: tuple(v.shape) for k, v in model_sd2.items()} == shapes}
    out["restore_calls"] = [c.name for c in rec.calls]
    dcp.load({"model": model_sd2, "optim": optim_sd2}, checkpoint_id=path)
    set_state_dict(second, [opt2], model_state_dict=model_sd2, optim_state_dict=optim_sd2)
    for model, o in ((first, opt), (second, opt2)):
        _loss(model, ids).backward()
        o.step()
        o.zero_grad()
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    out["params_equal"] = all(torch.equal(a[n].to_local(), b[n].to_local()) for n in a)
    out["layout_equal"] = all(a[n].placements == b[n].placements and a[n].shape == b[n].shape for n in a)
    out["state_equal"] = all(
        torch.equal(opt.state[a[n]][k].to_local(), opt2.state[b[n]][k].to_local()) for n in a for k in ("exp_avg",)
    ) and all(float(opt.state[a[n]]["step"]) == float(opt2.state[b[n]]["step"]) for n in a)
    out["config_equal"] = first.config.to_dict() == second.config.to_dict()
    return out


def refused_shard_placement(rank: int, world: int) -> tuple[str, bool]:
    """FSDP2 with a shard_placement_fn (Shard(1) for matrices): refused before anything changes."""
    from torch.distributed.tensor import Shard

    ref = tiny_llama()
    clusters = resolve_clusters(ref, presets.llama(ref, query_heads=False))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    sharded = copy.deepcopy(ref)
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    fully_shard(sharded, mesh=mesh)
    try:
        shrink_sharded(sharded, clusters, {"mlp.0": [1]})
    except ValueError as err:
        message = str(err)
    else:
        message = "not refused"
    unchanged = all(isinstance(m, FSDPModule) for m in (sharded, *sharded.model.layers)) and all(
        tuple(p.shape) == tuple(q.shape) for p, q in zip(sharded.parameters(), ref.parameters(), strict=True)
    )
    return message, unchanged
