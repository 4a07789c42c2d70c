"""Mixture of experts with fused 3-D experts (transformers 5): expert channels and whole experts, exact and stock.

Each case prunes a tiny random model (one-shot, or the callback over a few Trainer steps), shrinks it, compares the
shrunk logits with the masked model's (fp32, rel < 1e-4), saves it, reloads it with stock
``AutoModelForCausalLM.from_pretrained`` (same logits) and runs ``generate()``. The masked model's routing is checked
against a MoE block written here in plain torch over the kept experts only (router rows removed: softmax and top-k
over the kept experts), which is what dropping an expert means (:mod:`lightning_pat.core.routing`).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_pat as lp
from lightning_pat import CoupledPruningCallback
from tests.common.lit_models import quiet_trainer

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_experts_per_tok": 2, "vocab_size": VOCAB, "attn_implementation": "eager", "tie_word_embeddings": False,
}  # fmt: skip
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"intermediate_size": 48, "num_local_experts": 4}),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {"intermediate_size": 64, "moe_intermediate_size": 48, "num_experts": 4, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": 48, "num_experts": 4}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"intermediate_size": 48, "num_local_experts": 4}),
}  # fmt: skip


def tiny(family: str, seed: int = 0) -> nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random norm weights: a residual or head cut would show a wrong rescale
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def ids(seed: int = 1, batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def num_experts(config) -> int:
    return config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts


def width(config) -> int:
    return config.moe_intermediate_size if hasattr(config, "moe_intermediate_size") else config.intermediate_size


def assert_shrinks_exactly_and_reloads(model: nn.Module, source, tmp_path) -> nn.Module:
    x = ids()
    with torch.no_grad():
        masked = model(x).logits
    shrunk = lp.shrink(model, source)
    with torch.no_grad():
        assert rel(shrunk(x).logits, masked) < 1e-4
    shrunk.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(shrunk)
    with torch.no_grad():
        assert rel(reloaded(x).logits, masked) < 1e-4
    out = reloaded.generate(x[:1, :4], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
    return reloaded


def moe_reference(block: nn.Module, h: torch.Tensor, kept: list[int], top_k: int) -> torch.Tensor:
    """The MoE block over the kept experts only, in plain float64 torch (router rows removed)."""
    router = block.gate.weight.detach().double()[kept]
    gate_up = block.experts.gate_up_proj.detach().double()[kept]
    down = block.experts.down_proj.detach().double()[kept]
    h = h.double().reshape(-1, h.shape[-1])
    probs = torch.softmax(h @ router.T, dim=-1)
    k = min(top_k, len(kept))
    top_v, top_i = torch.topk(probs, k, dim=-1)
    if getattr(block.gate, "norm_topk_prob", True):
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            e = int(top_i[t, j])
            g, u = (gate_up[e] @ h[t]).chunk(2)
            out[t] += top_v[t, j] * (down[e] @ (nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_auto_one_shot_cuts_experts_channels_and_heads_exactly_with_stock_reload(family, tmp_path):
    model = tiny(family)
    experts_before, width_before = num_experts(model.config), width(model.config)
    res = lp.prune_clusters(model, "auto", 0.5, calibration=[ids(seed=2)])
    assert {"experts.0", "experts.1", "mlp.0", "mlp.1", "heads.0"} <= set(res.dropped)
    assert all(len(res.dropped[f"experts.{i}"]) == 2 for i in range(2))
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert num_experts(reloaded.config) == experts_before // 2
    assert width(reloaded.config) == width_before // 2
    assert reloaded.config.num_experts_per_tok == 2
    block = reloaded.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape == (experts_before // 2, width_before, COMMON["hidden_size"])


def test_olmoe_auto_keeps_heads_whole_and_cuts_experts_and_channels_exactly(tmp_path):
    # OLMoE's q_norm/k_norm normalise over all heads: a head cut is not exact there, so the preset keeps heads
    model = tiny("olmoe")
    res = lp.prune_clusters(model, "auto", 0.5)
    assert sorted(res.dropped) == ["experts.0", "experts.1", "mlp.0", "mlp.1"]
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert (reloaded.config.num_experts, reloaded.config.intermediate_size) == (2, 24)


@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_granitemoe_router_topk_then_softmax_exact_with_stock_reload(sparsity, tmp_path):
    model = tiny("granitemoe")
    clusters = lp.presets.resolve_preset("moe", model, heads=sparsity < 0.75)  # 2 KV heads: 75% would empty them
    res = lp.prune_clusters(model, clusters, sparsity, calibration=[ids(seed=2)])
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    kept = 4 - len(res.dropped["experts.0"])
    assert (reloaded.config.num_local_experts, reloaded.config.num_experts_per_tok) == (kept, min(2, kept))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fewer_experts_than_top_k_keeps_top_k_at_most_the_experts_kept(family, tmp_path):
    model = tiny(family)
    clusters = lp.presets.resolve_preset("moe", model, mlp=False, heads=False)
    res = lp.prune_clusters(model, clusters, 0.75)  # 4 experts -> 1, top_k 2 -> 1
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert (num_experts(reloaded.config), reloaded.config.num_experts_per_tok) == (1, 1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("drop", [[1], [0, 2], [0, 1, 3]])
def test_masked_experts_route_as_if_removed_from_the_router(family, drop):
    model = tiny(family)
    block = model.model.layers[0].mlp
    h = torch.randn(2, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
    clusters = lp.resolve_clusters(model, lp.presets.resolve_preset("moe", model, mlp=False, heads=False))
    [rc] = [rc for rc in clusters if rc.name == "experts.0"]
    pruner = lp.Pruner(model, [rc])  # hooks the router (the masked model routes around dropped experts)
    with torch.no_grad():
        for m in rc.members:
            dict(model.named_parameters())[m.name][drop] = 0.0
        got = block(h).double().reshape(-1, h.shape[-1])
    kept = [e for e in range(4) if e not in drop]
    torch.testing.assert_close(got, moe_reference(block, h, kept, block.gate.top_k), rtol=1e-5, atol=1e-6)
    assert pruner.clusters == [rc]


def test_channels_inside_experts_are_one_width_per_layer_and_cut_the_same_channels_in_every_expert():
    model = tiny("mixtral")
    clusters = lp.presets.resolve_preset("moe", model, heads=False, experts=False)
    [mlp0, _] = lp.resolve_clusters(model, clusters)
    assert mlp0.num_units == 48
    assert [(m.name.rsplit(".", 1)[1], m.dim, m.start, m.stop) for m in mlp0.members] == [
        ("gate_up_proj", 1, 0, 48), ("gate_up_proj", 1, 48, 96), ("down_proj", 2, 0, 48),
    ]  # fmt: skip
    res = lp.prune_clusters(model, clusters, 0.25)
    experts = model.model.layers[0].mlp.experts
    dropped = res.dropped["mlp.0"]
    assert (mlp0.multiple_of, len(dropped)) == (8, 16)  # 48 - 12 = 36 kept, rounded down to a multiple of 8
    assert bool((experts.gate_up_proj[:, dropped] == 0).all())
    assert bool((experts.gate_up_proj[:, 48:][:, dropped] == 0).all())
    assert bool((experts.down_proj[:, :, dropped] == 0).all())


class MoEStep(pl.LightningModule):
    """A tiny Mixtral whose batch is a function of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny("mixtral")

    def training_step(self, batch, batch_idx):
        x = ids(seed=100 + self.global_step, batch=2, length=9)
        logits = self.model(input_ids=x[:, :-1]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=1)


@pytest.mark.parametrize("score", ["auto", "rms"])
def test_callback_prunes_experts_and_channels_then_shrinks_exactly(score, tmp_path):
    module = MoEStep()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2, score=score)
    quiet_trainer(max_steps=5, callbacks=[cb]).fit(module)
    assert all(len(cb.dropped[f"experts.{i}"]) == 2 for i in range(2))
    assert all(len(cb.dropped[f"mlp.{i}"]) == 24 for i in range(2))
    model = module.model.eval()
    reloaded = assert_shrinks_exactly_and_reloads(model, cb, tmp_path)
    assert (reloaded.config.num_local_experts, reloaded.config.intermediate_size) == (2, 24)


def test_target_params_counts_experts_and_their_channels_exactly(tmp_path):
    model = tiny("mixtral")
    total = sum(p.numel() for p in model.parameters())
    res = lp.prune_clusters(model, "auto", target_params=int(0.6 * total))
    assert res.size is not None
    assert res.size.achieved <= int(0.6 * total)
    assert res.size.cluster_kept["experts.0"] < 4
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert sum(p.numel() for p in reloaded.parameters()) == res.size.achieved  # an expert counted once
    assert reloaded.config.intermediate_size % 8 == 0  # the preset's multiple_of: grouped_mm's 16-byte strides


def test_residual_through_the_experts_and_router_is_exact_with_stock_reload(tmp_path):
    model = tiny("qwen3_moe")
    res = lp.prune_clusters(model, lp.presets.resolve_preset("moe", model, residual=True), 0.25)
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert reloaded.config.hidden_size == 24
    assert reloaded.model.layers[1].mlp.gate.weight.shape == (3, 24)  # 4 experts, 1 dropped


def test_shrink_checks_itself_against_the_masked_model_on_an_example_input():
    model = tiny("mixtral")
    res = lp.prune_clusters(model, "auto", 0.5)
    shrunk = lp.shrink(model, res, example_input=ids())  # raises if the shrunk model differs from the masked one
    assert shrunk.config.num_local_experts == 2


def test_qwen2_moe_shared_expert_is_an_mlp_cluster_exact_with_stock_reload(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4
    )
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    res = lp.prune_clusters(model, "auto", 0.5)
    assert {"shared.0", "shared.1", "mlp.0", "experts.0", "heads.0"} <= set(res.dropped)
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    cfg = reloaded.config
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (2, 24, 20)
    assert cfg.intermediate_size == 64  # the dense MLP width (mlp_only_layers) is not the shared expert's


def test_qwen2_moe_residual_through_the_shared_expert_and_its_gate(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4
    )
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    res = lp.prune_clusters(model, lp.presets.resolve_preset("moe", model, residual=True), 0.25)
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert reloaded.config.hidden_size == 24


def test_callback_shrink_on_freeze_trains_on_the_shrunk_moe(tmp_path):
    module = MoEStep()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2, shrink_on_freeze=True)
    quiet_trainer(max_steps=5, callbacks=[cb]).fit(module)
    block = module.model.model.layers[0].mlp
    assert (block.experts.num_experts, block.experts.intermediate_dim, block.gate.num_experts) == (2, 24, 2)
    assert (module.model.config.num_local_experts, module.model.config.intermediate_size) == (2, 24)
    module.model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert rel(reloaded(ids()).logits, module.model.eval()(ids()).logits) < 1e-4


def test_callback_resume_from_a_checkpoint_routes_around_the_dropped_experts(tmp_path):
    def run(max_steps: int, ckpt: str | None = None) -> tuple[MoEStep, CoupledPruningCallback]:
        module = MoEStep()
        cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
        every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
        quiet_trainer(max_steps=max_steps, callbacks=[cb, every], checkpointing=True).fit(module, ckpt_path=ckpt)
        return module, cb

    straight, cb = run(6)
    resumed, cb2 = run(6, ckpt=str(next(tmp_path.glob("*step=4.ckpt"))))
    assert cb2.dropped == cb.dropped
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert_shrinks_exactly_and_reloads(resumed.model.eval(), cb2, tmp_path / "export")


def test_target_flops_counts_top_k_experts_per_token_as_torch_counts_them():
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny("mixtral")
    res = lp.prune_clusters(model, "auto", target_flops=0.6, seq_len=16)
    assert res.size.cluster_kept["experts.0"] == 4  # each token runs top_k experts: dropping experts saves no FLOPs
    assert res.size.cluster_kept["mlp.0"] < 48
    shrunk = lp.shrink(model, res)
    shrunk.set_experts_implementation("eager")  # torch's counter does not see grouped_mm
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        shrunk(ids(batch=1, length=16))
    assert counter.get_total_flops() == 16 * res.size.achieved


def test_layer_units_drop_whole_moe_layers_exactly_with_stock_reload(tmp_path):
    model = tiny("qwen3_moe")
    clusters = lp.presets.resolve_preset("moe", model, layers=True)
    res = lp.prune_clusters(model, clusters, target_layers=1, target_params=0.5)
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert reloaded.config.num_hidden_layers == 1


def test_query_heads_inside_kv_groups_next_to_experts(tmp_path):
    model = tiny("qwen3_moe")
    res = lp.prune_clusters(model, lp.presets.resolve_preset("moe", model, query_heads=True), 0.5)
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert (reloaded.config.num_attention_heads, reloaded.config.num_key_value_heads) == (2, 2)


def test_per_layer_expert_counts_export_in_our_format_and_reload_exactly(tmp_path):
    """Layers keeping different numbers of experts: no stock config holds that, so the export carries our entry and
    ``load_pretrained`` rebuilds it (transformers' own save would write Mixtral's per-expert legacy key names)."""
    import dataclasses

    model = tiny("mixtral")
    (experts,) = [d for d in lp.presets.moe(model) if d.name == "experts.{layer}"]

    def layer(i: int, target: float) -> lp.Cluster:
        fix = lambda p: p.replace(r"(?P<layer>\d+)", str(i))  # noqa: E731
        return dataclasses.replace(experts, name=f"experts.{i}", writers=[fix(w) for w in experts.writers],
                                   readers=[fix(r) for r in experts.readers], target=target)  # fmt: skip

    res = lp.prune_clusters(model, [layer(0, 0.25), layer(1, 0.5)], 0.5)
    assert [len(res.dropped["experts.0"]), len(res.dropped["experts.1"])] == [1, 2]
    x = ids()
    with torch.no_grad():
        masked = model(x).logits
    small = lp.shrink(model, res)
    lp.save_pretrained(small, tmp_path / "out")
    again = lp.load_pretrained(tmp_path / "out")
    assert [again.model.layers[i].mlp.experts.gate_up_proj.shape[0] for i in range(2)] == [3, 2]
    with torch.no_grad():
        assert rel(again(x).logits, masked) < 1e-4


@pytest.mark.parametrize("option", ["experts", "mlp", "query_heads"])
def test_the_moe_preset_refuses_options_that_are_not_bools(option):
    """Audit 2026-12b C7 for ``presets.moe``: ``experts="no"`` is truthy and was never checked."""
    with pytest.raises(ValueError, match=rf"presets.moe: `{option}` must be a bool \(True or False\), got 'no'"):
        lp.presets.moe(tiny("mixtral"), **{option: "no"})


# ---------------------------------------------------------------- every family with fused experts, by structure
#: model_type -> (config field of the expert count, of the experts' width). Built by tests.common.lm_zoo (hidden 64,
#: 2 layers, 4 experts, top-2, expert width 128, every parameter jittered: biases and sinks are not zero).
FUSED = {
    "phimoe": ("num_local_experts", "intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
    "granitemoeshared": ("num_local_experts", "intermediate_size"),
    "flex_olmo": ("num_experts", "intermediate_size"),
    "minimax_m2": ("num_local_experts", "intermediate_size"),
    "cohere2_moe": ("num_experts", "intermediate_size"),
    "llama4_text": ("num_local_experts", "intermediate_size"),  # experts run densely; a shared expert as wide
    "minimax": ("num_local_experts", "intermediate_size"),  # linear-attention layers between full-attention ones
}


def zoo(model_type: str, **overrides) -> nn.Module:
    from tests.common.lm_zoo import build

    return build(model_type, **overrides)


@pytest.mark.parametrize("model_type", sorted(FUSED))
def test_auto_cuts_whole_experts_and_their_channels_in_every_fused_family(model_type, tmp_path):
    model = zoo(model_type)
    assert lp.presets.registry.detect(model) == "moe"  # by structure, not by model_type
    res = lp.prune_clusters(model, "auto", 0.5, calibration=[ids(seed=2)])
    assert all(len(res.dropped[f"experts.{i}"]) == 2 for i in range(2))
    assert all(len(res.dropped[f"mlp.{i}"]) == 64 for i in range(2))
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    count, width = FUSED[model_type]
    assert (getattr(reloaded.config, count), getattr(reloaded.config, width)) == (2, 64)
    assert reloaded.config.num_experts_per_tok == 2


def test_gpt_oss_interleaved_transposed_experts_with_biases_lose_gate_and_up_together(tmp_path, caplog):
    model = zoo("gpt_oss")
    with caplog.at_level("WARNING", logger="lightning_pat.presets.experts"):
        clusters = lp.presets.moe(model)
    assert "sinks" not in caplog.text  # a sink logit per query head is cut with its head (test_lm_gqa_families.py)
    assert [c.name for c in clusters] == ["mlp.{layer}", "heads.{layer}", "experts.{layer}"]
    clusters = [c for c in clusters if c.name != "heads.{layer}"]
    res = lp.prune_clusters(model, clusters, 0.5, calibration=[ids(seed=2)])
    experts = model.model.layers[0].mlp.experts
    dropped = torch.tensor(res.dropped["mlp.0"])
    both = torch.stack([2 * dropped, 2 * dropped + 1], dim=1).flatten()  # gate 2c, up 2c + 1
    assert bool((experts.gate_up_proj[:, :, both] == 0).all())
    assert bool((experts.gate_up_proj_bias[:, both] == 0).all())
    assert bool((experts.down_proj[:, dropped] == 0).all())
    gone = res.dropped["experts.0"]
    assert bool((model.model.layers[0].mlp.router.bias[gone] == 0).all())
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    block = reloaded.model.layers[0].mlp
    assert tuple(block.experts.gate_up_proj.shape) == (2, 64, 128)
    assert tuple(block.experts.down_proj_bias.shape) == (2, 64)
    assert tuple(block.router.bias.shape) == (2,)


def test_granitemoe_shared_mlp_is_an_mlp_cluster_with_its_config_field(tmp_path):
    model = zoo("granitemoeshared")
    res = lp.prune_clusters(model, "auto", 0.5)
    assert len(res.dropped["shared.0"]) == 24  # shared_intermediate_size 48
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    assert (reloaded.config.shared_intermediate_size, reloaded.config.intermediate_size) == (24, 64)


def test_minimax_m2_selection_bias_of_dropped_experts_is_routed_around_and_cut(tmp_path):
    """MiniMax-M2 picks experts by sigmoid(logit) + e_score_correction_bias: a large bias on a dropped expert must
    not get it picked in the masked model, and the shrunk block keeps the kept experts' biases."""
    model = zoo("minimax_m2")
    clusters = lp.presets.resolve_preset("moe", model, mlp=False, heads=False)
    res = lp.prune_clusters(model, clusters, 0.5)
    with torch.no_grad():
        for i in range(2):
            block = model.model.layers[i].mlp
            block.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 4))
            block.e_score_correction_bias[res.dropped[f"experts.{i}"]] = 5.0  # would always win without the hook
    kept = [e for e in range(4) if e not in res.dropped["experts.1"]]
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    torch.testing.assert_close(reloaded.model.layers[1].mlp.e_score_correction_bias, torch.linspace(-0.5, 0.5, 4)[kept])


class _TransposedRouter(nn.Module):
    """A router that makes its logits as ``x @ weight.T`` in float32 (not F.linear), softmax then top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        logits = x @ self.weight.float().T
        return logits, *torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)


def test_routing_masks_logits_made_by_matmul_with_the_transposed_weight():
    from lightning_pat.core.routing import route_around_dropped

    router = _TransposedRouter()
    [rc] = lp.resolve_clusters(router, lp.Cluster("experts", ["weight"]))
    assert route_around_dropped(router, [rc]) == 1
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.weight[[0, 3]] = 0.0
        _, values, index = router(x)
        want_v, want_i = torch.topk(torch.softmax(x @ router.weight[[1, 2, 4]].T, dim=-1), 2, dim=-1)
    assert torch.equal(index, torch.tensor([1, 2, 4])[want_i])
    torch.testing.assert_close(values, want_v)


class ZooMoEStep(MoEStep):
    """:class:`MoEStep` on a tiny zoo MoE model."""

    def __init__(self, model_type: str) -> None:
        pl.LightningModule.__init__(self)
        self.model = zoo(model_type)


def _config_sizes(config) -> tuple[int, int]:
    """(routed experts, experts' width) of a config, whatever the family calls them."""
    count = next(
        getattr(config, n) for n in ("n_routed_experts", "num_local_experts", "num_experts") if hasattr(config, n)
    )
    width = config.moe_intermediate_size if hasattr(config, "moe_intermediate_size") else config.intermediate_size
    return count, width


#: Issue 37's done-when families (Mixtral's own callback tests are above; DeepSeek-V3's below), a second each.
CALLBACK_FAMILIES = ["phimoe", "gpt_oss", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared"]


@pytest.mark.parametrize("model_type", CALLBACK_FAMILIES)
def test_callback_prunes_experts_and_channels_of_each_family_then_shrinks_exactly(model_type, tmp_path):
    module = ZooMoEStep(model_type)
    count, width = _config_sizes(module.model.config)
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=5, callbacks=[cb]).fit(module)
    for i in range(2):
        assert (len(cb.dropped[f"experts.{i}"]), len(cb.dropped[f"mlp.{i}"])) == (count // 2, width // 2)
    reloaded = assert_shrinks_exactly_and_reloads(module.model.eval(), cb, tmp_path)
    assert _config_sizes(reloaded.config) == (count // 2, width // 2)


# ---------------------------------------------------------------- DeepSeek-V2/V3: MLA, group-limited routing
def deepseek(model_type: str) -> nn.Module:
    """A tiny DeepSeek (tests.common.lm_zoo: 8 experts in 2 groups, top-2 from 1 group, a dense first layer), with a
    selection bias (V3) that would pick the dropped experts if the masked model did not route around them; V2 routes
    group-limited too (its default is greedy top-k over all experts)."""
    model = zoo(model_type, **({"topk_method": "group_limited_greedy"} if model_type == "deepseek_v2" else {}))
    gate = model.model.layers[1].mlp.gate
    if hasattr(gate, "e_score_correction_bias"):
        gate.e_score_correction_bias.copy_(torch.linspace(0.3, -0.3, 8))
    return model


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_cuts_mla_heads_mlps_shared_and_routed_experts_exactly_with_stock_reload(model_type, tmp_path):
    model = deepseek(model_type)
    with torch.no_grad():
        dense = model(ids()).logits
    res = lp.prune_clusters(model, "auto", 0.5, calibration=[ids(seed=2)])
    assert sorted(res.dropped) == ["experts.1", "heads.0", "heads.1", "mlp.0", "mlp.1"]  # mlp.1: experts + shared
    assert all(len(res.dropped[f"heads.{i}"]) == 2 for i in range(2))  # MLA: q, kv_b rows and o columns per head
    dropped = torch.tensor(res.dropped["experts.1"])
    assert torch.bincount(dropped // 4, minlength=2).tolist() == [2, 2]  # each routing group keeps the same number
    gate = model.model.layers[1].mlp.gate
    if hasattr(gate, "e_score_correction_bias"):
        with torch.no_grad():  # the dropped experts would win every group and every top-k without the routing hook
            gate.e_score_correction_bias[dropped] = 5.0
    reloaded = assert_shrinks_exactly_and_reloads(model, res, tmp_path)
    cfg = reloaded.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 2)
    assert reloaded.model.layers[0].self_attn.kv_b_proj.out_features == 2 * (16 + 16)
    with torch.no_grad():
        assert rel(reloaded(ids()).logits, dense) > 1e-3  # something was cut
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (4, 2, 1, 2)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (16, 64)
    block = reloaded.model.layers[1].mlp
    assert block.shared_experts.down_proj.in_features == 16  # moe_intermediate_size * n_shared_experts
    if model_type == "deepseek_v3":
        kept = [e for e in range(8) if e not in res.dropped["experts.1"]]
        torch.testing.assert_close(block.gate.e_score_correction_bias, torch.linspace(0.3, -0.3, 8)[kept])
        assert block.gate.e_score_correction_bias.shape == (4,)


def test_deepseek_v3_refuses_a_cut_its_group_limited_routing_cannot_take():
    model = deepseek("deepseek_v3")
    clusters = lp.presets.resolve_preset("moe", model, mlp=False, heads=False)
    res = lp.prune_clusters(model, clusters, 0.75)  # 1 expert per group: V3 scores a group by its top 2
    with pytest.raises(ValueError, match=r"keeps \[1, 1\] experts per group, .* at least 2"):
        lp.shrink(model, res)


def test_callback_prunes_deepseek_v3_heads_experts_and_mlps_then_shrinks_exactly(tmp_path):
    module = ZooMoEStep("deepseek_v3")
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=5, callbacks=[cb]).fit(module)
    assert (len(cb.dropped["experts.1"]), len(cb.dropped["mlp.0"]), len(cb.dropped["mlp.1"])) == (4, 64, 16)
    assert len(cb.dropped["heads.0"]) == 2
    reloaded = assert_shrinks_exactly_and_reloads(module.model.eval(), cb, tmp_path)
    cfg = reloaded.config
    assert (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_attention_heads) == (4, 16, 2)


def test_experts_only_one_shot_says_reap_ranks_them_not_that_it_falls_back_to_weights(caplog):
    """Whole experts alone with ``calibration``: REAP ranks them; the weights fallback warning is for other clusters."""
    from lightning_pat.scoring.experts import expert_scores

    model = tiny("mixtral")
    clusters = lp.presets.moe(model, mlp=False, heads=False)
    batches = [ids(seed=2)]
    with caplog.at_level("INFO", logger="lightning_pat.pruning.api"):
        res = lp.prune_clusters(model, clusters, 0.5, calibration=batches, expert_score="reap")
    assert "ranked by expert_score='reap'" in caplog.text
    assert "falls back to the weights" not in caplog.text
    # and REAP did rank them: each layer drops its lowest REAP scores (recomputed on the dense copy)
    dense = tiny("mixtral")
    reap = expert_scores(dense, lp.resolve_clusters(dense, clusters), batches)
    for name, dropped in res.dropped.items():
        order = sorted(range(len(reap[name])), key=lambda e: float(reap[name][e]))
        assert sorted(dropped) == sorted(order[: len(dropped)]), name
