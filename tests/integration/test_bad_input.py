"""Every misuse is a clear error that names the argument or cluster and the fix, and nothing is lost.

Each case asserts the message, and that the module's weights are unchanged and no optimizer has any state (no
step was taken). Construction-time cases never reach a Trainer; fit-time cases fail in ``setup`` / ``on_fit_start``
before the first step. README.md's "Bad input" table lists these cases.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import Cluster, CoupledPruningCallback
from tests.common.lit_models import MLPModule, mlp_cluster, quiet_trainer

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
    ("cadence-zero", {"every_n_steps": 0}, r"`every_n_steps` must be an int >= 1, got 0", "init"),
    ("ramp-shape", {"ramp": "exp"}, r"`ramp` \(the ramp shape\) must be 'cubic' or 'linear', got 'exp'", "init"),
    ("method", {"method": "l0"}, r"`method` must be one of \('hard', 'group_lasso'\), got 'l0'", "init"),
    ("score", {"score": "max"}, r"`score` must be one of .*'rms'.* got 'max'", "init"),
    ("mode", {"mode": "shadow"}, r"`mode` must be one of \('latent', 'direct'\), got 'shadow'", "init"),
    ("executor", {"executor": "gpu"}, r"`executor` must be one of .* got 'gpu'", "init"),
    ("lasso-no-lambda", {"method": "group_lasso"}, r"needs `reg_lambda` > 0 .*set a strength", "init"),
    ("lambda-negative", {"reg_lambda": -1.0}, r"`reg_lambda` must be a number >= 0.0, got -1.0", "init"),
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
        r"`preset_options` must map some of \('mlp', 'heads', 'residual'\) to bools, got \{'residul': True\}",
        "init",
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
        with pytest.raises(MisconfigurationException, match=match):
            trainer.fit(module)
    assert (trainer is None) == (when == "init")
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    if trainer is not None:
        assert trainer.global_step == 0
        assert all(not opt.state for opt in trainer.optimizers)


def test_at_least_25_bad_inputs_and_readme_lists_them():
    from pathlib import Path

    assert len(CASES) >= 25
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [c[0] for c in CASES if f"`{c[0]}`" not in readme]
    assert not missing, f"README.md's Bad input table lacks {missing}"


def test_a_list_may_mix_preset_names_and_declarations():
    cb = CoupledPruningCallback(["linear_chain", {"name": "extra", "writers": ["w"]}], 0.5)
    assert cb.clusters[0] == "linear_chain"
    assert cb.clusters[1] == Cluster("extra", writers=["w"])
