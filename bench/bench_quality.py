"""Quality: pruning during training (lightning_pat) vs pruning after it, at the same size and step budget.

    python bench/bench_quality.py                      # main set, 3 seeds, one table (15-60 min on 2 shared cores)
    python bench/bench_quality.py --quick              # smoke run: tiny step counts, 1 seed
    python bench/bench_quality.py --seeds 0 --variants default,oneshot --jsonl runs.jsonl   # a subset
    python bench/bench_quality.py --table runs.jsonl   # print the table of stored runs (seeds run separately)
    python bench/bench_quality.py --sparsity 0.75 ...  # another pruned size (default 0.5 of MLP channels and heads)

Corpus: the bytes of the Python standard library's top-level ``*.py`` files (sorted; every 10th file held out for
validation). Model: TinyGPT (d=64, 2 layers, 4 heads of 16, SwiGLU 256, seq 64, 148k params), AdamW, batch 16.

Protocol per seed: a dense model trains ``M`` steps (warmup 50, then constant lr). From that one checkpoint (weights
and AdamW state) every "from checkpoint" variant trains ``R`` more steps on the same batches with the same lr
(linearly decayed 3e-3 -> 3e-4 over the ``R`` steps) and ends at 50% (``--sparsity``) of the MLP channels and heads of
every layer (the same active-parameter count for every pruned variant). The small model (same widths as the pruned
one) trains from scratch for ``R`` and for ``M + R`` steps with the same recipe. The metric is the mean validation
loss (nats per byte) on a fixed set of held-out windows, after the last step.

Variants (``--variants``): see ``VARIANTS``. ``act*`` use the library's ``score="activation"`` (the callback's
statistics over training batches; ``oneshot_act``: ``lightning_pat.scoring.activation.calibrate`` on 8 training
batches, then ``prune_clusters(score="activation")``; ``distill*``: the library's ``distill_alpha``; ``act_distill``
and ``oneshot_act_distill``: both, in training and one-shot, healing with the same distillation from the dense
checkpoint); ``taylor``: ``score="taylor"``; ``recipe`` and ``recipe_w8``: the option set of ``OneShotPruningCallback``
(the cut at the first step, or after 8 dense steps of the budget); ``gates`` and ``gates_distill``: learned
hard-concrete gates per MLP channel and head (Louizos et al. 2018) driven to the target by a Lagrangian term
(Sheared-LLaMA), the first ``GATES["steps"]`` steps of ``R``, then snapped to the exact per-layer top-k by
``log_alpha`` (kept gates folded into the reader columns) and healed for the rest of ``R`` with the library's mask
held (``gates_distill``: distillation from the dense checkpoint in both phases, as ``act_distill``; the gate math is
in ``bench/hard_concrete.py``, ``--gates`` overrides its hyper-parameters). Benchmark-side helpers, not
library features: knowledge distillation from the frozen dense checkpoint (``kd``), the earlier benchmark-side
activation score (``act_patch``, a cross-check of the library's: EMA of each unit's mean squared reader input times
the reader column's squared norm, patched into the pruner's score method), Lightning's ``ModelPruning`` (per tensor,
rows, not coupled, not shrinkable) and torchao's
``PruneOptimizer`` (per tensor).

The group-lasso rows measured before the library fix (commit eacc1b9: the ramp target was 0, and direct mode used
the cumulative lr as its prox step) are kept in BENCHMARKS.md; ``steplasso*`` and ``floorlasso*`` were the
benchmark-side versions of the two fixes and are now plain library options (the same as ``lasso*``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hard_concrete  # noqa: E402  (bench/hard_concrete.py, next to this script)

from lightning_pat import CoupledPruningCallback  # noqa: E402
from lightning_pat.core.selection import num_to_drop  # noqa: E402
from lightning_pat.demo import preset as demo_preset  # noqa: E402
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig  # noqa: E402
from lightning_pat.pruning.api import prune_clusters  # noqa: E402
from lightning_pat.scoring.activation import calibrate  # noqa: E402

SEQ, BATCH, LR, LR_END, WARMUP, SPARSITY = 64, 16, 3e-3, 3e-4, 50, 0.5
CFG = TinyGPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, d_model=64, d_ff=256, max_seq_len=SEQ)
#: ``--model``: the default TinyGPT (148k params) or the larger one of issue 16 (d=128, 4 layers, 8 heads, 1.1M params)
MODELS = {
    "small": CFG,
    "large": TinyGPTConfig(vocab_size=256, n_layer=4, n_head=8, n_kv_head=8, d_model=128, d_ff=512, max_seq_len=SEQ),
}
MODEL = "small"
#: ``--clusters``: what is pruned, ``mlp_heads`` (MLP channels and heads of every layer) or ``residual`` (the
#: hidden-size channels shared by every layer: embedding, norms, every reader and writer of the residual stream)
CLUSTERS = "mlp_heads"


# ---------------------------------------------------------------------------------------------------- data
def corpus(max_bytes: int = 3_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation bytes (split by file, deterministic)."""
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())
    train, val = [], []
    for i, p in enumerate(files):
        (val if i % 10 == 5 else train).append(p.read_bytes())
    out = []
    for chunks in (train, val):
        data = b"\n".join(chunks)[:max_bytes]
        out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
    return out[0], out[1]


def batches(data: torch.Tensor, steps: int, seed: int) -> DataLoader:
    """``steps`` batches of random windows (a fixed stream per seed)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - SEQ - 1, (steps * BATCH,), generator=g)
    windows = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
    return DataLoader(TensorDataset(windows), batch_size=BATCH, shuffle=False)


def val_windows(data: torch.Tensor, n: int) -> torch.Tensor:
    starts = torch.linspace(0, data.numel() - SEQ - 2, n).long()
    return torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor) -> float:
    model.eval()
    losses = []
    for chunk in val.split(64):
        logits = model(chunk[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item())
    model.train()
    return sum(losses) / (val.shape[0] * SEQ)


# ---------------------------------------------------------------------------------------------------- training
class LM(pl.LightningModule):
    """Next-byte LM; lr = warmup then constant, or (``decay``) linear decay to ``LR_END`` over the fit."""

    def __init__(self, model: nn.Module, steps: int, *, warmup: int, decay: bool, opt_state=None, teacher=None,
                 kd_alpha: float = 0.0, make_opt=None, offset: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.model, self.steps, self.warmup, self.decay = model, steps, warmup, decay
        self.offset = offset  # steps of the lr schedule taken by an earlier fit (``gates*``: the gate phase)
        self.opt_state, self.kd_alpha, self.make_opt = opt_state, kd_alpha, make_opt
        self.teacher = [teacher]  # a list: not a submodule (frozen, not optimized, not saved)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        logits = self.model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        if self.kd_alpha and self.teacher[0] is not None:
            with torch.no_grad():
                t_logits = self.teacher[0](x[:, :-1])
            kd = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), log_target=True, reduction="none")
            loss = (1 - self.kd_alpha) * loss + self.kd_alpha * kd.sum(-1).mean()
        return loss

    def configure_optimizers(self):
        opt = self.make_opt(self.model) if self.make_opt else torch.optim.AdamW(self.model.parameters(), lr=LR)
        if self.opt_state is not None:
            opt.load_state_dict(self.opt_state)
            for g in opt.param_groups:
                g["lr"] = LR

        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def factor(self, step: int) -> float:
        """The lr multiplier at ``step`` of this fit."""
        step += self.offset
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.decay:
            return 1.0
        frac = min(step / max(self.steps - 1, 1), 1.0)
        return 1.0 - frac * (1 - LR_END / LR)


def fit(module: LM, loader: DataLoader, callbacks=(), epochs: int = 1) -> None:
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), num_sanity_val_steps=0,
        log_every_n_steps=10**6,
    )  # fmt: skip
    trainer.fit(module, loader)


def small_config() -> TinyGPTConfig:
    keep = 1 - SPARSITY
    if CLUSTERS == "residual":
        return dataclasses.replace(CFG, d_model=int(CFG.d_model * keep), head_dim=CFG.hd)
    return dataclasses.replace(CFG, d_ff=int(CFG.d_ff * keep), n_head=int(CFG.n_head * keep),
                               n_kv_head=int(CFG.n_kv_head * keep), head_dim=CFG.hd)  # fmt: skip


def active_params(model: nn.Module) -> int:
    """Parameters that are not exactly zero (a tied embedding counts once)."""
    return sum(int(p.count_nonzero()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- variants
def clusters_for(model: nn.Module, *, shared_heads: bool = False, shared_mlp: bool = False):
    out = []
    residual = CLUSTERS == "residual"
    for c in demo_preset.tiny_gpt(model, mlp=not residual, heads=not residual, residual=residual):
        if (shared_heads and c.name.startswith("heads")) or (shared_mlp and c.name.startswith("mlp")):
            c = dataclasses.replace(c, budget=c.name.split(".")[0])
        out.append(c)
    return out


class ActivationScore(pl.Callback):
    """Benchmark-side activation-aware score: EMA of per-unit mean squared activation x reader column norm.

    Patches the pruning callback's ``Pruner._scores`` (the library's score hook) after it is built; the unit
    importance becomes ``sqrt(E[a_c^2]) * ||W_reader[:, c]||`` (MLP: the SwiGLU product feeding ``down_proj``;
    heads: the attention output feeding ``o_proj``), the first-order output contribution of the unit.
    """

    def __init__(self, pat: CoupledPruningCallback, beta: float = 0.9) -> None:
        self.pat, self.beta, self.ema, self.handles = pat, beta, {}, []

    def on_fit_start(self, trainer, pl_module):
        m = pl_module.model
        for i, block in enumerate(m.layers):
            self._hook(block.mlp.down_proj, f"mlp.{i}", 1)
            self._hook(block.attn.o_proj, f"heads.{i}", CFG.hd)
        pruner = self.pat.pruner
        readers = {f"mlp.{i}": b.mlp.down_proj.weight for i, b in enumerate(m.layers)}
        readers.update({f"heads.{i}": b.attn.o_proj.weight for i, b in enumerate(m.layers)})

        def scores(q):
            out = {}
            for rc in pruner.clusters:
                w = readers[rc.name].detach()
                col = w.pow(2).sum(0)
                block = col.numel() // rc.num_units
                col = col.view(rc.num_units, block).sum(1)
                act = self.ema.get(rc.name, torch.ones(rc.num_units))
                out[rc.name] = (act * col).double().sqrt()
            return out

        pruner._scores = lambda q, given=None: scores(q)

    def _hook(self, module: nn.Module, name: str, block: int) -> None:
        def hook(mod, args):
            a = args[0].detach().pow(2).flatten(0, -2).mean(0)
            a = a.view(-1, block).sum(1)
            prev = self.ema.get(name)
            self.ema[name] = a if prev is None else self.beta * prev + (1 - self.beta) * a

        self.handles.append(module.register_forward_pre_hook(hook))

    def on_fit_end(self, trainer, pl_module):
        for h in self.handles:
            h.remove()


def torchao_optimizer(model: nn.Module, R: int):
    from torchao.prototype.pat import PruneOptimizer

    groups: dict[str, list] = {"rows": [], "cols": [], "heads0": [], "heads1": [], "rest": []}
    for name, p in model.named_parameters():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            groups["rows"].append(p)
        elif name.endswith("down_proj.weight"):
            groups["cols"].append(p)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            groups["heads0"].append(p)
        elif name.endswith("o_proj.weight"):
            groups["heads1"].append(p)
        else:
            groups["rest"].append(p)
    common = {"prox_type": "MinSparsityConstraint", "min_sparsity": SPARSITY, "min_sparsity_schedule": True}
    pg = [
        {"params": groups["rows"], "group_type": "Dim0Grouper", **common},
        {"params": groups["cols"], "group_type": "Dim1Grouper", **common},
        {"params": groups["heads0"], "group_type": "AttentionHeadGrouperDim0", "num_heads": CFG.n_head, **common},
        {"params": groups["heads1"], "group_type": "AttentionHeadGrouperDim1", "num_heads": CFG.n_head, **common},
        {"params": groups["rest"]},
    ]
    base = torch.optim.AdamW(pg, lr=LR)
    return PruneOptimizer(base, warmup_steps=0, healing_start_step=max(R // 2, 2))


# ---------------------------------------------------------------------------------------------------- learned gates
#: ``gates*`` hyper-parameters (``--gates key=value,...`` overrides them; tuned on seeds 10-12 only, see BENCHMARKS.md):
#: ``steps`` of the gate phase (of ``R``), the fraction of them over which the target ramps (``ramp``, then held),
#: the Adam lr of the gates' ``log_alpha`` (``lr``) and of the Lagrange multipliers (``lambda_lr``), the initial
#: ``log_alpha`` (``init``: 3 opens a gate with probability ~0.99, deterministic value 1).
GATES: dict[str, float] = {"steps": 50, "ramp": 0.6, "lr": 0.3, "lambda_lr": 0.05, "init": 3.0}


class GateLM(LM):
    """The gate phase of ``gates*``: one hard-concrete gate per MLP channel and per head of every layer, learned
    jointly with the weights under the Lagrangian term that drives each cluster's expected pruned fraction to the
    (ramped) target. The gates multiply the readers' inputs (``down_proj``: the channel; ``o_proj``: the head's
    slice), a fresh sample per training step. ``distill_teacher``: the loss is ``CE + 0.5 * KL(teacher || student)``
    per token (the library's ``distill_alpha=0.5`` at temperature 1, written out here).
    """

    def __init__(self, model: nn.Module, steps: int, *, opt_state, gate_steps: int, teacher: nn.Module | None,
                 hp: dict[str, float]) -> None:  # fmt: skip
        super().__init__(model, steps, warmup=0, decay=True, opt_state=opt_state)
        if CFG.n_kv_head != CFG.n_head or CLUSTERS != "mlp_heads":
            raise ValueError(
                "gates*: one gate per MLP channel and per head needs --clusters mlp_heads and n_kv_head == n_head, got "
                f"--clusters {CLUSTERS}, n_head={CFG.n_head}, n_kv_head={CFG.n_kv_head}"
            )
        self.gate_steps, self.hp, self.distill_teacher = gate_steps, hp, [teacher]
        self.names = [f"mlp.{i}" for i in range(CFG.n_layer)] + [f"heads.{i}" for i in range(CFG.n_layer)]
        sizes = [CFG.d_ff] * CFG.n_layer + [CFG.n_head] * CFG.n_layer
        self.log_alpha = nn.ParameterList(nn.Parameter(torch.full((n,), float(hp["init"]))) for n in sizes)
        self.lagrangian = hard_concrete.Lagrangian(self.names)
        self.z: list[torch.Tensor] = []
        self.trace: list[tuple[int, float, float]] = []  # every 10 steps: (step, expected pruned fraction, target)
        self.handles = []
        for i, block in enumerate(model.layers):
            self.handles.append(block.mlp.down_proj.register_forward_pre_hook(self._gate(i, 1)))
            self.handles.append(block.attn.o_proj.register_forward_pre_hook(self._gate(CFG.n_layer + i, CFG.hd)))

    def _gate(self, k: int, width: int):
        def hook(mod, args):
            z = self.z[k] if self.z else hard_concrete.deterministic_gate(self.log_alpha[k])
            return (args[0] * z.repeat_interleave(width).to(args[0].dtype),)

        return hook

    def remove_gates(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.z = [], []

    def training_step(self, batch, batch_idx):
        x = batch[0]
        self.z = [hard_concrete.sample_gate(a) for a in self.log_alpha]
        logits = self.model(x[:, :-1])
        self.z = []
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        if self.distill_teacher[0] is not None:
            with torch.no_grad():
                t_logits = self.distill_teacher[0](x[:, :-1])
            kd = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), log_target=True, reduction="none")
            loss = loss + 0.5 * kd.sum(-1).mean()
        expected = torch.stack([hard_concrete.expected_sparsity(a) for a in self.log_alpha])
        ramp = max(round(self.hp["ramp"] * self.gate_steps), 1)
        target = hard_concrete.ramped_target(self.global_step, target=SPARSITY, ramp_steps=ramp)
        if self.global_step % 10 == 0:
            self.trace.append((self.global_step, round(float(expected.mean()), 3), round(target, 3)))
        return loss + self.lagrangian(expected, target)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        opt.load_state_dict(self.opt_state)
        for g in opt.param_groups:
            g["lr"] = LR
        opt.add_param_group({"params": list(self.log_alpha), "lr": self.hp["lr"], "weight_decay": 0.0})
        opt.add_param_group({"params": [self.lagrangian.lambdas], "lr": self.hp["lambda_lr"], "weight_decay": 0.0})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [self.factor, lambda s: 1.0, lambda s: 1.0])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@torch.no_grad()
def snap_gates(model: nn.Module, module: GateLM) -> tuple[dict[str, list[int]], dict]:
    """Snap every cluster to its exact top-k by ``log_alpha`` (the library's per-layer count, ``num_to_drop``).

    The kept units' deterministic gates are folded into the reader columns (``down_proj`` column, ``o_proj`` head
    columns); a kept unit whose deterministic gate is 0 is left at its weights' scale (gate 1: folding 0 would kill
    a unit counted as kept). The dropped units are zeroed in all their parameters (the library's mask then holds).

    Returns:
        The dropped units per cluster, and diagnostics: the expected pruned fraction at the snap (mean over clusters),
        the mean folded gate, the kept units reopened from 0, and the dropped units whose gate was still open.
    """
    hd = CFG.hd
    dropped: dict[str, list[int]] = {}
    folded, reopened, cut_open, expected = [], 0, 0, []
    for k, name in enumerate(module.names):
        la = module.log_alpha[k].detach()
        expected.append(float(hard_concrete.expected_sparsity(la)))
        kept, drop = hard_concrete.snap_top_k(la, num_to_drop(SPARSITY, la.numel()))
        z = hard_concrete.deterministic_gate(la)
        reopened += int((z[kept] == 0).sum())
        cut_open += int((z[drop] > 0).sum())
        zk = torch.where(z[kept] > 0, z[kept], torch.ones_like(z[kept]))
        folded.extend(zk.tolist())
        kind, layer = name.split(".")
        block = model.layers[int(layer)]
        if kind == "mlp":
            block.mlp.down_proj.weight[:, kept] *= zk
            block.mlp.gate_proj.weight[drop] = 0
            block.mlp.up_proj.weight[drop] = 0
            block.mlp.down_proj.weight[:, drop] = 0
        else:
            cols = torch.arange(CFG.n_head * hd).view(CFG.n_head, hd)
            block.attn.o_proj.weight[:, cols[kept].flatten()] *= zk.repeat_interleave(hd)
            rows = cols[drop].flatten()
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                proj.weight[rows] = 0
            block.attn.o_proj.weight[:, rows] = 0
        dropped[name] = drop
    info = {"expected_at_snap": round(statistics.mean(expected), 4), "reopened": reopened, "cut_open": cut_open,
            "mean_kept_gate": round(statistics.mean(folded), 4)}  # fmt: skip
    return dropped, info


def run_gates(name: str, seed: int, ckpt, train: torch.Tensor, R: int) -> tuple[nn.Module, list, dict]:
    """``gates`` / ``gates_distill``: the gate phase, the snap, then the rest of ``R`` healing with the mask held.

    Returns:
        The model, the healing callbacks, and the diagnostics of :func:`snap_gates` (with the hyper-parameters).
    """
    weights, opt_state = ckpt
    hp = dict(GATES)
    gate_steps = min(int(hp["steps"]), max(R * 2 // 3, 1))
    windows = batches(train, R, seed=10_000 + seed).dataset.tensors[0]
    phase1 = DataLoader(TensorDataset(windows[: gate_steps * BATCH]), batch_size=BATCH, shuffle=False)
    phase2 = DataLoader(TensorDataset(windows[gate_steps * BATCH :]), batch_size=BATCH, shuffle=False)
    model = TinyGPT(CFG)
    model.load_state_dict(weights)
    dense = None
    if name == "gates_distill":
        dense = TinyGPT(CFG).eval()
        dense.load_state_dict(weights)
        dense.requires_grad_(False)
    gate_module = GateLM(model, R, opt_state=opt_state, gate_steps=gate_steps, teacher=dense, hp=hp)
    fit(gate_module, phase1)
    sd = gate_module.trainer.optimizers[0].state_dict()
    ids = sd["param_groups"][0]["params"]  # the model's group: its AdamW state carries into healing
    state = {i: sd["state"][i] for i in ids if i in sd["state"]}
    model_state = {"state": state, "param_groups": sd["param_groups"][:1]}
    gate_module.remove_gates()
    dropped, info = snap_gates(model, gate_module)
    check = prune_clusters(model, clusters_for(model), SPARSITY)  # the zeroed units are the lowest: the same cut
    if check.dropped != dropped:
        raise RuntimeError(f"gates: the library's cut {check.dropped} differs from the snapped one {dropped}")
    heal: dict = {}
    if dense is not None:
        heal = {"distill_alpha": 0.5, "distill_module": "model", "distill_teacher": dense}
    module = LM(model, R, warmup=0, decay=True, opt_state=model_state, offset=gate_steps)
    cb = CoupledPruningCallback(clusters_for(module), target_sparsity=SPARSITY, ramp_steps=1, score="rms", **heal)
    fit(module, phase2, [cb])
    if cb.dropped != dropped:
        raise RuntimeError(f"gates: healing held {cb.dropped}, not the snapped cut {dropped}")
    info.update(gate_steps=gate_steps, gates=hp, trace=gate_module.trace)
    return model, [cb], info


# name -> dict of callback options (None: a non-callback variant handled in run_variant)
VARIANTS: dict[str, dict | None] = {
    "dense": None,  # (a) dense continues
    "default": {},  # (b) library defaults (ramp_steps=100, cubic, latent, hard, per-layer budgets, score="auto")
    # the weight score: the default of every run recorded before score="auto" (activation wherever it runs) became
    # the default; the knob variants below ("direct", "ramp50", ...) ran with it then and with "auto" since
    "rms": {"score": "rms"},
    "direct": {"mode": "direct"},
    "ramp25": {"ramp_steps": 25},
    "ramp50": {"ramp_steps": 50},
    "ramp150": {"ramp_steps": 150},
    "linear": {"ramp": "linear"},
    "every10": {"every_n_steps": 10},
    "nohealing": {"heal": False},
    "warmup50": {"warmup_steps": 50},
    "lasso1e-2": {"method": "group_lasso", "reg_lambda": 1e-2},
    "lasso5e-2": {"method": "group_lasso", "reg_lambda": 5e-2},
    "lasso1e-1": {"method": "group_lasso", "reg_lambda": 1e-1},
    "lasso1e-3": {"method": "group_lasso", "reg_lambda": 1e-3},
    "lasso1e-2_direct": {"method": "group_lasso", "reg_lambda": 1e-2, "mode": "direct"},
    "lasso1e-1_direct": {"method": "group_lasso", "reg_lambda": 1e-1, "mode": "direct"},
    # the benchmark-side fixes of eacc1b9, now what the library does (kept so that old commands still run)
    "steplasso1e-1_direct": {"method": "group_lasso", "reg_lambda": 1e-1, "mode": "direct"},
    "floorlasso1e-1": {"method": "group_lasso", "reg_lambda": 1e-1},
    "cut_at_50": {"warmup_steps": 50, "ramp_steps": 1},  # diagnostic: one-shot cut after 50 dense steps
    "steplasso1_direct": {"method": "group_lasso", "reg_lambda": 1.0, "mode": "direct"},
    "shared_heads": {"shared_heads": True},
    "shared_heads_l2": {"shared_heads": True, "score": "l2"},
    "shared_all": {"shared_heads": True, "shared_mlp": True},
    "act": {"score": "activation"},
    "act_direct": {"score": "activation", "mode": "direct"},
    "act_ramp50": {"score": "activation", "ramp_steps": 50},
    "taylor": {"score": "taylor"},  # first-order |w * g| per unit, summed over the steps between selections
    "act_patch": {"act": True},  # cross-check: the benchmark-side score of eacc1b9
    "kd": {"kd": 0.5},
    # the library's distillation (CoupledPruningCallback(distill_alpha=...)): CE + alpha * T^2 * KL from the frozen copy
    # of the model at the pruning start (here: the checkpoint), added through the logits' gradient
    "distill": {"distill_alpha": 0.5, "distill_module": "model"},
    "distill_t2": {"distill_alpha": 0.5, "distill_temperature": 2.0, "distill_module": "model"},
    # the strong recipe of issue 16 on both sides: the activation score and the library's distillation from the dense
    # checkpoint; in training (the ramp) vs one-shot (calibrate, prune once, then heal with the same distillation)
    "act_distill": {"score": "activation", "distill_alpha": 0.5, "distill_module": "model"},
    "oneshot_act_distill": None,
    # the OneShotPruningCallback recipe as users run it (ramp_steps=1, activation score, distill_alpha=0.5): the cut at
    # the first step from one batch's statistics, or after 8 dense steps of the budget (their statistics)
    "recipe": {"ramp_steps": 1, "score": "activation", "distill_alpha": 0.5, "distill_module": "model"},
    "recipe_w8": {
        "warmup_steps": 8,
        "ramp_steps": 1,
        "score": "activation",
        "distill_alpha": 0.5,
        "distill_module": "model",
    },  # fmt: skip
    # learned hard-concrete gates with a Lagrangian (Sheared-LLaMA), snapped to the exact per-layer top-k, then healing
    # with the mask held (``gates_distill``: the library's distillation from the dense checkpoint in both phases)
    "gates": None,
    "gates_distill": None,
    "oneshot": None,  # (c) prune_clusters at the final target, then R steps with the mask held
    "oneshot_kd": None,
    "oneshot_act": None,
    "scratch_R": None,  # (d) the small model from scratch, R steps
    "scratch_MR": None,  # (d) the small model from scratch, M + R steps
    "modelpruning": None,  # (e) Lightning ModelPruning, ln_structured rows per tensor
    "torchao": None,  # (f) torchao PruneOptimizer, per tensor MinSparsityConstraint (rows/cols/heads)
}


#: The variants of the recorded table (the others in VARIANTS are extra knobs, run with --variants all).
DEFAULT_SET = ["dense", "default", "oneshot", "scratch_R", "kd", "oneshot_kd", "lasso1e-2", "lasso1e-2_direct",
               "scratch_MR", "act", "act_direct", "act_ramp50", "oneshot_act", "shared_heads", "ramp50", "direct",
               "modelpruning", "torchao"]  # fmt: skip


def run_variant(name: str, seed: int, ckpt, data, M: int, R: int) -> dict:
    train, val = data
    weights, opt_state = ckpt
    t0 = time.time()
    torch.manual_seed(seed)  # the same global RNG state for every variant, whatever ran before in the process
    loader = batches(train, R, seed=10_000 + seed)
    model = TinyGPT(CFG)
    model.load_state_dict(weights)
    teacher = None
    opts = VARIANTS.get(name)
    kd = 0.0
    if (opts and "kd" in opts) or name == "oneshot_kd":
        teacher = TinyGPT(CFG).eval()
        teacher.load_state_dict(weights)
        teacher.requires_grad_(False)
        kd = opts.get("kd", 0.5) if opts else 0.5
    module = LM(model, R, warmup=0, decay=True, opt_state=opt_state, teacher=teacher, kd_alpha=kd)
    callbacks: list = []
    if opts is not None:
        opts = dict(opts)
        opts.pop("kd", None)
        act = opts.pop("act", False)
        shared = {k: opts.pop(k) for k in ("shared_heads", "shared_mlp") if k in opts}
        cb = CoupledPruningCallback(clusters_for(module, **shared), target_sparsity=SPARSITY, **opts)
        callbacks = [cb] + ([ActivationScore(cb)] if act else [])
    elif name.startswith("gates"):
        model, callbacks, info = run_gates(name, seed, ckpt, train, R)
        row = _result(name, seed, model, val, t0)
        row.update(info, same_units=_same_units(weights, callbacks[0].dropped, {}))
        return row
    elif name.startswith("oneshot"):
        if name.startswith("oneshot_act"):  # calibration on 8 training batches, one selection, then R steps
            calib = [b[0][:, :-1] for b in batches(train, 8, seed=20_000 + seed)]
            stats = calibrate(model, clusters_for(model), calib)
            prune_clusters(model, clusters_for(model), SPARSITY, score="activation", activations=stats)
        else:
            prune_clusters(model, clusters_for(model), SPARSITY)
        # the mask is held by the callback in healing from its first step (ramp_steps=1 re-selects the same
        # units: the pruned ones are exact zeros, the lowest score)
        heal: dict = {}
        if name == "oneshot_act_distill":  # heal with the distillation of act_distill, from the dense checkpoint
            dense = TinyGPT(CFG)
            dense.load_state_dict(weights)
            heal = {"distill_alpha": 0.5, "distill_module": "model", "distill_teacher": dense}
        callbacks = [
            CoupledPruningCallback(clusters_for(module), target_sparsity=SPARSITY, ramp_steps=1, score="rms", **heal)
        ]
    elif name.startswith("scratch"):
        torch.manual_seed(seed)
        steps = R if name == "scratch_R" else M + R
        model = TinyGPT(small_config())
        if name == "scratch_R":
            module = LM(model, steps, warmup=WARMUP, decay=True)
            fit(module, batches(train, steps, seed=30_000 + seed))
        else:  # same stream and recipe as the dense run, then the same R batches as the other variants
            module = LM(model, M, warmup=WARMUP, decay=False)
            fit(module, batches(train, M, seed=seed))
            module = LM(model, R, warmup=0, decay=True, opt_state=module.trainer.optimizers[0].state_dict())
            fit(module, loader)
        return _result(name, seed, model, val, t0)
    elif name == "modelpruning":
        from lightning.pytorch.callbacks import ModelPruning

        linears = [(m, "weight") for n, m in module.model.named_modules() if isinstance(m, nn.Linear) and "layers" in n]
        quarter = max(R // 4, 1)
        callbacks = [ModelPruning("ln_structured", parameters_to_prune=linears, amount=SPARSITY, pruning_dim=0,
                                  pruning_norm=2, apply_pruning=lambda epoch: epoch == 0, use_global_unstructured=False,
                                  make_pruning_permanent=True, verbose=0)]  # fmt: skip
        loaders = batches(train, quarter * 4, seed=10_000 + seed)
        module.steps = quarter * 4
        trainer = pl.Trainer(max_epochs=4, limit_train_batches=quarter, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks, log_every_n_steps=10**6)  # fmt: skip
        # epoch e sees batches [e*quarter, (e+1)*quarter) only if the loader is re-sliced; Lightning restarts it
        trainer.fit(module, _Epochs(loaders, quarter))
        return _result(name, seed, module.model, val, t0)
    elif name == "torchao":
        try:
            module = LM(model, R, warmup=0, decay=True, make_opt=lambda m: torchao_optimizer(m, R))
            fit(module, loader)
        except Exception as err:  # noqa: BLE001
            return {"variant": name, "seed": seed, "error": f"{type(err).__name__}: {err}"[:200]}
        return _result(name, seed, model, val, t0)
    fit(module, loader, callbacks)
    row = _result(name, seed, model, val, t0)
    if opts is not None:
        row["same_units"] = _same_units(weights, callbacks[0].dropped, shared)
    return row


def _same_units(weights: dict, final: dict[str, list[int]], shared: dict) -> float:
    """How many of the finally dropped units one-shot pruning (rms) of the checkpoint also drops."""
    ref = TinyGPT(CFG)
    ref.load_state_dict(weights)
    oneshot = prune_clusters(ref, clusters_for(ref, **shared), SPARSITY).dropped
    same = sum(len(set(final[k]) & set(oneshot[k])) for k in oneshot)
    return round(same / max(sum(len(v) for v in oneshot.values()), 1), 3)


class _Epochs:
    """Iterate a loader in consecutive slices of ``n`` batches, one slice per epoch (continuing, not restarting)."""

    def __init__(self, loader: DataLoader, n: int) -> None:
        self.batches, self.n, self.epoch = list(loader), n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        part = self.batches[self.epoch * self.n : (self.epoch + 1) * self.n]
        self.epoch += 1
        return iter(part)


def _result(name: str, seed: int, model: nn.Module, val: torch.Tensor, t0: float) -> dict:
    return {"variant": name, "seed": seed, "val": evaluate(model, val), "active": active_params(model),
            "secs": round(time.time() - t0, 1)}  # fmt: skip


def dense_checkpoint(seed: int, train: torch.Tensor, M: int, cache: Path | None):
    tag = "" if MODEL == "small" else f"_{MODEL}"  # the small model keeps the cache names of the recorded runs
    path = cache / f"dense_seed{seed}_M{M}{tag}.pt" if cache else None
    if path is not None and path.exists():
        return torch.load(path)
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    module = LM(model, M, warmup=WARMUP, decay=False)
    fit(module, batches(train, M, seed=seed))
    ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(module.trainer.optimizers[0].state_dict()))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ckpt, path)
    return ckpt


# ---------------------------------------------------------------------------------------------------- table
def table(rows: list[dict], M: int, R: int, ref_name: str = "oneshot") -> str:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    ref = by.get(ref_name)
    ref_mean = statistics.mean(r["val"] for r in ref) if ref else None
    head = "one-shot" if ref_name == "oneshot" else ref_name
    lines = [
        f"| variant | seeds | val loss mean ± std | min - max | minus {head} (paired) | active | same units | s/run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in [v for v in VARIANTS if v in by] + [v for v in by if v not in VARIANTS]:
        rs = [r for r in by[name] if "val" in r]
        if not rs:
            lines.append(f"| {name} | 0 | {by[name][0].get('error', 'failed')} | | | | | |")
            continue
        vals = [r["val"] for r in rs]
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        diff = ""
        if ref_mean is not None:
            ref_by_seed = {r["seed"]: r["val"] for r in ref}
            d = [r["val"] - ref_by_seed[r["seed"]] for r in rs if r["seed"] in ref_by_seed]
            if d:
                dsd = statistics.stdev(d) if len(d) > 1 else float("nan")
                diff = f"{statistics.mean(d):+.4f} ± {dsd:.4f}"
        act = statistics.mean(r["active"] for r in rs)
        same = [r["same_units"] for r in rs if "same_units" in r]
        same_s = f"{statistics.mean(same):.0%}" if same else ""
        secs = statistics.mean(r["secs"] for r in rs)
        lines.append(f"| {name} | {len(rs)} | {statistics.mean(vals):.4f} ± {sd:.4f} | {min(vals):.4f} - "
                     f"{max(vals):.4f} | {diff} | {act / 1e3:.0f}k | {same_s} | {secs:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _isolated(name: str, seed: int, args: argparse.Namespace) -> dict:
    """One (variant, seed) in a fresh process with the same options (the dense checkpoint comes from ``--cache``).

    Within one process a run's result depends, at the float-rounding level, on what ran before it (measured: the
    same variant and seed after another variant differ by 1e-4 to 3e-2 nats, CPU kernels and allocation history;
    not the RNG), so a table from one process depends on the variant order; a fresh process per run does not.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.jsonl"
        cmd = [sys.executable, __file__, "--M", str(args.M), "--R", str(args.R), "--seeds", str(seed),
               "--variants", name, "--jsonl", str(out), "--val-windows", str(args.val_windows),
               "--sparsity", str(args.sparsity), "--model", args.model, "--clusters", args.clusters,
               "--gates", args.gates]  # fmt: skip
        if args.cache:
            cmd += ["--cache", str(args.cache)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text().splitlines()[-1])


def main() -> None:
    global SPARSITY, CFG, MODEL, CLUSTERS  # noqa: PLW0603 - the module's knobs of the model and pruned size (every variant reads them)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--M", type=int, default=500, help="dense steps before pruning")
    parser.add_argument("--R", type=int, default=150, help="steps of the pruning / recovery budget")
    parser.add_argument(
        "--variants",
        default="main",
        help="comma list of VARIANTS keys ('default' is the defaults' variant), 'main' or 'all'",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: M=20, R=12, 1 seed, few variants")
    parser.add_argument("--jsonl", type=Path, default=None, help="append each run's result here")
    parser.add_argument("--cache", type=Path, default=None, help="keep dense checkpoints here")
    parser.add_argument("--table", type=Path, default=None, help="only print the table of a results file")
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument(
        "--sparsity", type=float, default=SPARSITY, help="fraction of MLP channels and heads removed per layer"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="the TinyGPT size (see MODELS)")
    parser.add_argument(
        "--clusters", choices=("mlp_heads", "residual"), default="mlp_heads", help="what is pruned (see CLUSTERS)"
    )
    parser.add_argument(
        "--gates", default="", help="override GATES for the gates* variants: key=value,... (tune on seeds 10-12 only)"
    )
    parser.add_argument("--ref", default="oneshot", help="the variant of the paired-difference column (--table)")
    parser.add_argument(
        "--isolate", action="store_true", help="run every (variant, seed) in a fresh process (order-independent)"
    )
    args = parser.parse_args()
    SPARSITY, CFG, MODEL, CLUSTERS = args.sparsity, MODELS[args.model], args.model, args.clusters
    for item in filter(None, args.gates.split(",")):
        key, _, value = item.partition("=")
        if key not in GATES:
            parser.error(f"--gates: unknown key {key!r}; expected some of {sorted(GATES)}")
        GATES[key] = float(value)
    if args.isolate and args.cache is None:
        parser.error("--isolate needs --cache (each fresh process loads the dense checkpoint from there)")
    if args.table:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        print(table(rows, args.M, args.R, args.ref))
        return
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_pat").setLevel(logging.ERROR)
    variants = DEFAULT_SET if args.variants == "main" else args.variants.split(",")
    variants = list(VARIANTS) if args.variants == "all" else variants
    if args.quick:
        args.M, args.R, args.seeds, args.val_windows = 20, 12, args.seeds[:1], 16
        variants = (
            variants
            if args.variants not in ("all", "main")
            else ["dense", "default", "oneshot", "scratch_R", "kd", "act"]
        )
    train, val = corpus()
    val = val_windows(val, args.val_windows)
    rows = []
    for seed in args.seeds:
        t0 = time.time()
        ckpt = dense_checkpoint(seed, train, args.M, args.cache)
        print(f"seed {seed}: dense checkpoint ({args.M} steps) in {time.time() - t0:.0f}s", flush=True)
        for name in variants:
            if args.isolate:
                row = _isolated(name, seed, args)
            else:
                row = run_variant(name, seed, ckpt, (train, val), args.M, args.R)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    n = sum(p.numel() for p in TinyGPT(CFG).parameters())
    print(f"\nTinyGPT {n / 1e3:.0f}k params, M={args.M}, R={args.R}, seeds {args.seeds}, "
          f"target {SPARSITY:.0%} of " + ("the residual channels" if CLUSTERS == "residual" else
          "MLP channels and heads per layer") + "\n")  # fmt: skip
    print(table(rows, args.M, args.R))


if __name__ == "__main__":
    main()
