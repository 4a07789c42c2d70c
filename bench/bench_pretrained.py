"""A real pretrained LM (SmolLM2-135M-Instruct) pruned to ~75% and ~50% of its parameters: ours vs the peers.

    python bench/bench_pretrained.py --quick                          # seconds: a tiny random Llama, byte tokens
    python bench/bench_pretrained.py --steps 0                        # every arm one-shot (no healing), both sizes
    python bench/bench_pretrained.py --steps 64 --arms act,tp_mag --sizes 0.75 --seeds 0,1,2 --jsonl runs.jsonl
    python bench/bench_pretrained.py --table runs.jsonl               # the table of stored runs
    python bench/bench_pretrained.py --device cuda --steps 4000 ...   # on a GPU (see bench/gpu_pretrained.py)

Every arm of every size and seed runs in a fresh process (``--one``, spawned by the driver), which appends one JSON
line to ``--jsonl``; the table is printed from those lines, so runs started separately combine (``--quick`` runs
its arms in the driver's process: it checks the code paths, not the numbers).

Model: ``lightning_pat.lm.smollm2_dir()`` (fp32; 30 layers, hidden 576, 9 query / 3 KV heads, MLP 1536, tied
embeddings, 134.5M parameters). Data, tokenized with its tokenizer:

* code: the Python standard library's top-level ``*.py`` files, sorted; every 10th file (index 5 mod 10) held out.
  Held-out metric: mean next-token loss over 64 fixed windows of 128 predicted tokens (evenly spaced starts).
* English: the text of ``pydoc_data.topics`` (the language reference shipped with Python), topics sorted, every
  4th (index 1 mod 4) held out; the same metric.
* training stream (healing and every calibration): windows of 128 tokens, 3 of 4 from the training code, 1 of 4
  from the training English, at random starts drawn from ``--data-seed`` (the same order for every arm; ``--seeds``
  vary only the data order). Calibration: 8 batches of 4 windows drawn from the same stream by a fixed generator.

Arms (``--arms``; each cuts to ``--sizes`` of the dense parameter count, then heals ``--steps`` steps of
``--batch`` x 128 tokens with the same recipe, see :func:`heal`):

ours, through the public API only:

* ``act``: the recommended one-shot: ``calibrate`` + ``prune_clusters(score="activation", target_params=...)`` on
  the ``llama`` preset (MLP channels and heads), ``shrink``.
* ``act_mlp``: the same on the MLP channels only; ``act_ranked``: the MLP with per-layer widths
  (``target_widths="ranked"``); ``act_q``: MLP channels and query heads inside the GQA groups
  (``presets.llama(query_heads=True)``: every group keeps the same number, k/v untouched).
* ``act_refit`` (and ``act_mlp_refit``, ``act_ranked_refit``, ``act_q_refit``, ``act_q_ranked_refit``): the same
  cut, then ``lightning_pat.pruning.repair.refit_readers``: the readers of every cut cluster refit by least squares on
  the calibration data, so that each layer's output matches the dense one (no training).
* ``act_mlp_bias``: ``act_mlp``'s cut with FLAP-style mean compensation instead of the refit (bench-side: a bias
  ``W[:, D] E[x_D]`` on each ``down_proj``, evaluated in memory; a stock Llama has no such bias).
* ``mix_refit``: MLP channels and whole layers together (``layers=True``; the solver balances depth and width),
  activation scores and layer cosines, readers refit.
* ``dense_heal``: the control: the dense model, not cut, healed with the same tokens and recipe (teacher: its own
  starting copy). Healing on this stream is also in-domain fine-tuning, so "vs dense" of a healed arm mixes the
  repair of the cut with what the data alone gives; the difference to ``dense_heal`` is the cut's cost.
* ``depth``: whole layers only (``preset_options={"layers": True}``), ranked by ``calibrate_layers`` cosines.
* ``ramp``: ``CoupledPruningCallback(target_params=..., distill_alpha=...)`` during the healing steps (the ramp over
  the first third, activation score from the training forwards), then ``shrink``.

peers, at the same size and with the same healing:

* ``tp_mag`` / ``tp_taylor``: Torch-Pruning 1.6.1 (``MetaPruner``, ``GroupMagnitudeImportance`` /
  ``GroupTaylorImportance`` with gradients of the calibration batches) on every layer's MLP channels at one ratio,
  bisected to the size (its LLM example's hidden-size and head pruning never finished building its groups on this
  transformers Llama: see :func:`torch_pruning`).
* ``llmpruner``: LLM-Pruner's block-wise one-shot, written here from the paper: first-order Taylor importance
  ``|w * dL/dw|`` per weight (gradients of the LM loss on the calibration batches), summed over each coupled group
  (an MLP channel's gate/up rows and down column; a GQA group's q/k/v rows and o columns), the same ratio of MLP
  channels and groups removed in layers 4-27 (the first 4 and the last 2 kept, as the paper keeps LLaMA's), the
  ratio bisected to the size.
* ``shortgpt``: ShortGPT, written here: Block Influence ``1 - mean cos(h_in, h_out)`` per layer on the calibration
  batches, the lowest layers removed.
* ``scratch``: the model with ``act``'s shape, randomly initialised, trained on the same tokens with the same recipe.

Healing (every arm the same): AdamW (``--lr``, betas 0.9/0.95, wd 0), linear warmup over 10% of the steps then
cosine to 10%, loss ``CE + alpha * T^2 * KL(teacher || student)`` with the dense model as teacher
(``--alpha``, ``--temperature``; ``--alpha 0`` heals with CE alone). The ``ramp`` arm gets the same term from the
library's ``distill_alpha``/``distill_temperature``; ``scratch`` uses ``--scratch-lr``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 128
EVAL_WINDOWS = 64
CALIB_BATCHES, CALIB_BATCH = 8, 4
PROMPTS = ("The capital of France is", "def fibonacci(n):")
LLMPRUNER_SKIP = (4, 2)  # layers of 32 kept whole at the start and at the end (LLM-Pruner on LLaMA-7B)


# ---------------------------------------------------------------------------------------------------- model and data
@dataclass
class Setup:
    """What every arm shares: the dense model's loader, the token streams and the device."""

    quick: bool
    device: torch.device
    vocab: int
    train_code: torch.Tensor
    train_eng: torch.Tensor
    val_code: torch.Tensor  # [EVAL_WINDOWS, SEQ + 1]
    val_eng: torch.Tensor
    tokenizer: object | None

    def dense(self) -> nn.Module:
        """A fresh copy of the dense model on the device, in eval mode."""
        if self.quick:
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(1234)
            cfg = LlamaConfig(
                vocab_size=self.vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ + 8,
                tie_word_embeddings=True,
            )  # fmt: skip
            model = LlamaForCausalLM(cfg)
        else:
            from transformers import AutoModelForCausalLM

            from lightning_pat.lm import smollm2_dir

            model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
        return model.to(self.device).eval()


def _stdlib_files() -> tuple[list[str], list[str]]:
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())
    train, val = [], []
    for i, p in enumerate(files):
        (val if i % 10 == 5 else train).append(p.read_text(encoding="utf-8", errors="replace"))
    return train, val


def _topics() -> tuple[list[str], list[str]]:
    from pydoc_data.topics import topics

    train, val = [], []
    for i, key in enumerate(sorted(topics)):
        (val if i % 4 == 1 else train).append(topics[key])
    return train, val


def _windows(tokens: torch.Tensor, n: int) -> torch.Tensor:
    starts = torch.linspace(0, tokens.numel() - SEQ - 2, n).long()
    return torch.stack([tokens[s : s + SEQ + 1] for s in starts.tolist()])


def load_setup(*, quick: bool, device: str, code_bytes: int = 3_000_000) -> Setup:
    """Tokenize the corpora (cached next to the model for the real tokenizer) and fix the held-out windows."""
    code_train, code_val = _stdlib_files()
    eng_train, eng_val = _topics()
    if quick:
        # byte tokens and a small slice: seconds, nothing to download
        def enc(texts: list[str], limit: int) -> torch.Tensor:
            data = "\n".join(texts).encode("utf-8")[:limit]
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

        streams = [enc(code_train, 200_000), enc(eng_train, 100_000), enc(code_val, 50_000), enc(eng_val, 50_000)]
        return Setup(True, torch.device(device), 256, *streams[:2], *(_windows(s, EVAL_WINDOWS) for s in streams[2:]),
                     tokenizer=None)  # fmt: skip
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from lightning_pat.lm import smollm2_dir

    directory = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    cache = directory.parent / f"bench_pretrained_tokens_{code_bytes}.safetensors"
    names = ("train_code", "train_eng", "val_code", "val_eng")
    if cache.is_file():
        tensors = load_file(str(cache))
        streams = [tensors[k] for k in names]
    else:

        def enc(texts: list[str], limit: int | None = None) -> torch.Tensor:
            text = "\n".join(texts)
            text = text[:limit] if limit else text
            return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)

        streams = [enc(code_train, code_bytes), enc(eng_train), enc(code_val, 600_000), enc(eng_val)]
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        save_file(dict(zip(names, streams, strict=True)), str(tmp))
        os.replace(tmp, cache)
    return Setup(False, torch.device(device), len(tokenizer), streams[0], streams[1],
                 _windows(streams[2], EVAL_WINDOWS), _windows(streams[3], EVAL_WINDOWS), tokenizer)  # fmt: skip


def stream(setup: Setup, n_windows: int, seed: int) -> torch.Tensor:
    """``n_windows`` training windows of ``SEQ + 1`` tokens: 3 of 4 code, 1 of 4 English, random starts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_windows):
        data = setup.train_eng if i % 4 == 3 else setup.train_code
        s = int(torch.randint(0, data.numel() - SEQ - 1, (1,), generator=g))
        out.append(data[s : s + SEQ + 1])
    return torch.stack(out) if out else torch.empty(0, SEQ + 1, dtype=torch.long)


def calib_batches(setup: Setup) -> list[torch.Tensor]:
    """The calibration batches every arm uses (inputs only: ``[CALIB_BATCH, SEQ]``)."""
    w = stream(setup, CALIB_BATCHES * CALIB_BATCH, seed=10_000)
    return [b[:, :-1].to(setup.device) for b in w.split(CALIB_BATCH)]


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, device: torch.device, chunk: int = 8) -> float:
    """Mean next-token loss (nats) over the windows' last ``SEQ`` tokens."""
    was = model.training
    model.eval()
    total = 0.0
    for part in windows.split(chunk):
        part = part.to(device)
        logits = model(part[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), part[:, 1:].flatten(), reduction="sum").item()
    model.train(was)
    return total / (windows.shape[0] * SEQ)


@torch.no_grad()
def samples(model: nn.Module, setup: Setup, new_tokens: int = 20) -> dict[str, str]:
    """Greedy continuations of the prompts (empty in the quick mode: no tokenizer)."""
    if setup.tokenizer is None:
        return {}
    model.eval()
    out = {}
    for prompt in PROMPTS:
        ids = setup.tokenizer(prompt, return_tensors="pt")["input_ids"].to(setup.device)
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=setup.tokenizer.eos_token_id)
        out[prompt] = setup.tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    return out


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def lm_forward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).logits


# ---------------------------------------------------------------------------------------------------- healing
def lr_factor(step: int, steps: int) -> float:
    """Linear warmup over 10% of the steps, then cosine from 1 to 0.1."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0)))


def kd_term(logits: torch.Tensor, t_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * mean_tokens KL(softmax(t / T) || softmax(s / T))``."""
    s = F.log_softmax(logits.float() / temperature, -1)
    t = F.log_softmax(t_logits.float() / temperature, -1)
    return temperature**2 * F.kl_div(s, t, log_target=True, reduction="none").sum(-1).mean()


def heal(model: nn.Module, teacher: nn.Module | None, setup: Setup, args: argparse.Namespace, *,
         lr: float | None = None, callbacks: Iterable = (), kd: bool = True) -> dict:  # fmt: skip
    """Train ``model`` for ``args.steps`` steps on the fixed stream (Lightning, one device); the step times."""
    import lightning.pytorch as pl

    steps, lr = args.steps, lr if lr is not None else args.lr
    if steps <= 0:
        return {"heal_s": 0.0, "step_s": 0.0}
    windows = stream(setup, steps * args.batch, seed=args.data_seed + args.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(windows), batch_size=args.batch)
    alpha = args.alpha if kd else 0.0

    class Heal(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.teacher = [teacher]  # not a submodule: frozen, not optimized, not saved
            self.times: list[float] = []
            self.curve: list[list[float]] = []

        def training_step(self, batch, batch_idx):
            x = batch[0]
            logits = self.model(x[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            if alpha and self.teacher[0] is not None:
                with torch.no_grad():
                    t_logits = self.teacher[0](x[:, :-1]).logits
                loss = loss + alpha * kd_term(logits, t_logits, args.temperature)
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if setup.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            done = batch_idx + 1
            if args.curve and done % args.curve == 0 and done < steps:  # the held-out code loss along the way
                code = evaluate(self.model, setup.val_code, setup.device)
                self.curve.append([done * args.batch * SEQ, code])
                print(f"# curve: {done} steps, {done * args.batch * SEQ} tokens: code {code:.3f}", flush=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Heal()
    model.train()
    trainer = pl.Trainer(
        max_steps=steps, accelerator=setup.device.type, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), num_sanity_val_steps=0,
        log_every_n_steps=10**6, precision=args.precision,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    model.to(setup.device).eval()  # Lightning's teardown moves the module back to the CPU
    out: dict = {"heal_s": time.perf_counter() - t0, "step_s": statistics.median(module.times)}
    if module.curve:
        out["curve"] = module.curve
    return out


# ---------------------------------------------------------------------------------------------------- our arms
def target(dense_params: int, size: float) -> int:
    return int(dense_params * size)


def ours_oneshot(model: nn.Module, setup: Setup, size: float, *, kinds: str, ranked: bool, refit: bool) -> dict:
    """``calibrate`` + ``prune_clusters(score="activation")`` (+ ``refit_readers``) + ``shrink``."""
    from lightning_pat import presets, prune_clusters, shrink
    from lightning_pat.scoring.activation import calibrate

    decls = presets.llama(model, mlp=True, heads=kinds != "mlp", query_heads=kinds == "mlp_qheads")
    batches = calib_batches(setup)
    stats = calibrate(model, decls, batches, forward=lm_forward)
    grams = None
    if refit:
        from lightning_pat.pruning.repair import calibrate_readers

        grams = calibrate_readers(model, decls, batches, forward=lm_forward)
    result = prune_clusters(
        model, decls, target_params=target(setup_params(model), size), score="activation", activations=stats,
        target_widths="ranked" if ranked else "uniform",
    )  # fmt: skip
    if refit:
        from lightning_pat.pruning.repair import refit_readers

        refit_readers(model, result, grams)
    shrink(model, result)
    return {"widths": widths(model)}


def flap_bias(model: nn.Module, setup: Setup, size: float) -> dict:
    """FLAP-style mean compensation (bench-side): ``act_mlp``'s cut, then each ``down_proj`` gets the bias
    ``W[:, D] E[x_D]`` (its dropped channels' mean contribution on the calibration batches). Evaluated in memory: a
    stock Llama has no ``down_proj`` bias (``mlp_bias=True`` would add gate/up biases too)."""
    from lightning_pat import presets, prune_clusters, shrink
    from lightning_pat.scoring.activation import calibrate

    decls = presets.llama(model, mlp=True, heads=False)
    batches = calib_batches(setup)
    downs = [layer.mlp.down_proj for layer in model.model.layers]
    sums = [torch.zeros(d.in_features, dtype=torch.float64) for d in downs]
    rows = [0]

    def hook(i: int):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            sums[i] += x.double().sum(0).cpu()
            if i == 0:
                rows[0] += x.shape[0]

        return fn

    handles = [d.register_forward_pre_hook(hook(i)) for i, d in enumerate(downs)]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()
    dense_w = [d.weight.detach().clone() for d in downs]
    stats = calibrate(model, decls, batches, forward=lm_forward)
    result = prune_clusters(
        model, decls, target_params=target(setup_params(model), size), score="activation", activations=stats
    )
    with torch.no_grad():
        for i, d in enumerate(downs):
            drop = torch.tensor(result.dropped[f"mlp.{i}"], dtype=torch.long)
            mean = (sums[i] / rows[0])[drop].to(dense_w[i].dtype)
            d.bias = nn.Parameter(dense_w[i][:, drop.to(d.weight.device)] @ mean.to(d.weight.device))
    shrink(model, result)
    return {"widths": widths(model)}


def ours_mix(model: nn.Module, setup: Setup, size: float) -> dict:
    """MLP channels and whole layers together (``layers=True``), activation + layer cosines, readers refit."""
    from lightning_pat import presets, prune_clusters, shrink
    from lightning_pat.pruning.repair import calibrate_readers, refit_readers
    from lightning_pat.scoring.activation import calibrate
    from lightning_pat.scoring.layers import calibrate_layers

    decls = presets.llama(model, mlp=True, heads=False, layers=True)
    batches = calib_batches(setup)
    stats = calibrate(model, decls, batches, forward=lm_forward)
    layer_stats = calibrate_layers(model, decls, batches, forward=lm_forward)
    grams = calibrate_readers(model, decls, batches, forward=lm_forward)
    result = prune_clusters(
        model, decls, target_params=target(setup_params(model), size), score="activation", activations=stats,
        layer_stats=layer_stats,
    )  # fmt: skip
    refit_readers(model, result, grams)
    shrink(model, result)
    return {"widths": widths(model)}


def ours_depth(model: nn.Module, setup: Setup, size: float) -> dict:
    from lightning_pat import presets, prune_clusters, shrink
    from lightning_pat.scoring.layers import calibrate_layers

    decls = presets.llama(model, mlp=False, heads=False, layers=True)
    stats = calibrate_layers(model, decls, calib_batches(setup), forward=lm_forward)
    result = prune_clusters(model, decls, target_params=target(setup_params(model), size), layer_stats=stats)
    shrink(model, result)
    return {"widths": widths(model)}


_DENSE_PARAMS: list[int] = []


def setup_params(model: nn.Module) -> int:
    """The dense parameter count (recorded once, before any cut)."""
    if not _DENSE_PARAMS:
        _DENSE_PARAMS.append(n_params(model))
    return _DENSE_PARAMS[0]


def widths(model: nn.Module) -> dict:
    layers = model.model.layers
    mlp = [layer.mlp.down_proj.in_features for layer in layers]
    q = [layer.self_attn.q_proj.out_features // layer.self_attn.head_dim for layer in layers]
    kv = [layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in layers]
    hidden = model.model.embed_tokens.embedding_dim

    def short(v: list[int]) -> object:
        return v[0] if len(set(v)) == 1 else v

    return {"layers": len(layers), "hidden": hidden, "mlp": short(mlp), "q_heads": short(q), "kv_heads": short(kv)}


# ---------------------------------------------------------------------------------------------------- peers
def remove_layers(model: nn.Module, drop: set[int]) -> None:
    """Delete decoder layers (bench-side, for ShortGPT): renumber ``layer_idx`` and the config."""
    kept = [layer for i, layer in enumerate(model.model.layers) if i not in drop]
    model.model.layers = nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [t for i, t in enumerate(model.config.layer_types) if i not in drop]


def shortgpt(model: nn.Module, setup: Setup, size: float) -> dict:
    """Block Influence per layer on the calibration batches; remove the lowest until the size is reached."""
    layers = model.model.layers
    sums = torch.zeros(len(layers), dtype=torch.float64)
    counts = torch.zeros(len(layers), dtype=torch.float64)

    def hook(i: int):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            cos = F.cosine_similarity(x.flatten(0, -2).double(), y.flatten(0, -2).double(), dim=-1)
            sums[i] += float((1 - cos).sum())
            counts[i] += cos.numel()

        return fn

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for b in calib_batches(setup):
            model(b)
    for h in handles:
        h.remove()
    bi = sums / counts
    per_layer = n_params(layers[0])
    dense = setup_params(model)
    n_drop = math.ceil((dense - target(dense, size)) / per_layer)
    drop = set(torch.argsort(bi, stable=True)[:n_drop].tolist())
    remove_layers(model, drop)
    return {"widths": widths(model), "removed": sorted(drop)}


def _grads(model: nn.Module, setup: Setup) -> None:
    """Accumulate the LM loss gradient of the calibration batches into ``.grad`` (LLM-Pruner / TP Taylor)."""
    model.zero_grad(set_to_none=True)
    for b in calib_batches(setup):
        logits = model(b).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), b[:, 1:].flatten())
        loss.backward()


def llmpruner(model: nn.Module, setup: Setup, size: float) -> dict:
    """LLM-Pruner block-wise: element-wise first-order Taylor summed per group, one ratio in layers 4..L-2."""
    _grads(model, setup)
    layers = model.model.layers
    # the paper keeps the first 4 and the last 2 of LLaMA-7B's 32 layers: the same fractions of this model's
    first, last = round(LLMPRUNER_SKIP[0] * len(layers) / 32), len(layers) - round(LLMPRUNER_SKIP[1] * len(layers) / 32)
    attn0 = layers[0].self_attn
    hd = attn0.head_dim
    n_kv = attn0.k_proj.out_features // hd
    n_rep = attn0.q_proj.out_features // attn0.k_proj.out_features
    imp_mlp, imp_grp = [], []
    with torch.no_grad():
        for layer in layers:
            m, a = layer.mlp, layer.self_attn

            def t(w: torch.Tensor) -> torch.Tensor:
                return (w * w.grad).abs().double()

            imp_mlp.append(t(m.gate_proj.weight).sum(1) + t(m.up_proj.weight).sum(1) + t(m.down_proj.weight).sum(0))
            q = t(a.q_proj.weight).view(n_kv, n_rep * hd, -1).sum((1, 2))
            kv = (t(a.k_proj.weight) + t(a.v_proj.weight)).view(n_kv, hd, -1).sum((1, 2))
            o = t(a.o_proj.weight).view(-1, n_kv, n_rep * hd).sum((0, 2))
            imp_grp.append(q + kv + o)
    model.zero_grad(set_to_none=True)
    inter = layers[0].mlp.down_proj.in_features
    hidden = model.config.hidden_size
    per_channel = 3 * hidden
    per_group = 2 * n_rep * hd * hidden + 2 * hd * hidden
    dense = setup_params(model)
    goal = dense - target(dense, size)
    pruned = last - first

    def removed(r: float) -> tuple[int, int, int]:
        c, g = round(r * inter), min(round(r * n_kv), n_kv - 1)
        return c, g, pruned * (c * per_channel + g * per_group)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if removed(mid)[2] < goal else (lo, mid)
    n_ch, n_g, _ = removed(hi)
    if removed(hi)[2] < goal:
        raise ValueError(f"llmpruner: {pruned} layers cannot remove {goal} parameters")
    with torch.no_grad():
        for i in range(first, last):
            layer = layers[i]
            keep_c = torch.sort(torch.argsort(imp_mlp[i], descending=True)[: inter - n_ch]).values
            keep_g = torch.sort(torch.argsort(imp_grp[i], descending=True)[: n_kv - n_g]).values
            _slice_layer(layer, keep_c, keep_g, n_rep, hd)
    return {"widths": widths(model), "ratio": hi}


def _slice_linear(lin: nn.Linear, idx: torch.Tensor, dim: int) -> None:
    w = lin.weight.data.index_select(dim, idx.to(lin.weight.device)).clone()
    lin.weight = nn.Parameter(w)
    if dim == 0:
        lin.out_features = w.shape[0]
        if lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias.data[idx].clone())
    else:
        lin.in_features = w.shape[1]


def _slice_layer(layer: nn.Module, keep_c: torch.Tensor, keep_g: torch.Tensor, n_rep: int, hd: int) -> None:
    """Bench-side surgery (LLM-Pruner arm): keep MLP channels ``keep_c`` and GQA groups ``keep_g`` of one layer."""
    m, a = layer.mlp, layer.self_attn
    _slice_linear(m.gate_proj, keep_c, 0)
    _slice_linear(m.up_proj, keep_c, 0)
    _slice_linear(m.down_proj, keep_c, 1)
    kv_rows = (keep_g[:, None] * hd + torch.arange(hd, device=keep_g.device)).flatten()
    q_rows = (keep_g[:, None] * (n_rep * hd) + torch.arange(n_rep * hd, device=keep_g.device)).flatten()
    _slice_linear(a.q_proj, q_rows, 0)
    _slice_linear(a.k_proj, kv_rows, 0)
    _slice_linear(a.v_proj, kv_rows, 0)
    _slice_linear(a.o_proj, q_rows, 1)
    # transformers' LlamaAttention reads the head counts from the projections' shapes at forward time (-1 views)


def torch_pruning(model: nn.Module, setup: Setup, size: float, *, taylor: bool) -> dict:
    """Torch-Pruning's ``MetaPruner`` on the MLP channels (attention ignored), the ratio bisected to the size.

    Its LLM example also prunes the hidden size and the heads (``num_heads``, ``prune_num_heads``); with this
    transformers Llama, TP 1.6.1 never finished building those dependency groups (``get_pruning_group`` kept
    expanding index mappings: over 150 s on a 4-layer, 48-wide model, against 0.4 s without them), so the arm prunes
    what TP can here: every layer's MLP channels at one ratio (``global_pruning=False``, ``round_to=4``).
    """
    import torch_pruning as tp

    dense = setup_params(model)
    goal = target(dense, size)
    example = calib_batches(setup)[0][:1, :16]
    if taylor:
        _grads(model, setup)  # once; each trial copy gets these gradients

    def prune(ratio: float, net: nn.Module) -> nn.Module:
        ignored: list[nn.Module] = [net.lm_head]
        for name, mod in net.named_modules():
            if name.endswith("self_attn"):
                ignored += [mod.q_proj, mod.k_proj, mod.v_proj, mod.o_proj]
        imp = tp.importance.GroupTaylorImportance() if taylor else tp.importance.GroupMagnitudeImportance(p=2)
        pruner = tp.pruner.MetaPruner(
            net, example_inputs=example, importance=imp, global_pruning=False, pruning_ratio=ratio,
            ignored_layers=ignored, round_to=4, output_transform=lambda out: out.logits,
        )  # fmt: skip
        for g in pruner.step(interactive=True):
            g.prune()
        net.zero_grad(set_to_none=True)
        net.config.intermediate_size = net.model.layers[0].mlp.down_proj.in_features
        return net

    lo, hi, best = 0.0, 0.99, None
    for _ in range(8):  # each trial prunes a fresh copy
        mid = (lo + hi) / 2
        trial = copy.deepcopy(model)
        if taylor:
            for src, dst in zip(model.parameters(), trial.parameters(), strict=True):
                dst.grad = None if src.grad is None else src.grad.clone()
        prune(mid, trial)
        if n_params(trial) > goal:
            lo = mid
        else:
            hi, best = mid, trial
    model.zero_grad(set_to_none=True)
    if best is None:
        raise ValueError(f"tp: no ratio below 0.99 of the MLP channels reaches {goal:,} parameters")
    return {"model": best, "widths": widths(best), "ratio": hi}


# ---------------------------------------------------------------------------------------------------- one run
ONESHOT: dict[str, Callable[[nn.Module, Setup, float], dict]] = {
    "act": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp_heads", ranked=False, refit=False),
    "act_mlp": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp", ranked=False, refit=False),
    "act_q": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp_qheads", ranked=False, refit=False),
    "act_q_refit": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp_qheads", ranked=False, refit=True),
    "act_q_ranked_refit": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp_qheads", ranked=True, refit=True),
    "act_ranked": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp", ranked=True, refit=False),
    "act_refit": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp_heads", ranked=False, refit=True),
    "act_mlp_refit": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp", ranked=False, refit=True),
    "act_ranked_refit": lambda m, s, z: ours_oneshot(m, s, z, kinds="mlp", ranked=True, refit=True),
    "depth": ours_depth,
    "mix_refit": ours_mix,
    "act_mlp_bias": flap_bias,
    "shortgpt": shortgpt,
    "llmpruner": llmpruner,
    "tp_mag": lambda m, s, z: torch_pruning(m, s, z, taylor=False),
    "tp_taylor": lambda m, s, z: torch_pruning(m, s, z, taylor=True),
}
ARMS = ("dense", "dense_heal", *ONESHOT, "ramp", "scratch")
MAIN_ARMS = ("dense", "act_mlp_refit", "act_refit", "act", "mix_refit", "ramp", "tp_mag", "tp_taylor", "llmpruner",
             "shortgpt", "scratch")  # fmt: skip


def run_one(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    setup = load_setup(quick=args.quick, device=args.device)
    t_start = time.perf_counter()
    model = setup.dense()
    dense = setup_params(model)
    rec: dict = {"arm": args.one, "size": args.size, "seed": args.seed, "steps": args.steps,
                 "tokens": args.steps * args.batch * SEQ, "lr": args.lr, "alpha": args.alpha,
                 "temperature": args.temperature, "dense_params": dense, "quick": args.quick,
                 "device": str(setup.device)}  # fmt: skip
    teacher = None
    if args.one != "dense" and args.steps > 0 and args.alpha > 0:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    t0 = time.perf_counter()
    if args.one in ("dense", "dense_heal"):  # dense_heal: no cut, the same healing (the control of every arm)
        info: dict = {"widths": widths(model)}
    elif args.one in ONESHOT:
        info = ONESHOT[args.one](model, setup, args.size)
        model = info.pop("model", model)
    elif args.one == "scratch":
        shaped = setup.dense()
        ours_oneshot(shaped, setup, args.size, kinds="mlp_heads", ranked=False, refit=False)
        torch.manual_seed(args.seed)
        model = type(shaped)(shaped.config).to(setup.device)  # same shape, random weights
        info = {"widths": widths(model)}
        del shaped
    elif args.one == "ramp":
        info = {}
    else:
        raise ValueError(f"--one: unknown arm {args.one!r}; choose from {ARMS}")
    rec["cut_s"] = time.perf_counter() - t0
    if args.one != "ramp":
        rec["params"] = n_params(model)
        rec["oneshot_code"] = evaluate(model, setup.val_code, setup.device)
        if args.steps == 0 and not args.skip_eng:
            rec["oneshot_eng"] = evaluate(model, setup.val_eng, setup.device)
    if args.one == "ramp":
        from lightning_pat import CoupledPruningCallback, shrink

        cb = CoupledPruningCallback(
            "llama", target_params=target(dense, args.size), warmup_steps=0, ramp_steps=max(1, args.steps // 3),
            distill_alpha=args.alpha, distill_temperature=args.temperature, distill_module="model",
        )  # fmt: skip
        rec.update(heal(model, None, setup, args, callbacks=[cb], kd=False))
        shrink(model, cb)
        rec["params"] = n_params(model)
        info = {"widths": widths(model)}
    elif args.one != "dense" and args.steps > 0:
        lr = args.scratch_lr if args.one == "scratch" else args.lr
        rec.update(heal(model, teacher, setup, args, lr=lr))
    rec.update(info)
    if args.one == "dense" or args.steps > 0:
        rec["code"] = evaluate(model, setup.val_code, setup.device)
        rec["eng"] = evaluate(model, setup.val_eng, setup.device)
    elif "oneshot_code" in rec:
        rec["code"], rec["eng"] = rec["oneshot_code"], rec.get("oneshot_eng")
    rec["samples"] = samples(model, setup) if not args.no_samples else {}
    rec["wall_s"] = time.perf_counter() - t_start
    rec["host"] = f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus"
    rec["load"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rec["threads"] = torch.get_num_threads()
    rec["date"] = time.strftime("%Y-%m-%d %H:%M")
    rec["allocation"] = "importance"  # prune_clusters' default target_allocation (the records before it: "fractions")
    try:
        rec["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                       capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        rec["commit"] = None
    return rec


# ---------------------------------------------------------------------------------------------------- overhead
def overhead(args: argparse.Namespace) -> dict:
    """The callback's per-step work on this model, component by component, against one training step.

    One process, one thread, the process's CPU time (on a shared machine wall time mostly measures waiting for a
    core), medians over ``--rounds``. The training step is forward + backward + AdamW on ``--batch`` x 128 tokens.
    ``statistics``: what the activation-score hooks do on every training forward of the ramp
    (``ActivationStats.observe`` on every reader module's input of one forward, timed on inputs captured once).
    ``fresh selection``: the engine's ``Pruner.step(targets, evidence=stats)`` (score from those statistics,
    select, zero) at 25% of the units, as the callback calls it at every ramp step with ``every_n_steps=1``; the
    weights are restored after it, untimed. ``held mask``: ``Pruner.hold`` (between selections and while healing).
    ``teacher``: a no-grad forward of the dense model (``distill_alpha``).
    """
    from lightning_pat import Pruner, presets, resolve_clusters
    from lightning_pat.core import masking
    from lightning_pat.pruning.plan import make_plan
    from lightning_pat.scoring.activation import ActivationStats

    torch.set_num_threads(1)
    setup = load_setup(quick=args.quick, device=args.device)
    model = setup.dense().train()
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    clusters = resolve_clusters(model, presets.llama(model, query_heads=True))
    stats = ActivationStats(model, clusters)
    pruner = Pruner(model, make_plan(model, clusters, score="activation"))
    params = dict(model.named_parameters())
    members = {n: params[n] for rc in clusters for n in rc.param_names}
    x = stream(setup, args.batch, seed=0).to(setup.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def train_step() -> None:
        logits = model(x[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    captured: list[tuple[str, torch.Tensor]] = []  # every reader module's input of one forward
    handles = [
        mod.register_forward_pre_hook(lambda m, a, name=name: captured.append((name, a[0].detach())))
        for name, mod in stats.hooked_modules().items()
    ]
    with torch.no_grad():
        model(x[:, :-1])
    for h in handles:
        h.remove()

    def observe_all() -> None:
        for name, inp in captured:
            stats.observe(name, inp)

    rows: dict[str, list[float]] = {k: [] for k in ("step", "stats", "selection", "selection_index", "selection_all",
                                                     "norms", "hold", "teacher")}  # fmt: skip

    def by_index() -> None:  # baseline: columns zeroed by index_fill_, unit indices of the scores recomputed per call
        saved_fraction = masking._BITWISE_MIN_FRACTION  # noqa: SLF001 - bench-only switch to the old behaviour
        masking._BITWISE_MIN_FRACTION = math.inf  # noqa: SLF001
        stats._unit_index.clear()  # noqa: SLF001
        try:
            pruner.step(targets, evidence=stats)
        finally:
            masking._BITWISE_MIN_FRACTION = saved_fraction  # noqa: SLF001

    def every_norm() -> None:  # baseline: also every unit norm computed (before the selection skipped those unread)
        pruner._weights_read = lambda *_a: None  # noqa: SLF001 - bench-only switch to the old behaviour
        try:
            by_index()
        finally:
            del pruner._weights_read

    train_step()  # warm up (allocations, AdamW state)
    observe_all()
    targets = {rc.name: 0.25 for rc in clusters}
    for _ in range(args.rounds):
        rows["step"].append(timed(train_step))
        rows["stats"].append(timed(observe_all))
        saved = {n: t.detach().clone() for n, t in members.items()}
        with torch.no_grad():
            rows["selection"].append(timed(lambda: pruner.step(targets, evidence=stats)))  # as the callback calls it
            for n, t in members.items():
                t.copy_(saved[n])
            rows["selection_index"].append(timed(by_index))
            for n, t in members.items():
                t.copy_(saved[n])
            rows["selection_all"].append(timed(every_norm))
            rows["norms"].append(timed(lambda: [ex.unit_sq_norms() for ex in pruner.executors]))
            rows["hold"].append(timed(pruner.hold))
            for n, t in members.items():
                t.copy_(saved[n])
            rows["teacher"].append(timed(lambda: teacher(x[:, :-1])))
    med = {k: statistics.median(v) for k, v in rows.items()}
    step = med["step"]
    parts = {
        "training step (forward + backward + AdamW)": step,
        "statistics (hooks on the readers' inputs)": med["stats"],
        "fresh selection (score, select, zero)": med["selection"],
        "  baseline: zeroing columns by index, unit indices recomputed (before they were not)": med["selection_index"],
        "  baseline: that, and every unit norm computed (before they were skipped)": med["selection_all"],
        "  every member's unit norms alone (the weight partials)": med["norms"],
        "held mask": med["hold"],
        "teacher forward (distill_alpha)": med["teacher"],
    }
    lines = [f"CPU time, 1 thread, median of {args.rounds} rounds, batch {args.batch} x {SEQ} tokens, "
             f"{n_params(model) / 1e6:.1f}M parameters, {len(clusters)} clusters", "",
             "| component | ms (CPU) | % of a training step |", "| --- | ---: | ---: |"]  # fmt: skip
    for name, sec in parts.items():
        lines.append(f"| {name} | {sec * 1e3:,.1f} | {100 * sec / step:.2f}% |")
    ramp = parts["statistics (hooks on the readers' inputs)"] + parts["fresh selection (score, select, zero)"]
    lines.append(f"| per ramp step without the teacher (statistics + fresh selection) | {ramp * 1e3:,.1f} "
                 f"| {100 * ramp / step:.2f}% |")  # fmt: skip
    lines.append(f"\nfresh selection / baselines: {med['selection'] / med['selection_index']:.2f}x, "
                 f"{med['selection'] / med['selection_all']:.2f}x")  # fmt: skip
    print("\n".join(lines))
    return {"ms": {k: v * 1e3 for k, v in parts.items()}, "rounds": args.rounds, "batch": args.batch}


# ---------------------------------------------------------------------------------------------------- table
def table(records: list[dict]) -> str:
    """One row per arm and size: held-out loss (code, English), the change vs dense, perplexities, params, time."""
    dense = [r for r in records if r["arm"] == "dense"]
    d_code = statistics.mean(r["code"] for r in dense) if dense else float("nan")
    d_eng = statistics.mean(r["eng"] for r in dense) if dense else float("nan")
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["arm"] != "dense":
            groups.setdefault((r["size"], r["steps"], r["arm"]), []).append(r)
    lines = [
        f"dense: code {d_code:.3f} nats (ppl {math.exp(d_code):.2f}), English {d_eng:.3f} (ppl {math.exp(d_eng):.2f})",
        "",
        "| size | arm | heal tokens | seeds | params (M) | one-shot code | code loss | vs dense | code ppl | English "
        "loss | vs dense | wall s/run |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ms(vals: list[float]) -> str:
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        m = statistics.mean(vals)
        return f"{m:.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")

    for (size, _steps, arm), rs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])):
        code = [r["code"] for r in rs]
        eng = [r["eng"] for r in rs if r.get("eng") is not None]
        lines.append(
            f"| {size:.0%} | {arm} | {rs[0]['tokens']:,} | {len(rs)} "
            f"| {statistics.mean(r['params'] for r in rs) / 1e6:.1f} "
            f"| {ms([r.get('oneshot_code') for r in rs])} | {ms(code)} | {statistics.mean(code) - d_code:+.3f} "
            f"| {math.exp(statistics.mean(code)):.1f} | {ms(eng)} "
            f"| {(statistics.mean(eng) - d_eng) if eng else float('nan'):+.3f} "
            f"| {statistics.mean(r['wall_s'] for r in rs):.0f} |"
        )
    return "\n".join(lines)


def paired(records: list[dict], ref: str) -> str:
    """Paired code-loss differences (arm - ``ref``) per size and budget, over the seeds both ran."""
    by: dict[tuple, dict] = {}
    for r in records:
        by.setdefault((r["size"], r["tokens"], r["arm"]), {})[r["seed"]] = r["code"]
    lines = [f"| size | heal tokens | arm | minus {ref} (code nats, paired) | seeds | worse on |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for (size, tokens, arm), seeds in sorted(by.items()):
        base = by.get((size, tokens, ref))
        if arm == ref or base is None:
            continue
        d = [seeds[s] - base[s] for s in seeds if s in base]
        if not d:
            continue
        sd = f" ± {statistics.stdev(d):.3f}" if len(d) > 1 else ""
        lines.append(f"| {size:.0%} | {tokens:,} | {arm} | {statistics.mean(d):+.3f}{sd} | {len(d)} | "
                     f"{sum(x > 0 for x in d)}/{len(d)} |")  # fmt: skip
    return "\n".join(lines)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# ---------------------------------------------------------------------------------------------------- driver
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny random Llama on byte tokens, 2 steps, 2 arms at 75%%")
    p.add_argument("--arms", default=None, help=f"comma list of {ARMS} (default: {','.join(MAIN_ARMS)})")
    p.add_argument("--sizes", default=None, help="fractions of the dense parameter count (default 0.75,0.5)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=64, help="healing steps (0: one-shot only)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument(
        "--curve",
        type=int,
        default=0,
        help="also evaluate the held-out code loss every N healing steps (the record's 'curve')",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--scratch-lr", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=0.5, help="distillation weight (0: CE only)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="32-true", help="Lightning precision of the healing steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jsonl", type=Path, default=None, help="append every run's record here (and print the table)")
    p.add_argument("--table", type=Path, default=None, help="print the table of stored runs and exit")
    p.add_argument("--ref", default="act_mlp_refit", help="the arm paired differences are taken against")
    p.add_argument("--no-samples", action="store_true")
    p.add_argument("--skip-eng", action="store_true", help="one-shot runs: no English eval (halves their cost)")
    p.add_argument("--overhead", action="store_true", help="the callback's per-step cost on this model, by part")
    p.add_argument("--rounds", type=int, default=3, help="--overhead: rounds (medians)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", type=float, default=0.75, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and args.steps == 64:
        args.steps = 2
    args.arms = args.arms or ("act_q_refit,mix_refit,ramp" if args.quick else ",".join(MAIN_ARMS))
    args.sizes = args.sizes or ("0.75" if args.quick else "0.75,0.5")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.overhead:
        out = overhead(args)
        if args.jsonl is not None:
            with args.jsonl.open("a") as fh:
                fh.write(json.dumps({"overhead": out, "date": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
        return [out]
    if args.one is not None:
        rec = run_one(args)
        line = json.dumps(rec)
        if args.jsonl is not None:
            with args.jsonl.open("a") as fh:
                fh.write(line + "\n")
        print(line, flush=True)
        return [rec]
    if args.table is not None:
        records = read(args.table)
        print(table(records))
        print()
        print(paired(records, args.ref))
        return records
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown {bad}; choose from {ARMS}")
    jsonl = args.jsonl or Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_pretrained_{os.getpid()}.jsonl"
    script = str(Path(__file__).resolve())
    common = ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
              "--scratch-lr", str(args.scratch_lr), "--alpha", str(args.alpha), "--temperature",
              str(args.temperature), "--data-seed", str(args.data_seed), "--device", args.device,
              "--precision", args.precision, "--threads", str(args.threads), "--jsonl", str(jsonl),
              "--curve", str(args.curve)]  # fmt: skip
    common += ["--quick"] if args.quick else []
    common += ["--no-samples"] if args.no_samples else []
    common += ["--skip-eng"] if args.skip_eng else []
    have = {(r["arm"], r["size"], r["seed"], r["steps"]) for r in read(jsonl) if r.get("quick") == args.quick}
    runs = [("dense", 1.0, 0)] + [
        (a, float(z), int(s)) for z in args.sizes.split(",") for s in args.seeds.split(",") for a in arms
        if a not in ("dense", "dense_heal")
    ] + [("dense_heal", 1.0, int(s)) for s in args.seeds.split(",") if "dense_heal" in arms]  # fmt: skip
    failed: list[str] = []
    for arm, size, seed in runs:
        key = (arm, size, seed, 0 if arm == "dense" else args.steps)
        if key in have or (arm == "dense" and ("dense", 1.0, 0, args.steps) in have):
            continue  # resumable: a run already in the file is not repeated
        cmd = [sys.executable, script, "--one", arm, "--size", str(size), "--seed", str(seed), *common]
        if arm == "dense":
            cmd[cmd.index("--steps") + 1] = "0"
        t0 = time.perf_counter()
        if args.quick:  # the smoke mode runs in this process (seconds, not a torch import per arm)
            main(cmd[2:])
            print(f"# {arm} size {size} seed {seed}: ok in {time.perf_counter() - t0:.0f} s (in-process)", flush=True)
            continue
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        status = "ok" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
        print(f"# {arm} size {size} seed {seed}: {status} in {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode != 0:
            failed.append(f"{arm} {size} {seed}")
            print(proc.stderr[-4000:], file=sys.stderr, flush=True)
    records = [r for r in read(jsonl) if r.get("quick") == args.quick]
    print(table(records))
    print()
    print(paired(records, args.ref))
    if failed:
        raise SystemExit(f"bench_pretrained: {len(failed)} run(s) failed: {failed}")
    return records


if __name__ == "__main__":
    main()
