"""Gate-less fused experts (Nemotron-H, Ergo): whole experts, expert channels and shared experts, exact and stock.

Nemotron-H's and Ergo's routed experts are one activation of an ``up_proj`` (no gate) and a ``down_proj``, each one
3-D tensor: ``(E, I, H)`` and ``(E, H, I)`` in Nemotron-H, transposed (``(E, H, I)`` and ``(E, I, H)``) in Ergo, whose
experts also end in a norm of their own (``post_expert_norm``: one ``(E, H)`` weight). Both have a shared expert of a
width their config holds (``moe_shared_expert_intermediate_size``, ``shared_intermediate_size``); Nemotron-H's other
layers are Mamba 2 mixers, a dense MLP and attention, Ergo's first layer a dense MLP. Each case prunes a tiny random
model of ``tests/common/lm_zoo.py`` with ``clusters="auto"`` (one-shot, or the callback over a few Trainer steps),
shrinks it, and checks against independent references: the shrunk logits and the stock
``AutoModelForCausalLM.from_pretrained`` reload's equal the masked model's (fp32, rel < 1e-4), the config's new
sizes, the share of parameters cut; the experts' data score (REAP) is checked against the experts computed here in
float64 from their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import lightning_pat as lp
from tests.common import lm_zoo
from tests.common.lit_models import ZooStep, quiet_trainer

transformers = pytest.importorskip("transformers")

#: model_type -> (layer of the MoE block, the block's name in it, the config fields of (experts, width, shared width))
FAMILIES = {
    "nemotron_h": (1, "mixer", ("n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size")),
    "ergo": (1, "mlp", ("num_experts", "moe_intermediate_size", "shared_intermediate_size")),
}


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def sizes(model: nn.Module, model_type: str) -> tuple[int, int, int]:
    """(routed experts, experts' width, shared expert's width) the config says."""
    return tuple(getattr(model.config, f) for f in FAMILIES[model_type][2])  # type: ignore[return-value]


def block(model: nn.Module, model_type: str) -> nn.Module:
    layer, name, _ = FAMILIES[model_type]
    return getattr(model.model.layers[layer], name)


def shrinks_exactly_and_reloads(model: nn.Module, source, tmp_path) -> nn.Module:
    """The shrunk logits and the stock reload's equal the masked model's, generate() runs; returns the reload."""
    ids = lm_zoo.token_ids()
    masked = logits(model, ids)
    small = lp.shrink(model, source, example_input=None)
    assert lm_zoo._rel(logits(small, ids), masked) < lm_zoo.EXACT
    lp.save_pretrained(small, tmp_path, overwrite=True, tokenizer=None)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(stock) is type(small)
    assert lm_zoo._rel(logits(stock, ids), masked) < lm_zoo.EXACT
    assert stock.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)
    return stock


@dataclass
class OneShot:
    """What "auto" at 0.5 did to one tiny model: its type, dense size, the result, the experts before, the reload."""

    model_type: str
    dense: int
    result: lp.PruneResult
    before: dict[str, torch.Tensor]
    stock: nn.Module


def _one_shot(model_type: str, folder) -> OneShot:
    model = lm_zoo.build(model_type)
    dense = lm_zoo.non_embedding_params(model)
    before = {n: p.detach().clone() for n, p in block(model, model_type).experts.named_parameters()}
    result = lp.prune_clusters(model, "auto", 0.5, calibration=[lm_zoo.token_ids(seed=s) for s in (2, 3)])
    return OneShot(model_type, dense, result, before, shrinks_exactly_and_reloads(model, result, folder))


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory) -> OneShot:
    return _one_shot("nemotron_h", tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def ergo(tmp_path_factory) -> OneShot:
    return _one_shot("ergo", tmp_path_factory.mktemp("ergo"))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_auto_cuts_whole_gateless_experts_their_channels_and_the_shared_expert(model_type, request):
    one_shot: OneShot = request.getfixturevalue(model_type)
    result, stock = one_shot.result, one_shot.stock
    experts, width, shared = (4, 32, 48)  # lm_zoo's tiny sizes
    layer = FAMILIES[model_type][0]
    assert (len(result.dropped[f"experts.{layer}"]), len(result.dropped[f"mlp.{layer}"])) == (experts // 2, width // 2)
    assert len(result.dropped[f"shared.{layer}"]) == shared // 2
    assert sizes(stock, model_type) == (experts // 2, width // 2, shared // 2)
    assert stock.config.num_experts_per_tok == 2
    assert 1 - lm_zoo.non_embedding_params(stock) / one_shot.dense >= 0.2
    moe = block(stock, model_type)
    assert moe.gate.e_score_correction_bias.shape == (2,)
    # the kept experts' kept channels, on the axes each family stores them: experts first, then (I, H) or (H, I)
    kept = sorted(set(range(experts)) - set(result.dropped[f"experts.{layer}"]))
    channels = sorted(set(range(width)) - set(result.dropped[f"mlp.{layer}"]))
    up, down = one_shot.before["up_proj"][kept], one_shot.before["down_proj"][kept]
    if model_type == "nemotron_h":  # (E, I, H) and (E, H, I)
        up, down = up[:, channels], down[:, :, channels]
    else:  # Ergo: (E, H, I) and (E, I, H), and its per-expert output norm's rows
        up, down = up[:, :, channels], down[:, channels]
        assert torch.equal(
            moe.experts.post_expert_norm.weight.detach(), one_shot.before["post_expert_norm.weight"][kept]
        )
    assert torch.equal(moe.experts.up_proj.detach(), up)
    assert torch.equal(moe.experts.down_proj.detach(), down)


def test_nemotron_h_mamba_mixers_dense_mlp_and_attention_are_cut_too(nemotron_h):
    dropped = nemotron_h.result.dropped
    assert len(dropped["model.layers.0.mixer.inner"]) == 4  # Mamba 2 heads (presets/ssm.py)
    assert len(dropped["model.layers.2.mixer.up_proj"]) == 64  # the dense MLP layer
    assert len(dropped["model.layers.3.mixer.q_proj"]) == 1  # one of two KV groups
    config = nemotron_h.stock.config
    assert (config.mamba_num_heads, config.intermediate_size, config.num_key_value_heads) == (4, 64, 1)


def test_ergo_dense_first_layer_width_follows_and_its_heads_stay(ergo):
    # its head size is hidden_size // heads: a head cut could not reload stock, so "auto" leaves the heads whole
    assert not any("qkv_proj" in name for name in ergo.result.dropped)
    assert ergo.stock.config.first_dense_intermediate_size == lm_zoo.FF // 2
    assert ergo.stock.model.layers[0].mlp.up_proj.out_features == lm_zoo.FF // 2


def _reference_reap_sum(model: nn.Module, model_type: str, batches: list[torch.Tensor]) -> torch.Tensor:
    """``sum over tokens routed to e of g_e(x) * ||f_e(x)||``, the experts computed here in float64."""
    moe = block(model, model_type)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    inputs: list[torch.Tensor] = []
    handles = [
        moe.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach())),
        moe.gate.register_forward_hook(lambda _m, _a, out: seen.append((inputs[-1], out[1].detach(), out[2]))),
    ]
    try:
        for ids in batches:
            logits(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    up, down = moe.experts.up_proj.detach().double(), moe.experts.down_proj.detach().double()
    if model_type == "ergo":  # stored transposed: (E, H, I) and (E, I, H)
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    norm = getattr(moe.experts, "post_expert_norm", None)
    sums = torch.zeros(up.shape[0], dtype=torch.float64)
    for x, weights, index in seen:
        x = x.reshape(-1, x.shape[-1]).double()
        for t in range(x.shape[0]):
            for g, e in zip(weights[t].tolist(), index[t].tolist(), strict=True):
                out = down[e] @ torch.relu(up[e] @ x[t]) ** 2
                if norm is not None:
                    out = out / torch.sqrt(out.pow(2).mean() + norm.eps) * norm.weight[e].detach().double()
                sums[e] += g * out.norm()
    return sums


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_reap_scores_the_gateless_experts_by_their_router_weighted_outputs(model_type):
    from lightning_pat.scoring.experts import expert_scores

    model = lm_zoo.build(model_type)
    layer = FAMILIES[model_type][0]
    clusters = [c for c in lp.presets.moe(model, heads=False) if c.name.startswith("experts")]
    batches = [lm_zoo.token_ids(seed=s) for s in (2, 3)]
    scores = expert_scores(model, lp.resolve_clusters(model, clusters), batches, kind="reap_sum")
    want = _reference_reap_sum(model, model_type, batches)
    assert bool((want > 0).all())
    torch.testing.assert_close(scores[f"experts.{layer}"], want, rtol=1e-5, atol=0.0)


def test_callback_prunes_gateless_experts_while_training_then_shrinks_exactly(tmp_path):
    # Ergo under the callback: the LightningModule holds the model, whose stock config cannot express a head cut
    # ("auto" probes it through the LightningModule and leaves its heads whole, as one-shot does)
    model_type = "ergo"
    module = ZooStep(model_type)
    experts, width, shared = sizes(module.model, model_type)
    layer = FAMILIES[model_type][0]
    cb = lp.CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    dropped = {k: len(v) for k, v in cb.dropped.items() if k.endswith(f".{layer}") and "." not in k[:-2]}
    assert dropped == {f"experts.{layer}": experts // 2, f"mlp.{layer}": width // 2, f"shared.{layer}": shared // 2}
    stock = shrinks_exactly_and_reloads(module.model.eval(), cb, tmp_path)
    assert sizes(stock, model_type) == (experts // 2, width // 2, shared // 2)
    assert stock.config.num_attention_heads == lm_zoo.HEADS
