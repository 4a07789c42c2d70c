"""Every misuse is a clear error that names the argument or cluster and the fix, and nothing is lost.

Each case asserts the message, and that the module's weights are unchanged and no optimizer has any state (no
step was taken). Construction-time cases never reach a Trainer; fit-time cases fail in ``setup`` / ``on_fit_start``
before the first step. The table of docs/bad-input.md lists these cases.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import Cluster, CoupledPruningCallback
from tests.common.lit_models import MLPModule, allow_short_fit, ends_mid_ramp, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration

W, B, R = "fc1.weight", "fc1.bias", "fc2.weight"


def hidden(**fields) -> Cluster:
    return Cluster(**{"name": "hidden", "writers": [W, B], "readers": [R], **fields})


# (id, callback kwargs, expected message regex, "init" or "fit")
CASES = [
    ("target-above-1", {"target_sparsity": 1.5}, r"`target_sparsity` must be a number \[0.0, 1.0\], got 1.5", "init"),
    ("target-bool", {"target_sparsity": True}, r"`target_sparsity` must be a number .* got True", "init"),
    ("warmup-negative", {"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0, got -1", "init"),
    ("ramp-zero", {"ramp_steps": 0}, r"`ramp_steps` must be an int >= 1, got 0", "init"),
    (
        "size-allocation-unknown",
        {"target_params": 0.5, "target_allocation": "greedy"},
        r"`target_allocation` must be one of \('auto', 'importance', 'fractions'\), got 'greedy'",
        "init",
    ),
    ("cadence-zero", {"every_n_steps": 0}, r"`every_n_steps` must be an int >= 1, got 0", "init"),
    ("ramp-shape", {"ramp": "exp"}, r"`ramp` \(the ramp shape\) must be 'cubic' or 'linear', got 'exp'", "init"),
    ("method", {"method": "l0"}, r"`method` must be one of \('hard', 'group_lasso'\), got 'l0'", "init"),
    ("score", {"score": "max"}, r"`score` must be one of .*'rms'.* got 'max'", "init"),
    ("mode", {"mode": "shadow"}, r"`mode` must be one of \('latent', 'direct'\), got 'shadow'", "init"),
    ("executor", {"executor": "gpu"}, r"`executor` must be one of .* got 'gpu'", "init"),
    ("lasso-no-lambda", {"method": "group_lasso"}, r"needs `reg_lambda` > 0 .*set a strength", "init"),
    ("lambda-negative", {"reg_lambda": -1.0}, r"`reg_lambda` must be a number >= 0.0, got -1.0", "init"),
    ("lambda-inf", {"reg_lambda": float("inf")}, r"`reg_lambda` must be a finite number >= 0.0, got inf", "init"),
    ("heal-string", {"heal": "false"}, r"`heal` must be a bool \(True or False\), got 'false'", "init"),
    ("shrink-on-freeze-string", {"shrink_on_freeze": "no"}, r"`shrink_on_freeze` must be a bool .* got 'no'", "init"),
    ("log-metrics-int", {"log_metrics": 0}, r"`log_metrics` must be a bool \(True or False\), got 0", "init"),
    (
        "cluster-budget-type",
        {"clusters": [hidden(budget=3)]},
        r"Cluster 'hidden': `budget` must be a non-empty name \(str\) or None, got 3",
        "init",
    ),
    ("count-ref-zero", {"group_count_ref": 0}, r"`group_count_ref` must be an int >= 1, got 0", "init"),
    ("clusters-empty", {"clusters": []}, r"`clusters` must be a preset name or a non-empty list", "init"),
    ("preset-typo", {"clusters": "lama"}, r"Unknown preset 'lama'; expected one of \['llama'", "init"),
    ("preset-typo-in-list", {"clusters": ["lama", hidden()]}, r"Unknown preset 'lama'", "init"),
    (
        "mapping-unknown-key",
        {"clusters": [{"name": "hidden", "writer": [W], "readers": [R]}]},
        r"Cluster 'hidden': unknown key\(s\) \['writer'\]; a cluster declaration has the fields \['name', 'writers'",
        "init",
    ),
    ("mapping-no-name", {"clusters": [{"writers": [W]}]}, r"Cluster #0: the mapping .* has no `name`", "init"),
    ("entry-type", {"clusters": [42]}, r"`clusters` entry #0 must be a Cluster, a mapping .* got int", "init"),
    (
        "invalid-regex",
        {"clusters": [Cluster("hidden", writers=["re:fc1\\.(weight"], readers=[R])]},
        r"Cluster 'hidden': writer pattern 're:fc1\\\\.\(weight' is not a valid regular expression",
        "init",
    ),
    ("empty-cluster", {"clusters": [Cluster("hidden")]}, r"Cluster 'hidden' is empty: list at least one", "init"),
    ("writers-string", {"clusters": [hidden(writers=W)]}, r"Cluster 'hidden': `writers` must be a list of", "init"),
    (
        "head-dim-and-units",
        {"clusters": [hidden(head_dim=4, num_units=8)]},
        r"Cluster 'hidden': set `head_dim` or `num_units`, not both",
        "init",
    ),
    (
        "multiple-of-zero",
        {"clusters": [hidden(multiple_of=0)]},
        r"Cluster 'hidden': `multiple_of` must be a pos",
        "init",
    ),
    (
        "cluster-target",
        {"clusters": [hidden(target=1.5)]},
        r"Cluster 'hidden': `target` must be a number in \[0, 1\]",
        "init",
    ),
    (
        "preset-options-typo",
        {"clusters": "auto", "preset_options": {"residul": True}},
        r"`preset_options` must map some of \('mlp', 'heads', 'residual', 'layers', 'query_heads', 'experts'\) "
        r"to bools, got "
        r"\{'residul': True\}",
        "init",
    ),
    ("size-malformed", {"target_params": "4X"}, r"`target_params` must look like '4B', '350M'.* got '4X'", "init"),
    (
        "size-overflow",
        {"target_params": "1e999"},
        r"`target_params` = '1e999' is not a finite size",
        "init",
    ),
    (
        "size-inf",
        {"target_params": float("inf")},
        r"`target_params` must be a finite count or fraction, got inf",
        "init",
    ),
    (
        "size-nan",
        {"target_params": float("nan")},
        r"`target_params` must be a finite count or fraction, got nan",
        "init",
    ),
    ("size-percent-above-100", {"target_params": "150%"}, r"`target_params` = '150%' is above 100%", "init"),
    (
        "size-count-not-whole",
        {"target_params": 1.5},
        r"`target_params` = 1.5 is a count \(above 1\) but not a whole number of parameters",
        "init",
    ),
    (
        "size-count-string-not-whole",
        {"target_params": "1.5"},
        r"`target_params` = '1.5' is a count \(above 1\) but not a whole number of parameters",
        "init",
    ),
    ("size-zero", {"target_params": 0}, r"`target_params` must be positive, got 0", "init"),
    (
        "size-int-1-is-a-count",
        {"target_params": 1},
        r"`target_params` \(1\) is below the smallest size the clusters can reach",
        "fit",
    ),
    (
        "flops-nan",
        {"target_flops": float("nan"), "seq_len": 8},
        r"`target_flops` must be a finite count or fraction, got nan",
        "init",
    ),
    (
        "flops-above-model",
        {"target_flops": "2G", "seq_len": 8},
        r"`target_flops` = '2G' \(2,000,000,000 FLOPs per token\) is above the model's FLOPs per token \(",
        "fit",
    ),
    (
        "preset-options-not-a-mapping",
        {"clusters": "auto", "preset_options": [1]},
        r"`preset_options` must be a mapping of preset option names to bools .* got list \[1\]",
        "init",
    ),
    ("size-side", {"target_params": 0.5, "target_side": "near"}, r"`target_side` must be one of .* got 'near'", "init"),
    (
        "size-with-lasso",
        {"target_params": 0.5, "method": "group_lasso", "reg_lambda": 0.1},
        r"`target_params` solves exact widths for `method='hard'`",
        "init",
    ),
    (
        "layer-score-unknown",
        {"layer_score": "cos"},
        r"`layer_score` must be one of \('cosine', 'weight'\), got 'cos'",
        "init",
    ),
    (
        "expert-score-unknown",
        {"expert_score": "mean"},
        r"`expert_score` must be one of \('reap_sum', 'reap', 'frequency', 'weight'\), got 'mean'",
        "init",
    ),
    (
        "layer-unit-no-module",
        {"clusters": [Cluster("layer.0", writers=[W, R], num_units=1, budget="layers", target=0.0)]},
        r"layer_score='cosine'.*Cluster 'layer.0'.*share no module.*use layer_score='weight'",
        "fit",
    ),
    ("size-layers-alone", {"target_layers": 2}, r"`target_layers` splits a size target .* set `target_params`", "init"),
    (
        "size-layers-without-units",
        {"target_params": 0.5, "target_layers": 2},
        r"`target_layers` = 2 layers to keep, but the clusters hold 0 layer units; add them with preset_options",
        "fit",
    ),
    (
        "size-above-model",
        {"target_params": 1000},
        r"`target_params` = 1000 \(1,000 parameters\) is above the model's size \(420\)",
        "fit",
    ),
    (
        "size-below-reach",
        {"target_params": 10},
        r"`target_params` \(10\) is below the smallest size the clusters can reach \(17, with hidden: 1 of 32",
        "fit",
    ),
    (
        "size-multiple-of",
        {"target_params": 100, "clusters": [hidden(multiple_of=8)]},
        r"below the smallest size .*\(108, with hidden: 8 of 32 \(multiple_of=8\).*lower `multiple_of`",
        "fit",
    ),
    (
        "size-widths-unknown",
        {"target_params": 0.5, "target_widths": "mixed"},
        r"`target_widths` must be one of \('uniform', 'ranked'\), got 'mixed'",
        "init",
    ),
    (
        "size-ranked-alone",
        {"target_widths": "ranked"},
        r"`target_widths='ranked'` shapes a size target; set `target_params` too",
        "init",
    ),
    (
        "size-min-kept-range",
        {"target_params": 0.5, "target_widths": "ranked", "min_kept": 1.5},
        r"`min_kept` \(the fraction of each cluster's units kept at least\) must be in \(0, 1\], got 1.5",
        "init",
    ),
    (
        "size-min-kept-alone",
        {"target_params": 0.5, "min_kept": 0.5},
        r"`min_kept` is the floor of each cluster under target_widths='ranked'; set target_widths='ranked' too",
        "init",
    ),
    (
        "size-budget-uniform",
        {"target_params": 0.8, "clusters": [hidden(budget="b")]},
        r"Cluster 'hidden' shares budget 'b': uniform widths cannot follow a shared budget; set target_widths='ranked'",
        "fit",
    ),
    (
        "size-ranked-unequal",
        {
            "target_params": 0.8,
            "target_widths": "ranked",
            "clusters": [hidden(budget="b"), Cluster("out", writers=[R, "fc2.bias"], budget="b")],
        },
        r"target_widths='ranked': the clusters of 'b' \(\['hidden', 'out'\]\) differ in units or multiple_of "
        r"\[\(4, 1\), \(32, 1\)\]",
        "fit",
    ),
    (
        "size-ranked-layers",
        {
            "target_params": 0.8,
            "target_widths": "ranked",
            "clusters": [hidden(), Cluster("layer.0", writers=[R, "fc2.bias"], num_units=1, budget="layers")],
        },
        r"target_widths='ranked' with layer units: a dropped layer takes its units with it",
        "fit",
    ),
    (
        "flops-without-seq-len",
        {"target_flops": 0.5},
        r"`target_flops` \(FLOPs per token\) depends on the sequence length through attention: give `seq_len`",
        "init",
    ),
    (
        "flops-and-params",
        {"target_params": 0.5, "target_flops": 0.5, "seq_len": 8},
        r"Give `target_params` \(parameters\) or `target_flops` \(FLOPs per token\), not both",
        "init",
    ),
    (
        "flops-below-reach",
        {"target_flops": 10, "seq_len": 8},
        r"`target_flops` \(10\) is below the smallest size the clusters can reach",
        "fit",
    ),
    (
        "auto-discovery-options",
        {"clusters": "auto", "preset_options": {"mlp": True}},
        r"`preset_options` \{'mlp': True\} apply to presets, but no preset fits MLPModule and its clusters are "
        r"discovered by tracing; remove `preset_options`",
        "fit",
    ),
    (
        "pattern-typo",
        {"clusters": [Cluster("hidden", writers=["fc1.wieght"], readers=[R])]},
        r"Cluster 'hidden': writer pattern 'fc1.wieght' matches no parameter.*Close parameter names: \['fc1.weight'",
        "fit",
    ),
    (
        "head-dim-not-dividing",
        {"clusters": [hidden(head_dim=5)]},
        r"Cluster 'hidden': head_dim 5 does not divide the shortest channel-axis length",
        "fit",
    ),
    (
        "widths-differ",
        {"clusters": [Cluster("hidden", writers=[W, R])]},
        r"Cluster 'hidden': members have different channel-axis lengths .*set `head_dim`/`num_units`",
        "fit",
    ),
    (
        "param-in-two-clusters",
        {"clusters": [hidden(), Cluster("again", writers=[W])]},
        r"Cluster 'again': parameter 'fc1.weight' .* already belongs to cluster 'hidden'.*Remove one",
        "fit",
    ),
    (
        "name-group-missing",
        {"clusters": [hidden(name="mlp.{layer}")]},
        r"Cluster 'mlp.\{layer\}': the name refers to group 'layer' that the patterns do not define",
        "fit",
    ),
    (
        "reader-1d",
        {"clusters": [Cluster("hidden", writers=[W], readers=[B])]},
        r"member 'fc1.bias': a reader's channel axis is dim 1, but the tensor is 1-D.*list 1-D tensors .* `writers`",
        "fit",
    ),
    (
        "budget-targets",
        {
            "clusters": [
                Cluster("a", writers=[W], budget="b", target=0.5),
                Cluster("c", readers=[R], budget="b", target=0.25),
            ]
        },
        r"Budget 'b': clusters \['a', 'c'\] declare different targets",
        "fit",
    ),
    (
        "preset-options-without-preset",
        {"preset_options": {"residual": True}},
        r"`preset_options` \{'residual': True\} apply to preset names only",
        "fit",
    ),
    (
        "forced-sharded-on-plain",
        {"executor": "sharded"},
        r"Cluster 'hidden': executor='sharded' cannot serve this cluster: plain tensors .*Use executor='auto'",
        "fit",
    ),
    ("preset-wrong-family", {"clusters": "llama"}, r"presets.llama: no parameter of the model matches", "fit"),
    (
        "activation-no-reader",
        {"score": "activation", "clusters": [Cluster("hidden", writers=[W, B])]},
        r"Cluster 'hidden': score='activation' scores units by the input of their readers, but the cluster has only "
        r"writers \['fc1.weight', 'fc1.bias'\]\. Add the member that reads these channels",
        "fit",
    ),
    # ---- never silently wrong: a target below 1 that would empty a cluster (DESIGN invariant 11)
    (
        "target-empties-1-unit-cluster",
        {"clusters": [hidden(num_units=1)], "target_sparsity": 0.25},
        r"A target below 1 would remove every unit of 1 cluster\(s\): 'hidden' \(target 0.25: ceil\(0.25 \* 1\) = 1 "
        r"of its 1 unit\(s\) are dropped\).*Nothing was pruned.*`target=0.0`",
        "fit",
    ),
    (
        "multiple-of-empties",
        {"clusters": [hidden(multiple_of=64)], "target_sparsity": 0.1},
        r"every unit of 1 cluster\(s\): 'hidden' \(target 0.1: `multiple_of=64` is larger than its 32 unit\(s\)",
        "fit",
    ),
    (
        "cluster-target-empties",
        {"clusters": [hidden(num_units=4, target=0.8)]},
        r"'hidden' \(target 0.8: ceil\(0.8 \* 4\) = 4 of its 4 unit\(s\) are dropped\)",
        "fit",
    ),
    ("distill-alpha", {"distill_alpha": 1.5}, r"`distill_alpha` must be a number \[0.0, 1.0\], got 1.5", "init"),
    (
        "distill-temperature",
        {"distill_alpha": 0.5, "distill_temperature": 0.0},
        r"`distill_temperature` must be a number > 0 \(e.g. 1.0 or 2.0\), got 0.0",
        "init",
    ),
    (
        "distill-temperature-inf",
        {"distill_alpha": 0.5, "distill_temperature": float("inf")},
        r"`distill_temperature` must be a finite number > 0 \(e.g. 1.0 or 2.0\), got inf",
        "init",
    ),
    (
        "distill-teacher-without-alpha",
        {"distill_teacher": torch.nn.Linear(8, 4)},
        r"`distill_teacher` is set but `distill_alpha` is 0",
        "init",
    ),
    (
        "distill-teacher-shape",
        {"distill_alpha": 0.5, "distill_teacher": torch.nn.Linear(8, 3)},
        r"`distill_teacher` must return logits of the student's shape \(4, 4\) on the same inputs, got \(4, 3\)",
        "fit",
    ),
    (
        "distill-module-typo",
        {"distill_alpha": 0.5, "distill_module": "fc"},
        r"`distill_module='fc'` names no submodule of MLPModule .*or '' for the LightningModule itself",
        "fit",
    ),
    (
        "distill-teacher-store",
        {"distill_alpha": 0.5, "distill_teacher_store": "disk"},
        r"`distill_teacher_store` must be one of \('checkpoint', 'file'\), got 'disk'",
        "init",
    ),
    (
        "distill-teacher-store-without-alpha",
        {"distill_teacher_store": "file"},
        r"`distill_teacher_store='file'` is set but `distill_alpha` is 0",
        "init",
    ),
    (
        "distill-teacher-dir-type",
        {"distill_alpha": 0.5, "distill_teacher_store": "file", "distill_teacher_dir": 3},
        r"`distill_teacher_dir` must be a directory path \(str\) or None, got 3",
        "init",
    ),
    (
        "distill-teacher-dir-is-a-file",
        {"distill_alpha": 0.5, "distill_teacher_store": "file", "distill_teacher_dir": __file__},
        r"distill_teacher_store='file': the teacher directory .*test_bad_input.py is a file, not a directory",
        "fit",
    ),
    (
        "distill-teacher-dir-without-file",
        {"distill_alpha": 0.5, "distill_teacher_dir": "teachers"},
        r"`distill_teacher_dir='teachers'` is set but `distill_teacher_store` is 'checkpoint'",
        "init",
    ),
]


@pytest.mark.parametrize(("kwargs", "match", "when"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clearly_and_changes_nothing(kwargs, match, when):
    module = MLPModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kwargs = {"clusters": mlp_cluster(), **kwargs}
    trainer = None
    if when == "init":
        with pytest.raises(MisconfigurationException, match=match):
            CoupledPruningCallback(**kwargs)
    else:
        trainer = quiet_trainer(max_steps=2, callbacks=[CoupledPruningCallback(**kwargs)])
        with pytest.raises(MisconfigurationException, match=match), allow_short_fit():
            trainer.fit(module)
    assert (trainer is None) == (when == "init")
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    if trainer is not None:
        assert trainer.global_step == 0
        assert all(not opt.state for opt in trainer.optimizers)


def test_at_least_25_bad_inputs_and_the_docs_list_them():
    from pathlib import Path

    assert len(CASES) >= 25
    page = (Path(__file__).resolve().parents[2] / "docs" / "bad-input.md").read_text()
    missing = [c[0] for c in CASES if f"| `{c[0]}` |" not in page]
    assert not missing, f"docs/bad-input.md's table lacks {missing}"


def test_a_list_may_mix_preset_names_and_declarations():
    cb = CoupledPruningCallback(["linear_chain", {"name": "extra", "writers": ["w"]}], 0.5)
    assert cb.options.clusters[0] == "linear_chain"
    assert cb.options.clusters[1] == Cluster("extra", writers=["w"])


# ---------------------------------------------------------------------------------------------------- files
# Files are untrusted input: each case crafts a malicious or broken export / checkpoint in `tmp_path` and returns the
# call that reads it. Nothing may run (the pickle payloads would create `marker`), the error must name the problem.


class Payload:
    """Unpickling this object creates `marker` (any code could run instead)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _sequential_export(tmp_path):
    from torch import nn

    from lightning_pat import save_pretrained

    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return save_pretrained(net, tmp_path / "export")


def _edit_json(path, edit):
    import json

    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _load(directory):
    from lightning_pat import load_pretrained

    return lambda: load_pretrained(directory)


def _export_pickled_module(tmp_path, marker):
    out = _sequential_export(tmp_path)
    torch.save(Payload(marker), out / "model.pt")
    _edit_json(out / "lightning_pat.json", lambda d: d.update(format="torch.save", file="model.pt", version=1))
    return _load(out)


def _export_class(path):
    def build(tmp_path, marker):
        out = _sequential_export(tmp_path)
        _edit_json(out / "lightning_pat.json", lambda d: d["modules"][0].update({"class": path}))
        return _load(out)

    return build


def _export_dataclass(tmp_path, marker):
    out = _sequential_export(tmp_path)
    value = {"dataclass": "os.system", "fields": {"command": f"touch {marker}"}}
    _edit_json(out / "lightning_pat.json", lambda d: d["modules"][1]["attributes"].update(config=value))
    return _load(out)


def _export_file(name_of):
    def build(tmp_path, marker):
        out = _sequential_export(tmp_path)
        outside = tmp_path / "outside"
        outside.mkdir()
        (out / "model.safetensors").rename(outside / "model.safetensors")  # a valid file, outside the export
        name = name_of(out, outside / "model.safetensors")
        _edit_json(out / "lightning_pat.json", lambda d: d.update(file=name))
        return _load(out)

    return build


def _symlink(out, target):
    (out / "weights.safetensors").symlink_to(target)
    return "weights.safetensors"


def _index_outside(tmp_path, marker):
    import warnings

    from lightning_pat import prune_clusters, save_pretrained, shrink
    from lightning_pat.presets import PRESETS
    from tests.common.tiny_families import gpt2

    pytest.importorskip("transformers")
    case = gpt2(n_head=4)
    model = case.fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shrink(model, prune_clusters(model, PRESETS[case.preset](model, mlp=False, heads=True, residual=False), 0.5))
    out = save_pretrained(model, tmp_path / "export")
    (tmp_path / "outside").mkdir()
    (out / "model.safetensors").rename(tmp_path / "outside" / "model.safetensors")
    weight_map = {n: "../outside/model.safetensors" for n, _ in model.named_parameters()}
    (out / "model.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": weight_map}))
    return _load(out)


def _callback_state():
    return {"CoupledPruningCallback{'clusters': 'x'}": {"clusters": [], "dropped": {}, "options": {}}}


def _shrink(ckpt, tmp_path, **kwargs):
    from lightning_pat.cli import shrink_checkpoint

    return lambda: shrink_checkpoint(ckpt, tmp_path / "small", **kwargs)


def _checkpoint_payload(tmp_path, marker):
    ckpt = tmp_path / "run" / "last.ckpt"
    ckpt.parent.mkdir()
    torch.save({"state_dict": {}, "callbacks": _callback_state(), "hyper_parameters": {"x": Payload(marker)}}, ckpt)
    return _shrink(ckpt, tmp_path, model_class="tests.common.lit_models.MLPModule")


def _dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "run" / "epoch=0-step=2.ckpt"
    dcp.save({"state_dict": {"fc1.weight": torch.ones(2, 2)}}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"callbacks": _callback_state(), "hyper_parameters": {}}, ckpt / "meta.pt")
    return ckpt


def _meta_payload(tmp_path, marker):
    ckpt = _dcp_checkpoint(tmp_path)
    torch.save({"callbacks": _callback_state(), "hyper_parameters": {"x": Payload(marker)}}, ckpt / "meta.pt")
    return _shrink(ckpt, tmp_path, model_class="tests.common.lit_models.MLPModule")


def _dcp_metadata_payload(tmp_path, marker):
    import pickle

    ckpt = _dcp_checkpoint(tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return _shrink(ckpt, tmp_path, model_class="tests.common.lit_models.MLPModule")


def _dcp_shard_outside(tmp_path, marker):
    import pickle

    ckpt = _dcp_checkpoint(tmp_path)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # noqa: S301 - written by this test
    for info in metadata.storage_data.values():
        (tmp_path / info.relative_path).write_bytes((ckpt / info.relative_path).read_bytes())
        info.relative_path = f"../../{info.relative_path}"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return _shrink(ckpt, tmp_path, model_class="tests.common.lit_models.MLPModule")


def _class_path_function(tmp_path, marker):
    ckpt = tmp_path / "run" / "last.ckpt"
    ckpt.parent.mkdir()
    hparams = {"_class_path": "os.system", "command": f"touch {marker}"}
    torch.save({"state_dict": {}, "callbacks": _callback_state(), "hyper_parameters": hparams}, ckpt)
    return _shrink(ckpt, tmp_path)


def _config_class_path_function(tmp_path, marker):
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": {}, "callbacks": _callback_state(), "hyper_parameters": {}}, ckpt)
    config = f"model:\n  class_path: os.system\n  init_args:\n    command: touch {marker}\n"
    (tmp_path / "run" / "config.yaml").write_text(config)
    return _shrink(ckpt, tmp_path)


def _truncated_checkpoint(tmp_path, marker):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "callbacks": _callback_state()}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:1500])
    return _shrink(ckpt, tmp_path)


def _not_a_checkpoint(tmp_path, marker):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_text("model:\n  class_path: not a checkpoint\n")
    return _shrink(ckpt, tmp_path)


def _save_into_non_empty(tmp_path, marker):
    from torch import nn

    from lightning_pat import save_pretrained

    out = _sequential_export(tmp_path)
    return lambda: save_pretrained(nn.Linear(2, 2), out)


def _overwrite_foreign_files(tmp_path, marker):
    from torch import nn

    from lightning_pat import save_pretrained

    out = _sequential_export(tmp_path)
    (out / "notes.txt").write_text("mine")
    return lambda: save_pretrained(nn.Linear(2, 2), out, overwrite=True)


def _teacher_file(edit):
    """A checkpoint written with ``distill_teacher_store="file"`` after pruning started, its file edited by ``edit``."""

    def build(tmp_path, marker):
        from tests.common.lit_models import StepDataModule

        def callback() -> CoupledPruningCallback:
            return CoupledPruningCallback(
                mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=2, distill_alpha=0.5, distill_teacher_store="file"
            )

        run = tmp_path / "run"
        trainer = quiet_trainer(max_steps=2, callbacks=[callback()], default_root_dir=run)
        with ends_mid_ramp():
            trainer.fit(StepDataModule(lr=0.1))
        trainer.save_checkpoint(run / "last.ckpt")
        (file,) = run.glob("pat-teacher-*.safetensors")
        edit(run / "last.ckpt", file)
        resumed = quiet_trainer(max_steps=4, callbacks=[callback()], default_root_dir=run)
        return lambda: resumed.fit(StepDataModule(lr=0.1), ckpt_path=str(run / "last.ckpt"))

    return build


def _flip_last_byte(ckpt, file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def _teacher_name_outside(ckpt, file):
    state = torch.load(ckpt, weights_only=True)
    (key,) = (k for k in state["callbacks"] if k.startswith("CoupledPruningCallback"))
    state["callbacks"][key]["distill"]["teacher"]["files"][0]["name"] = "../" + file.name
    torch.save(state, ckpt)


# (id, builder(tmp_path, marker) -> the call that reads the input, expected exception, message regex)
FILE_CASES = [
    (
        "teacher-file-missing",
        _teacher_file(lambda ckpt, file: file.unlink()),
        MisconfigurationException,
        r"distill_teacher_store='file'.*teacher file 'pat-teacher-.*' is in none of .*Copy that file next to",
    ),
    (
        "teacher-file-truncated",
        _teacher_file(lambda ckpt, file: file.write_bytes(file.read_bytes()[:100])),
        MisconfigurationException,
        r"distill_teacher_store='file'.*cannot read the teacher file .*not a safetensors file or truncated",
    ),
    (
        "teacher-file-modified",
        _teacher_file(_flip_last_byte),
        MisconfigurationException,
        r"distill_teacher_store='file'.*does not hold the teacher this checkpoint was written with",
    ),
    (
        "teacher-file-name-outside",
        _teacher_file(_teacher_name_outside),
        MisconfigurationException,
        r"distill_teacher_store='file'.*names the teacher file '\.\./pat-teacher-.*', which is not a teacher file",
    ),
    (
        "export-pickled-module",
        _export_pickled_module,
        ValueError,
        r"is a pickled module .*never unpickles a file.*convert it once in your own code",
    ),
    (
        "export-class-outside-allow-list",
        _export_class("os.system"),
        ValueError,
        r"names the class 'os.system', which is not in a model module lightning_pat imports .*classes=\[system\]",
    ),
    (
        "export-class-not-a-module",
        _export_class("torch.nn.modules.activation.ReLU.forward"),
        ValueError,
        r"'torch.nn.modules.activation.ReLU.forward' is not an torch.nn.modules.module.Module subclass",
    ),
    ("export-dataclass-outside-allow-list", _export_dataclass, ValueError, r"names the class 'os.system'"),
    (
        "export-file-traversal",
        _export_file(lambda out, target: "../outside/model.safetensors"),
        ValueError,
        r"'file': '../outside/model.safetensors' is not a plain relative name",
    ),
    (
        "export-file-absolute",
        _export_file(lambda out, target: str(target)),
        ValueError,
        r"'file': '/.*' is not a plain relative name",
    ),
    ("export-file-symlink-outside", _export_file(_symlink), ValueError, r"leads outside .* \(a symlink to"),
    ("export-index-traversal", _index_outside, ValueError, r"index.json: '../outside/model.safetensors' is not a"),
    (
        "checkpoint-pickle-payload",
        _checkpoint_payload,
        ValueError,
        r"cannot read checkpoint .*last.ckpt: it asks to load the Python object `.*open`",
    ),
    ("checkpoint-meta-pt-payload", _meta_payload, ValueError, r"meta.pt: it asks to load the Python object `.*open`"),
    (
        "checkpoint-dcp-metadata-payload",
        _dcp_metadata_payload,
        ValueError,
        r"\.metadata: it asks to load the Python object `io.open`, which is not on the allow-list",
    ),
    ("checkpoint-dcp-shard-outside", _dcp_shard_outside, ValueError, r"'\.\./\.\./__0_0.distcp' is not a plain"),
    (
        "checkpoint-class-path-function",
        _class_path_function,
        ValueError,
        r"'os.system' is not a LightningModule \(or nn.Module\) class but a builtin_function_or_method; refused",
    ),
    (
        "config-class-path-function",
        _config_class_path_function,
        ValueError,
        r"config.yaml: model.class_path: 'os.system' is not a LightningModule",
    ),
    (
        "checkpoint-truncated",
        _truncated_checkpoint,
        ValueError,
        r"cannot read checkpoint .*last.ckpt: not a torch checkpoint or truncated",
    ),
    (
        "checkpoint-not-torch",
        _not_a_checkpoint,
        ValueError,
        r"cannot read checkpoint .*last.ckpt: not a torch checkpoint or truncated",
    ),
    ("save-into-non-empty", _save_into_non_empty, FileExistsError, r"is not empty .*pass overwrite=True"),
    (
        "save-overwrite-foreign-files",
        _overwrite_foreign_files,
        FileExistsError,
        r"not part of an export \(\['notes.txt'\]\)",
    ),
]


@pytest.mark.parametrize(("build", "error", "match"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_untrusted_file_is_refused_and_runs_nothing(tmp_path, monkeypatch, build, error, match):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    call = build(tmp_path, marker)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(error, match=match) as caught:
        call()
    assert not marker.exists(), "code from the file ran"
    # torch's own weights-only error advises `weights_only=False`; ours never passes that advice on
    assert "weights_only" not in str(caught.value)
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == before  # nothing written (no partial export, no consolidated checkpoint)


def test_docs_list_the_file_cases():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "bad-input.md").read_text()
    missing = [c[0] for c in FILE_CASES if f"`{c[0]}`" not in page]
    assert not missing, f"docs/bad-input.md's tables lack {missing}"
