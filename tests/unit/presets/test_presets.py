"""Presets on tiny models of every family: they resolve, change nothing at target 0, and leave dead units at 50%.

"Dead" is checked on activations, independently of the preset code: forward hooks record the inputs of the modules
that read a unit (down projection for MLP channels, output projection for heads / query groups, every module fed by
the residual stream and the hidden states after each block for residual channels) and the dropped units must be
exactly zero there for random token ids, while every kept unit is non-zero somewhere.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, presets, prune_clusters, resolve_clusters
from lightning_pat.demo import preset as demo_preset
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from tests.common.tiny_families import CASES, FamilyCase, gpt2, llama_like, logits, tiny_gpt, token_ids

pytest.importorskip("transformers")  # a guard only: the test extra installs it, so these tests run in CI
pytestmark = pytest.mark.usefixtures("single_thread")

KINDS = ("mlp", "heads", "residual")
case_params = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


# ---------------------------------------------------------------------------------------------------- helpers


@contextmanager
def recording(model: nn.Module, inputs: list[str], outputs: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Record the first positional input of ``inputs`` modules and the (first) output of ``outputs`` modules."""
    store: dict[str, torch.Tensor] = {}

    def pre(name):
        def hook(_mod, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            store[name] = x.detach().clone()

        return hook

    def post(name):
        def hook(_mod, _args, out):
            store[name] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(pre(n), with_kwargs=True) for n in inputs]
    handles += [model.get_submodule(n).register_forward_hook(post(n)) for n in outputs]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def unit_mask(dropped: list[int], *, width: int, block: int) -> torch.Tensor:
    mask = torch.zeros(width, dtype=torch.bool)
    for u in dropped:
        mask[u * block : (u + 1) * block] = True
    return mask


def assert_dead(x: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    x = x.reshape(-1, x.shape[-1])
    assert x.shape[-1] == mask.numel(), what
    assert bool((x[:, mask] == 0).all()), f"{what}: a dropped unit is not exactly zero"
    assert bool((x[:, ~mask] != 0).any(dim=0).all()), f"{what}: a kept unit is zero for every token"


def expected_drop(num_units: int) -> int:
    return math.ceil(0.5 * num_units)


def clusters_of(case: FamilyCase, model: nn.Module, kinds: tuple[str, ...]) -> list[Cluster]:
    return presets.get(case.preset)(model, **{k: k in kinds for k in KINDS})


def check_mlp(case: FamilyCase, model: nn.Module, dropped: dict[str, list[int]], root: str = "") -> None:
    layer = [f"{root}{case.layers}.{i}" for i in range(case.n_layer)]
    with recording(model, [f"{name}.{case.down}" for name in layer], []) as seen:
        logits(model, token_ids())
    for i, name in enumerate(layer):
        assert len(dropped[f"mlp.{i}"]) == expected_drop(case.ff)
        mask = unit_mask(dropped[f"mlp.{i}"], width=case.ff, block=1)
        assert_dead(seen[f"{name}.{case.down}"], mask, f"{case.id} mlp.{i}")


def check_heads(case: FamilyCase, model: nn.Module, dropped: dict[str, list[int]], root: str = "") -> None:
    layer = [f"{root}{case.layers}.{i}" for i in range(case.n_layer)]
    with recording(model, [f"{name}.{case.o}" for name in layer], []) as seen:
        logits(model, token_ids())
    for i, name in enumerate(layer):
        assert len(dropped[f"heads.{i}"]) == expected_drop(case.n_kv)
        mask = unit_mask(dropped[f"heads.{i}"], width=case.n_head * case.head_dim, block=case.group_width)
        assert_dead(seen[f"{name}.{case.o}"], mask, f"{case.id} heads.{i}")


def check_residual(case: FamilyCase, model: nn.Module, dropped: dict[str, list[int]], root: str = "") -> None:
    layer = [f"{root}{case.layers}.{i}" for i in range(case.n_layer)]
    readers = [f"{name}.{sub}" for name in layer for sub in case.reads_residual] + [f"{root}lm_head"]
    with recording(model, readers, layer) as seen:
        logits(model, token_ids())
    assert len(dropped["residual"]) == expected_drop(case.d)
    mask = unit_mask(dropped["residual"], width=case.d, block=1)
    for name in readers + layer:
        assert_dead(seen[name], mask, f"{case.id} residual at {name}")


CHECKS = {"mlp": check_mlp, "heads": check_heads, "residual": check_residual}


# ---------------------------------------------------------------------------------------------------- families
@case_params
def test_preset_resolves_every_parameter(case):
    model = case.fresh()
    resolved = resolve_clusters(model, clusters_of(case, model, KINDS))
    L = case.n_layer
    assert [rc.name for rc in resolved] == [f"mlp.{i}" for i in range(L)] + [f"heads.{i}" for i in range(L)] + [
        "residual"
    ]
    by_name = {rc.name: rc for rc in resolved}
    assert {by_name[f"mlp.{i}"].num_units for i in range(L)} == {case.ff}
    assert {by_name[f"heads.{i}"].num_units for i in range(L)} == {case.n_kv}
    assert by_name["residual"].num_units == case.d
    # mlp + heads + residual together cover every parameter of these models, except Qwen3's per-head q_norm/k_norm
    # (shape [head_dim], shared by every head: on no unit axis)
    covered = {n for rc in resolved for m in rc.members for n in (m.name, *m.aliases)}
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    per_head_norms = {n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert per_head_norms == (
        {n for n in names if ".self_attn." in n and "_norm." in n} if case.preset == "qwen3" else set()
    )
    assert all(model.get_parameter(n).shape == (case.head_dim,) for n in per_head_norms)
    assert covered == names - per_head_norms
    # a tied lm_head is one member (an alias of the embedding), an untied one its own member
    lm_head = [m for m in by_name["residual"].members if "lm_head.weight" in (m.name, *m.aliases)]
    assert len(lm_head) == 1
    assert (lm_head[0].name != "lm_head.weight") == case.tied
    # a unit is a head of k/v (and GPT-2's packed q/k/v) and a whole query group of q/o
    o_member = next(m for m in by_name["heads.0"].members if m.name.endswith(f"{case.o}.weight"))
    assert o_member.block == case.group_width
    assert {m.block for m in by_name["heads.0"].members} <= {case.head_dim, case.group_width}


@case_params
def test_target_zero_leaves_the_model_unchanged(case):
    model = case.fresh()
    ids = token_ids()
    before = logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = prune_clusters(model, clusters_of(case, model, KINDS), 0.0)
    assert all(not v for v in result.dropped.values())
    assert torch.equal(logits(model, ids), before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@case_params
@pytest.mark.parametrize("kind", KINDS)
def test_pruned_units_are_dead(case, kind):
    model = case.fresh()
    if kind == "heads" and case.n_kv == 1:
        _refused_mqa(case, model, (kind,))
        return
    result = prune_clusters(model, clusters_of(case, model, (kind,)), 0.5)
    CHECKS[kind](case, model, result.dropped)


def _refused_mqa(case: FamilyCase, model: nn.Module, kinds: tuple[str, ...]) -> None:
    """One KV head is one unit: any target below 1 would remove every layer's attention, so it is refused."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"every unit of {case.n_layer} cluster\(s\): 'heads\.0' \(target 0.5") as err:
        prune_clusters(model, clusters_of(case, model, kinds), 0.5)
    msg = str(err.value)  # the arithmetic, that nothing changed, and the fix (the MLP alone prunes: see below)
    assert "ceil(0.5 * 1) = 1 of its 1 unit(s)" in msg
    assert "Nothing was pruned" in msg
    assert "preset_options={'heads': False}" in msg
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@case_params
def test_all_kinds_pruned_together_are_dead(case):
    model = case.fresh()
    if case.n_kv == 1:
        _refused_mqa(case, model, KINDS)
        model = case.fresh()
        declared = [
            c if not c.name.startswith("heads") else dataclasses.replace(c, target=0.0)
            for c in clusters_of(case, model, KINDS)
        ]
        result = prune_clusters(model, declared, 0.5)  # the documented fix: heads excluded with target=0
        assert all(not v for k, v in result.dropped.items() if k.startswith("heads"))
        for kind in ("mlp", "residual"):
            CHECKS[kind](case, model, result.dropped)
        return
    result = prune_clusters(model, clusters_of(case, model, KINDS), 0.5)
    for check in CHECKS.values():
        check(case, model, result.dropped)
    assert torch.isfinite(logits(model, token_ids())).all()


# ---------------------------------------------------------------------------------------------------- wrappers
class Wrapper(nn.Module):
    """What a LightningModule looks like: the model under ``self.model``, maybe with extra parameters."""

    def __init__(self, *inner: nn.Module, extra_head: bool = False) -> None:
        super().__init__()
        self.model = inner[0]
        if len(inner) > 1:
            self.teacher = inner[1]
        if extra_head:
            self.score = nn.Linear(32, 3)

    def forward(self, ids):
        return self.model(ids)


def test_wrapped_model_is_detected_and_pruned_under_its_prefix():
    case = llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True)
    wrapper = Wrapper(case.fresh())
    assert presets.detect(wrapper) == "llama"
    clusters = presets.for_model(wrapper, residual=True)
    assert clusters[0].writers[0].startswith(r"re:model\.model\.layers")
    result = prune_clusters(wrapper, clusters, 0.5)
    for check in CHECKS.values():
        check(case, wrapper, result.dropped, root="model.")


@pytest.mark.slow
def test_wrapped_layers_activation_checkpointing_and_per_block_compile():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    case = tiny_gpt(n_head=4, n_kv=2, bias=True, tied=False)
    assert "_wrapped" not in demo_preset.tiny_gpt(case.fresh())[0].writers[0]  # plain models keep short patterns
    model = case.fresh()
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    assert "layers.0._checkpoint_wrapped_module.attn.q_proj.weight" in dict(model.named_parameters())
    result = prune_clusters(model, presets.for_model(model, residual=True), 0.5)
    inner = "_checkpoint_wrapped_module."
    wrapped = dataclasses.replace(
        case, down=inner + case.down, o=inner + case.o, reads_residual=tuple(inner + r for r in case.reads_residual)
    )
    for check in CHECKS.values():
        check(wrapped, model, result.dropped)
    compiled = case.fresh()  # names only: nothing runs, so nothing compiles
    for i, block in enumerate(compiled.layers):
        compiled.layers[i] = torch.compile(block)
    assert "layers.0._orig_mod.attn.q_proj.weight" in dict(compiled.named_parameters())
    assert len(resolve_clusters(compiled, demo_preset.tiny_gpt(compiled, residual=True))) == 2 * case.n_layer + 1


def test_residual_refuses_unknown_parameters():
    case = llama_like("llama", n_head=4, n_kv=2)
    wrapper = Wrapper(case.fresh(), extra_head=True)
    with pytest.raises(ValueError, match=r"\['score.weight', 'score.bias'\] are not part of the llama layout"):
        presets.llama(wrapper, residual=True)
    assert len(resolve_clusters(wrapper, presets.llama(wrapper))) == 2 * case.n_layer  # mlp and heads still work


def test_two_backbones_are_ambiguous():
    case = llama_like("llama", n_head=4, n_kv=2)
    wrapper = Wrapper(case.fresh(), case.fresh())
    with pytest.raises(ValueError, match="Found 2 llama backbones"):
        presets.llama(wrapper)


def test_family_preset_on_another_family_raises():
    with pytest.raises(ValueError, match="this is not a gpt2 model.*Supported families"):
        presets.gpt2(CASES[0].fresh())


# ---------------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize(
    ("case", "family"),
    [(c, {"mistral": "llama", "qwen2": "llama", "qwen3": "llama"}.get(c.preset, c.preset)) for c in CASES],
    ids=[c.id for c in CASES],
)
def test_for_model_detects_the_family(case, family):
    model = case.fresh()
    assert presets.detect(model) == family
    assert presets.for_model(model, residual=True) == presets.PRESETS[family](model, residual=True)


def test_detection_by_model_type_and_by_names():
    model = gpt2(n_head=4).fresh()
    assert model.config.model_type == "gpt2"
    assert presets.detect(model) == "gpt2"
    assert presets.detect(Wrapper(model)) == "gpt2"  # no config on the wrapper: parameter names
    assert presets.detect(TinyGPT(TinyGPTConfig(d_model=16, d_ff=32, vocab_size=8))) == "tiny_gpt"
    assert presets.detect(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))) == "linear_chain"


class _Dense(nn.Module):
    """A Phi-like attention: q/k/v_proj named as Llama's, but the output is ``dense``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.dense = (nn.Linear(8, 8) for _ in range(4))


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = _Dense(), mlp, nn.LayerNorm(8)


def test_detection_reads_the_structure_not_the_names():
    """Llama's anchor name alone is not Llama: every projection of every layer must be the layout's kind."""
    mlp = nn.Module()
    mlp.fc1, mlp.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    phi_like = nn.Module()
    phi_like.layers = nn.ModuleList([_Layer(mlp)])
    with pytest.raises(ValueError, match=r"not llama: layers\.0\.self_attn\.dense \(Linear: weight, bias\) is not"):
        presets.detect(phi_like)
    llama = llama_like("llama", n_head=4, n_kv=2).fresh()
    assert presets.detect(llama) == "llama"
    llama.model.layers[1].mlp.gate_up_proj = nn.Linear(32, 96)  # a fused projection in one layer only
    with pytest.raises(ValueError, match=r"not llama: model\.layers\.1\.mlp\.gate_up_proj"):
        presets.detect(llama)
    bitnet_like = llama_like("llama", n_head=4, n_kv=2).fresh()
    bitnet_like.model.layers[0].self_attn.attn_sub_norm = nn.RMSNorm(32)  # a norm over the heads, not the residual
    with pytest.raises(ValueError, match=r"not llama: model\.layers\.0\.self_attn\.attn_sub_norm \(RMSNorm"):
        presets.detect(bitnet_like)
    gpt = gpt2(n_head=4).fresh()
    gpt.transformer.h[0].attn.c_attn = nn.Linear(32, 96)  # GPT-BigCode's names, nn.Linear instead of Conv1D
    with pytest.raises(ValueError, match=r"not gpt2: transformer\.h\.0\.attn\.c_attn \(Linear"):
        presets.detect(gpt)


def test_a_structural_detector_registers_a_family():
    marker = nn.Sequential(nn.Conv2d(3, 8, 3))
    marker.experts = nn.Parameter(torch.zeros(2, 3, 3))

    def fake(model: nn.Module, **_: bool) -> list[Cluster]:
        return [Cluster("e", ["experts"], num_units=2)]

    presets.register("fake_moe", fake, detector=lambda m: hasattr(m, "experts"))
    try:
        assert presets.detect(marker) == "fake_moe"
        assert presets.for_model(marker) == fake(marker)
    finally:
        presets.PRESETS.pop("fake_moe")
        presets.registry._DETECTORS.pop("fake_moe")


def test_unsupported_model_lists_families_and_how_to_declare():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    with pytest.raises(ValueError, match=r"Cannot detect the model family of Sequential.*llama.*gpt2.*Cluster\("):
        presets.for_model(model)


def test_nothing_selected_raises():
    with pytest.raises(ValueError, match="select at least one"):
        demo_preset.tiny_gpt(TinyGPT(TinyGPTConfig(d_model=16, d_ff=32)), mlp=False, heads=False)


def test_head_dim_missing_raises():
    model = TinyGPT(TinyGPTConfig(d_model=16, d_ff=32))
    del model.layers[0].attn.head_dim
    with pytest.raises(ValueError, match="cannot read `head_dim`"):
        demo_preset.tiny_gpt(model)
    assert len(demo_preset.tiny_gpt(model, heads=False)) == 1


# ---------------------------------------------------------------------------------------------------- registry
def test_get_and_registry():
    assert presets.get("LLAMA") is presets.llama
    assert presets.get("qwen2") is presets.llama
    assert presets.get("qwen3") is presets.llama
    assert presets.get("auto") is presets.for_model
    assert set(presets.PRESETS) >= {"llama", "mistral", "qwen2", "qwen3", "gpt2", "tiny_gpt", "linear_chain"}
    with pytest.raises(ValueError, match=r"Unknown preset 'bert'; expected one of \['llama'"):
        presets.get("bert")


@pytest.mark.slow
def test_tiny_gpt_is_the_demos_preset_registered_on_import():
    """The library knows no tiny_gpt until lightning_pat.demo is imported (a fresh interpreter shows it)."""
    code = (
        "from lightning_pat import presets\n"
        "print('tiny_gpt' in presets.PRESETS)\n"
        "from lightning_pat.demo import TinyGPT, TinyGPTConfig, preset\n"
        "model = TinyGPT(TinyGPTConfig(d_model=16, d_ff=32, vocab_size=8))\n"
        "print(presets.get('tiny_gpt') is preset.tiny_gpt, presets.detect(model))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["False", "True", "tiny_gpt"]
    assert presets.get("TINY_GPT") is demo_preset.tiny_gpt  # imported by this module: registered
    presets.register("tiny_gpt", demo_preset.tiny_gpt, layout=demo_preset.LAYOUT)  # a re-run cell: a no-op
    for name in ("auto", "Mine", "llama"):
        with pytest.raises(ValueError, match=rf"presets.register: cannot register '{name}'"):
            presets.register(name, demo_preset.tiny_gpt)
    assert presets.get("llama") is presets.llama  # nothing was replaced


def test_resolve_preset_accepts_names_auto_declarations_and_mixes():
    model = TinyGPT(TinyGPTConfig(d_model=16, d_ff=32, n_layer=1))
    by_name = presets.resolve_preset("tiny_gpt", model, residual=True)
    assert [c.name for c in by_name] == ["mlp.{layer}", "heads.{layer}", "residual"]
    assert presets.resolve_preset("auto", model, residual=True) == by_name
    own = Cluster(name="extra", writers=["layers.0.attn_norm.weight"])
    assert presets.resolve_preset(own, model) == [own]
    as_dict = {"name": "extra", "writers": ["layers.0.attn_norm.weight"]}
    assert presets.resolve_preset([as_dict], model) == [own]
    mixed = presets.resolve_preset(["tiny_gpt", as_dict], model, heads=False)
    assert [c.name for c in mixed] == ["mlp.{layer}", "extra"]
    assert len(resolve_clusters(model, mixed)) == 2


def test_resolve_preset_errors():
    model = TinyGPT(TinyGPTConfig(d_model=16, d_ff=32, n_layer=1))
    with pytest.raises(
        ValueError,
        match=r"`preset_options` must map some of \('mlp', 'heads', 'residual', 'layers', 'query_heads', 'experts'\) "
        r"to bools",
    ):
        presets.resolve_preset("tiny_gpt", model, hidden=True)
    with pytest.raises(ValueError, match="to bools"):
        presets.resolve_preset("tiny_gpt", model, residual="yes")
    with pytest.raises(ValueError, match="apply to preset names only"):
        presets.resolve_preset([Cluster(name="x", writers=["norm.weight"])], model, residual=True)
    with pytest.raises(ValueError, match="Unknown preset 'nope'"):
        presets.resolve_preset(["nope"], model)
    with pytest.raises(TypeError, match="Expected a `Cluster` or a mapping"):
        presets.resolve_preset([3], model)


# ---------------------------------------------------------------------------------------------------- linear_chain
def test_linear_chain_couples_consecutive_linears_through_activations():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.GELU(), nn.Dropout(0.1), nn.Linear(12, 4))
    clusters = presets.linear_chain(net)
    assert [(c.name, c.writers, c.readers) for c in clusters] == [
        ("hidden.0", ["0.weight", "0.bias"], ["2.weight"]),
        ("hidden.2", ["2.weight", "2.bias"], ["5.weight"]),
    ]
    x = torch.randn(64, 6)
    net.eval()
    with torch.no_grad():
        before = net(x)
    assert prune_clusters(net, clusters, 0.0).dropped == {"hidden.0": [], "hidden.2": []}
    with torch.no_grad():
        assert torch.equal(net(x), before)
    result = prune_clusters(net, clusters, 0.5)
    with recording(net, ["2", "5"], []) as seen, torch.no_grad():
        net(x)
    assert_dead(seen["2"], unit_mask(result.dropped["hidden.0"], width=16, block=1), "hidden.0")
    assert_dead(seen["5"], unit_mask(result.dropped["hidden.2"], width=12, block=1), "hidden.2")


def test_linear_chain_breaks_at_non_elementwise_modules_and_nests():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(4, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 6)
            )
            self.head = nn.Linear(6, 2)  # outside any Sequential: not coupled

    clusters = presets.linear_chain(Net())
    assert [(c.name, c.writers, c.readers) for c in clusters] == [
        ("hidden.body.2", ["body.2.weight", "body.2.bias"], ["body.4.weight"])
    ]
    no_bias = presets.linear_chain(nn.Sequential(nn.Linear(4, 8, bias=False), nn.SiLU(), nn.Linear(8, 2)))
    assert no_bias[0].writers == ["0.weight"]
    with pytest.raises(ValueError, match="no two consecutive nn.Linear"):
        presets.linear_chain(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)))


def test_linear_chain_with_sigmoid_pruned_channels_have_no_effect():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 10), nn.Sigmoid(), nn.Linear(10, 3)).eval()
    dropped = prune_clusters(net, presets.linear_chain(net), 0.5).dropped["hidden.0"]
    x = torch.randn(32, 5)
    with torch.no_grad():
        before = net(x)

    def perturb(_mod, args):
        h = args[0].clone()
        h[:, dropped] += 100.0  # sigmoid(0) = 0.5 is not zero, but nothing reads it
        return (h,)

    handle = net[2].register_forward_pre_hook(perturb)
    try:
        with torch.no_grad():
            assert torch.equal(net(x), before)
    finally:
        handle.remove()


def test_linear_chain_rejects_heads_and_residual():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"only the hidden axes \(mlp=True\).*heads=True"):
        presets.linear_chain(net, heads=True)
    with pytest.raises(ValueError, match="residual=True"):
        presets.resolve_preset("auto", net, residual=True)


@pytest.mark.parametrize("option", ["query_heads", "mlp", "residual"])
def test_preset_functions_refuse_options_that_are_not_bools(option):
    """Audit 2026-12b C7: ``query_heads="no"`` is truthy, so it turned query heads on; refused as preset_options is."""
    pytest.importorskip("transformers")
    models = {
        "llama": llama_like("llama", n_head=4, n_kv=2).build(),
        "gpt2": gpt2(n_head=2).build(),
        "tiny_gpt": TinyGPT(TinyGPTConfig(d_model=16, d_ff=32)),
        "linear_chain": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
    }
    for name, model in models.items():
        with pytest.raises(ValueError, match=rf"presets.{name}: `{option}` must be a bool \(True or False\), got 'no'"):
            presets.get(name)(model, **{option: "no"})


# ---------------------------------------------------------------------------------------------------- limitations
def test_rmsnorm_residual_shrink_is_exact_with_rescaled_weight_and_eps():
    """The documented shrink rule for RMSNorm: weight * sqrt(d / d'), eps * d / d'."""
    torch.manual_seed(0)
    d, kept = 16, torch.arange(0, 16, 2)
    norm = nn.RMSNorm(d, eps=1e-2)
    nn.init.normal_(norm.weight)
    x = torch.randn(4, d)
    x[:, 1::2] = 0.0  # pruned residual channels
    small = nn.RMSNorm(len(kept), eps=1e-2 * d / len(kept))
    with torch.no_grad():
        small.weight.copy_(norm.weight[kept] * math.sqrt(d / len(kept)))
        torch.testing.assert_close(small(x[:, kept]), norm(x)[:, kept])
        naive = nn.RMSNorm(len(kept), eps=1e-2)
        naive.weight.copy_(norm.weight[kept])
        assert not torch.allclose(naive(x[:, kept]), norm(x)[:, kept])


def test_layernorm_residual_is_dead_but_not_removable():
    """GPT-2's LayerNorm: zero weight and bias keep a pruned channel at 0, but its mean still counts the zeros."""
    torch.manual_seed(0)
    d, kept = 16, torch.arange(0, 16, 2)
    norm = nn.LayerNorm(d)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    with torch.no_grad():
        norm.weight[1::2] = 0.0
        norm.bias[1::2] = 0.0
        x = torch.randn(4, d)
        x[:, 1::2] = 0.0
        out = norm(x)
        assert bool((out[:, 1::2] == 0).all())
        small = nn.LayerNorm(len(kept))
        small.weight.copy_(norm.weight[kept])
        small.bias.copy_(norm.bias[kept])
        assert not torch.allclose(small(x[:, kept]), out[:, kept], atol=1e-3)


# ---------------------------------------------------------------------------------------------------- demo model
def test_tiny_gpt_config_and_input_validation():
    with pytest.raises(ValueError, match="n_kv_head"):
        TinyGPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="even head_dim"):
        TinyGPTConfig(d_model=12, n_head=4, n_kv_head=1)
    model = TinyGPT(TinyGPTConfig(vocab_size=8, d_model=16, d_ff=32, max_seq_len=4))
    assert model.lm_head.weight is model.embed.weight
    with pytest.raises(ValueError, match="exceeds `max_seq_len` \\(4\\)"):
        model(torch.zeros(1, 5, dtype=torch.long))
    untied = TinyGPT(TinyGPTConfig(vocab_size=8, d_model=16, d_ff=32, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight


def test_tiny_gpt_is_causal():
    model = TinyGPT(TinyGPTConfig(vocab_size=16, d_model=16, d_ff=32, max_seq_len=8)).eval()
    ids = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 16
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :5], model(changed)[:, :5])
        assert not torch.allclose(model(ids)[:, 5:], model(changed)[:, 5:])


@pytest.mark.parametrize(
    "module",
    [
        "presets/__init__.py",
        "presets/registry.py",
        "presets/transformers.py",
        "presets/chains.py",
        "demo/model.py",
    ],
)
def test_no_lightning_or_transformers_import(module):
    path = Path(__file__).resolve().parents[3] / "lightning_pat" / module
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert not roots & {"lightning", "pytorch_lightning", "transformers", "torchmetrics"}
