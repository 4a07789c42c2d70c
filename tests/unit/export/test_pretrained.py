"""Export round trips: stock ``from_pretrained`` where the config can express the shrunk sizes, ``load_pretrained``
for everything else (GPT-2 with dropped heads, per-layer widths, Qwen3 residual, plain modules)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, load_pretrained, presets, prune_clusters, save_pretrained, shrink
from lightning_pat.demo import preset as demo_preset
from lightning_pat.export.pretrained import ENTRY, EXPORT_MARKER, SIZES_FILE
from tests.common.tiny_families import FamilyCase, gpt2, llama_like, logits, tiny_gpt, token_ids

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def shrunk(case: FamilyCase, kinds: tuple[str, ...], frac: float = 0.5, *, budget: bool = False) -> nn.Module:
    model = case.fresh()
    decls = presets.PRESETS[case.preset](model, **{k: k in kinds for k in ("mlp", "heads", "residual")})
    if budget:
        with torch.no_grad():  # layers of different magnitude: a shared budget gives them different widths
            for i, layer in enumerate(model.get_submodule(case.layers)):
                for p in layer.parameters():
                    p.mul_(1.0 + i)
        decls = [Cluster(**{**c.__dict__, "budget": "mlp"}) if c.name.startswith("mlp") else c for c in decls]
    result = prune_clusters(model, decls, frac)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return shrink(model, result)


def eager(model: nn.Module) -> nn.Module:
    """The tiny cases run eager attention; a loaded model defaults to sdpa (1e-5 apart): compare like with like."""
    if hasattr(model, "config") and hasattr(model.config, "_attn_implementation"):
        model.config._attn_implementation = "eager"
    return model


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


STOCK = [
    (llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True), ("mlp", "heads")),
    (llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3), ("mlp", "heads", "residual")),
    (llama_like("mistral", n_head=4, n_kv=2), ("residual",)),
    (llama_like("qwen2", n_head=4, n_kv=4), ("mlp", "heads", "residual")),
    (llama_like("qwen3", n_head=4, n_kv=2, bias=True, tied=True), ("mlp", "heads")),
]


@pytest.mark.parametrize(("case", "kinds"), STOCK, ids=[f"{c.id}-{'+'.join(k)}" for c, k in STOCK])
def test_uniform_hf_export_loads_with_stock_from_pretrained(tmp_path, case, kinds):
    model = shrunk(case, kinds)
    ids = token_ids()
    ref = logits(model, ids)
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert ENTRY not in config
    attn = model.model.layers[0].self_attn
    assert config["intermediate_size"] == model.model.layers[0].mlp.down_proj.in_features
    assert config["num_attention_heads"] * config["head_dim"] == attn.q_proj.out_features
    assert config["num_key_value_heads"] * config["head_dim"] == attn.k_proj.out_features
    assert config["head_dim"] == case.head_dim
    assert config["hidden_size"] == model.model.embed_tokens.embedding_dim
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(again) is type(model)
    assert max_err(logits(eager(again), ids), ref) < 1e-6
    assert max_err(logits(eager(load_pretrained(tmp_path)), ids), ref) < 1e-6


@pytest.mark.slow
def test_stock_export_loads_in_a_process_without_lightning_pat(tmp_path):
    case = llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True)
    model = shrunk(case, ("mlp", "heads", "residual"))
    ids = token_ids()
    torch.save({"ids": ids, "ref": logits(model, ids)}, tmp_path / "ref.pt")
    save_pretrained(model, tmp_path / "small")
    code = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1] + '/small')\n"
        "d = torch.load(sys.argv[1] + '/ref.pt')\n"
        "out = m(d['ids']).logits.detach()\n"
        "assert 'lightning_pat' not in sys.modules\n"
        "print(float((out - d['ref']).abs().max() / d['ref'].abs().max()))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5


CUSTOM = [
    (gpt2(n_head=4), ("mlp", "heads"), False, "c_attn"),
    (gpt2(n_head=2, tied=False, n_layer=3), ("residual",), False, "c_attn"),
    (llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3), ("mlp", "heads"), True, "mlp"),
    (llama_like("qwen3", n_head=4, n_kv=2, bias=True, tied=True), ("residual",), False, "variance_epsilon"),
    (tiny_gpt(n_head=4, n_kv=4), ("mlp", "heads"), True, None),
]


@pytest.mark.parametrize(
    ("case", "kinds", "budget", "why"), CUSTOM, ids=[f"{c[0].id}-{'+'.join(c[1])}" + "-budget" * c[2] for c in CUSTOM]
)
def test_shapes_a_stock_config_cannot_express_load_with_load_pretrained(tmp_path, case, kinds, budget, why):
    model = shrunk(case, kinds, budget=budget)
    ids = token_ids()
    ref = logits(model, ids)
    save_pretrained(model, tmp_path)
    again = load_pretrained(tmp_path)
    assert type(again) is type(model)
    assert max_err(logits(eager(again), ids), ref) < 1e-6
    assert {n: p.shape for n, p in again.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    if case.tied:
        assert (
            again.lm_head.weight is (again.embed if case.preset == "tiny_gpt" else again.get_input_embeddings()).weight
        )
    if why is None:  # a plain module: torch.save + sizes JSON
        info = json.loads((tmp_path / SIZES_FILE).read_text())
        assert info["shapes"] == {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        assert info["config"]["n_head"] == model.config.n_head
        return
    entry = json.loads((tmp_path / "config.json").read_text())[ENTRY]
    assert entry["loader"] == "lightning_pat.load_pretrained"
    assert any(why in line for line in entry["why"])
    assert entry["shapes"] == {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if why != "variance_epsilon":  # size mismatch: stock loading refuses instead of loading garbage
        with pytest.raises(RuntimeError, match="mismatch"):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    save_pretrained(again, tmp_path / "again")  # a loaded export exports again
    assert max_err(logits(eager(load_pretrained(tmp_path / "again")), ids), ref) < 1e-6


def test_budget_export_records_per_layer_widths(tmp_path):
    case = llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3)
    model = shrunk(case, ("mlp",), budget=True)
    widths = [layer.mlp.down_proj.in_features for layer in model.model.layers]
    assert len(set(widths)) > 1
    save_pretrained(model, tmp_path)
    entry = json.loads((tmp_path / "config.json").read_text())[ENTRY]
    recorded = [
        entry["attributes"].get(f"model.layers.{i}.mlp", {}).get("intermediate_size", case.ff) for i in range(3)
    ]
    assert recorded == widths  # only what differs from the base config is recorded


def test_the_per_layer_width_warning_names_the_destination(tmp_path, caplog):
    """Issue 23 (D1): not the temporary ``.partial-*`` directory the export was built in."""
    import logging

    case = llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3)
    model = shrunk(case, ("mlp",), budget=True)
    with caplog.at_level(logging.WARNING, logger="lightning_pat.export.pretrained"):
        save_pretrained(model, tmp_path / "ranked")
    (message,) = [r.getMessage() for r in caplog.records if "cannot express" in r.getMessage()]
    assert f"lightning_pat.load_pretrained('{tmp_path / 'ranked'}')" in message
    assert ".partial" not in message


def test_plain_sequential_round_trip_and_errors(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    shrink(net, prune_clusters(net, presets.linear_chain(net), 0.5))
    x = torch.randn(4, 5)
    save_pretrained(net, tmp_path)
    again = load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(x), net(x), rtol=0, atol=0)
    info = json.loads((tmp_path / SIZES_FILE).read_text())
    info["shapes"]["0.weight"] = [16, 5]
    (tmp_path / SIZES_FILE).write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"gives 0.weight the shape \[16, 5\], but .*model.safetensors holds \[8, 5\]"):
        load_pretrained(tmp_path)  # checked against the safetensors header, before anything is built
    with pytest.raises(FileNotFoundError, match="neither config.json"):
        load_pretrained(tmp_path / "missing")


def test_head_count_the_stock_config_refuses_still_exports(tmp_path):
    """Llama validates hidden_size % num_attention_heads == 0 even with an explicit head_dim: 3 heads of 8 in d=32."""
    case = llama_like("llama", n_head=4, n_kv=4)
    model = shrunk(case, ("heads",), frac=0.25)
    assert model.config.num_attention_heads == 3
    ids = token_ids()
    ref = logits(model, ids)
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_attention_heads"] == 3
    assert "does not validate" in config[ENTRY]["why"][0]
    with pytest.raises(Exception, match="multiple of the number of attention heads"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert max_err(logits(eager(load_pretrained(tmp_path)), ids), ref) < 1e-6


def test_readme_shrink_block_runs(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = re.search(r"## Shrink and export\n\n.*?```python\n(.*?)```", readme, re.S)
    assert code is not None, "README lost its shrink example"
    case = tiny_gpt(n_head=4, n_kv=2)
    model = case.fresh()
    pruning = prune_clusters(model, demo_preset.tiny_gpt(model), 0.5)
    ids = token_ids()
    ref = logits(model, ids)
    namespace = {"model": model, "pruning": pruning}
    exec(code.group(1).replace("out/small", str(tmp_path / "small")), namespace)  # noqa: S102 - our own README
    assert max_err(logits(namespace["small"], ids), ref) < 1e-6


def test_export_errors(tmp_path):
    from lightning_pat.shrink import BASE_CONFIG_ATTR

    model = shrunk(gpt2(n_head=4), ("heads",))
    setattr(model, BASE_CONFIG_ATTR, {"model_type": "gpt2", "n_embd": 32, "n_head": 5})  # cannot build
    with pytest.raises(ValueError, match="not expressible by its config"):
        save_pretrained(model, tmp_path / "bad")
    model = shrunk(gpt2(n_head=4), ("heads",))
    save_pretrained(model, tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config[ENTRY]["version"] = 99
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="export version 99"):
        load_pretrained(tmp_path / "ok")


def test_shrinking_a_wrapper_updates_and_exports_the_inner_model(tmp_path):
    """A LightningModule holds the HF model as `self.model`: its config and base config are the inner model's."""
    from lightning_pat.shrink import BASE_CONFIG_ATTR

    case = llama_like("llama", n_head=4, n_kv=2, bias=True, tied=True)

    class Lit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = case.fresh()

    lit = Lit()
    result = prune_clusters(lit, presets.llama(lit), 0.5)
    ids = token_ids()
    ref = logits(lit.model, ids)
    shrink(lit, result)
    config = lit.model.config
    assert config.intermediate_size == case.ff - len(result.dropped["mlp.0"])
    assert config.num_key_value_heads == case.n_kv - len(result.dropped["heads.0"])
    assert getattr(lit.model, BASE_CONFIG_ATTR)["intermediate_size"] == case.ff
    save_pretrained(lit.model, tmp_path)
    assert ENTRY not in json.loads((tmp_path / "config.json").read_text())
    again = eager(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    assert max_err(logits(again, ids), ref) < 1e-6


# ---------------------------------------------------------------------------------------------------- safe by default
def test_module_export_is_safetensors_and_json_and_loads_without_unpickling(tmp_path, monkeypatch):
    import pickle

    model = shrunk(tiny_gpt(n_head=4, n_kv=2), ("mlp", "heads"), budget=True)
    ids = token_ids()
    ref = logits(model, ids)
    save_pretrained(model, tmp_path / "small")
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == ["lightning_pat.json", "model.safetensors"]

    def refuse(*args, **kwargs):
        raise AssertionError("load_pretrained unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    again = load_pretrained(tmp_path / "small")
    assert type(again) is type(model)
    assert again.config == model.config
    assert (again.lm_head.weight is again.embed.weight) == (model.lm_head.weight is model.embed.weight)
    assert {n: p.shape for n, p in again.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    assert [layer.mlp.down_proj.in_features for layer in again.layers] == [
        layer.mlp.down_proj.in_features for layer in model.layers
    ]
    assert max_err(logits(again, ids), ref) == 0.0


class _OwnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.GELU(approximate="tanh"), nn.Linear(6, 2))
        self.scale = 0.5
        self.register_buffer("offset", torch.arange(2.0))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.offset


def test_own_module_class_is_rebuilt_only_when_passed(tmp_path):
    torch.manual_seed(0)
    net = _OwnNet()
    net.body[0].weight.requires_grad_(False)
    save_pretrained(net, tmp_path)
    own = r"names the class 'tests.unit.export.test_pretrained._OwnNet'.*classes=\[_OwnNet\]"
    with pytest.raises(ValueError, match=own):
        load_pretrained(tmp_path)
    again = load_pretrained(tmp_path, classes=[_OwnNet])
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(again(x), net(x))
    assert again.scale == 0.5
    assert again.body[1].approximate == "tanh"
    assert not again.body[0].weight.requires_grad
    assert again.body[2].weight.requires_grad
    assert "scratch" not in again.state_dict()
    assert torch.equal(again.scratch, net.scratch)


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.act = torch.tanh  # a function held as an attribute: the safe format cannot store it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_nothing_is_pickled_and_a_v1_pickled_export_is_refused_with_the_conversion(tmp_path, monkeypatch):
    import inspect
    import pickle

    net = _WithFunction()
    with pytest.raises(ValueError, match=r"cannot store module \(root\) \(_WithFunction\): attribute .act.*never"):
        save_pretrained(net, tmp_path / "safe")
    assert not (tmp_path / "safe").exists()
    assert "unsafe_pickle" not in inspect.signature(save_pretrained).parameters  # DESIGN rule 10: no opt-in either
    assert "unsafe_pickle" not in inspect.signature(load_pretrained).parameters
    # a version-1 export as lightning_pat before 0.2 wrote it: a pickled model.pt, never unpickled
    out = save_pretrained(nn.Linear(2, 2), tmp_path / "v1")
    torch.save(nn.Linear(2, 2), out / "model.pt")
    info = json.loads((out / SIZES_FILE).read_text())
    info.update(format="torch.save", file="model.pt", version=1)
    (out / SIZES_FILE).write_text(json.dumps(info))

    def refuse(*args, **kwargs):
        raise AssertionError("load_pretrained unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    with pytest.raises(
        ValueError,
        match=r"model.pt is a pickled module .*version 1.*never unpickles.*torch.load.*"
        r"save_pretrained\(model, new_dir\)",
    ):
        load_pretrained(out)


def test_failed_save_leaves_the_previous_export_intact(tmp_path, monkeypatch):
    import safetensors.torch

    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(3, 4))
    save_pretrained(first, tmp_path / "out")
    real = safetensors.torch.save_file

    def half_then_fail(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(20)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(nn.Sequential(nn.Linear(3, 5)), tmp_path / "out", overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial directory left behind
    again = load_pretrained(tmp_path / "out")
    assert torch.equal(again[0].weight, first[0].weight)


def test_overwrite_replaces_the_whole_export_and_loads_what_transformers_loads(tmp_path):
    out = tmp_path / "out"
    save_pretrained(nn.Sequential(nn.Linear(3, 4)), out)
    case = llama_like("llama", n_head=4, n_kv=2)
    model = shrunk(case, ("mlp",))
    with pytest.raises(FileExistsError, match="is not empty"):
        save_pretrained(model, out)
    assert isinstance(load_pretrained(out), nn.Sequential)  # refused: the old export is untouched
    ids = token_ids()
    ref = logits(model, ids)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # a sharded model directory, not ours
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with pytest.raises(FileExistsError, match=r"sharded was not written by lightning_pat .*lightning_pat_export.json"):
        save_pretrained(model, tmp_path / "sharded", overwrite=True)  # it may be the model a run was loaded from
    (tmp_path / "sharded" / EXPORT_MARKER).write_text("{}")  # as if an earlier export of ours was sharded
    save_pretrained(model, tmp_path / "sharded", overwrite=True)
    assert not (tmp_path / "sharded" / "model.safetensors.index.json").exists()  # old files removed
    save_pretrained(model, out, overwrite=True)
    assert not (out / SIZES_FILE).exists()
    assert max_err(logits(eager(load_pretrained(out)), ids), ref) < 1e-6
    # a stale index next to model.safetensors (left by another tool): transformers reads model.safetensors, so do we
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00009.bin"}}))
    assert max_err(logits(eager(load_pretrained(out)), ids), ref) < 1e-6


def test_save_never_writes_through_a_symlink_in_the_target(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / SIZES_FILE).symlink_to(victim)
    (out / "model.safetensors").symlink_to(tmp_path / "victim.safetensors")
    net = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(FileExistsError, match="is not empty"):
        save_pretrained(net, out)
    save_pretrained(net, out, overwrite=True)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "victim.safetensors").exists()
    assert not (out / SIZES_FILE).is_symlink()
    assert torch.equal(load_pretrained(out)[0].weight, net[0].weight)


@pytest.mark.parametrize(
    ("case", "kinds", "budget"),
    [
        (gpt2(n_head=4), ("mlp", "heads"), False),
        (llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3), ("mlp", "heads"), True),
    ],
    ids=["gpt2-dropped-heads", "llama-per-layer-widths"],
)
def test_the_models_own_save_pretrained_reloads_exactly(tmp_path, case, kinds, budget):
    """The Hugging Face habit `small.save_pretrained(dir)`: the shrink put the entry on `small.config`."""
    model = shrunk(case, kinds, budget=budget)
    ids = token_ids()
    ref = logits(model, ids)
    assert ENTRY in model.config.to_dict()
    model.save_pretrained(tmp_path / "own")
    again = load_pretrained(tmp_path / "own")
    assert type(again) is type(model)
    assert {n: p.shape for n, p in again.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    assert max_err(logits(eager(again), ids), ref) < 1e-6
    again.save_pretrained(tmp_path / "again")  # a loaded export keeps the entry for its own save_pretrained
    assert max_err(logits(eager(load_pretrained(tmp_path / "again")), ids), ref) < 1e-6


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda a: a.update(nope={"x": 1}), r"names the module 'nope', which the model .* does not have"),
        (lambda a: a.setdefault("model", {}).update(forward="x"), r"attribute 'forward' of module 'model' .* refused"),
        (lambda a: a.setdefault("model", {}).update(_parameters={}), r"attribute '_parameters' .* refused"),
        (lambda a: a.setdefault("model", {}).update(padding_idx={"a": 1}), r"attribute 'padding_idx' .* plain value"),
        (lambda a: a.update(model=[1]), r"the attributes of module 'model' must be a mapping"),
    ],
    ids=["unknown-module", "method", "private", "not-a-scalar", "not-a-mapping"],
)
def test_a_crafted_entry_attribute_is_refused(tmp_path, edit, match):
    """Issue 23 (the audit's "not covered": crafted lightning_pat entries in config.json): the entry may set only
    public plain attributes (sizes, head counts, eps) of modules the model has, never a method or an internal."""
    case = llama_like("llama", n_head=8, n_kv=2, bias=True, d=64, ff=40, n_layer=3)
    save_pretrained(shrunk(case, ("mlp",), budget=True), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config[ENTRY]["attributes"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)
