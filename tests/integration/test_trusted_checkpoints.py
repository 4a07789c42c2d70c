"""Issue 23 (audit A3, A4, B2, B3, B4): what a checkpoint says is checked before it is trusted.

A short run (the mask final at step 4 of 6) writes one checkpoint; each case edits its pruning state the way the
audit did, then

* ``lightning-pat shrink`` (``shrink_checkpoint``) must refuse it before writing anything: dropped units that are
  not zero in the weights (kept units listed as dropped, a non-zero writer row), a cluster emptied, a renamed member,
  an edited fingerprint, duplicated or out-of-range indices;
* a resume (``fit(ckpt_path=...)``) must refuse an edited ``step`` or an out-of-range index before the first step;
* the console script turns each refusal (and a bad ``--config`` or ``--submodule``) into one line and exit status 1.

The reference for the unedited checkpoint: the export computes what the checkpoint's (masked) model computes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_pat import CoupledPruningCallback, shrink
from lightning_pat.cli import shrink_checkpoint
from lightning_pat.core.spec import ResolvedCluster
from tests.common.lit_models import MLPModule, StepDataModule, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "lightning-pat"
MODEL = "tests.common.lit_models.MLPModule"


def callback() -> CoupledPruningCallback:
    return CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=0, ramp_steps=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    trainer = quiet_trainer(max_steps=6, callbacks=[callback()], default_root_dir=run)
    trainer.fit(StepDataModule(lr=0.1))
    path = run / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


def edited(ckpt: Path, tmp_path: Path, edit) -> Path:
    data = torch.load(ckpt, weights_only=True)
    (key,) = (k for k in data["callbacks"] if k.startswith("CoupledPruningCallback"))
    edit(data["callbacks"][key], data["state_dict"])
    out = tmp_path / "edited.ckpt"
    torch.save(data, out)
    return out


def _kept_as_dropped(state, weights):
    kept = [u for u in range(32) if u not in state["dropped"]["hidden"]]
    state["dropped"]["hidden"] = kept[:16]


def _every_unit(state, weights):
    state["dropped"]["hidden"] = list(range(32))


def _writer_row(state, weights):
    weights["fc1.weight"][state["dropped"]["hidden"][0], 0] = 0.5  # the reader's column stays zero


def _rename(state, weights, *, refingerprint=False):
    state["clusters"][0]["members"][0]["name"] = "fc9.weight"  # the writer fc1.weight, renamed
    if refingerprint:  # an edit that also recomputes the fingerprint: the model itself refuses it
        state["fingerprints"]["hidden"] = ResolvedCluster.from_dict(state["clusters"][0]).fingerprint()


def _set(key, value):
    def edit(state, weights):
        state["dropped" if key != "fingerprints" else key]["hidden"] = value(state) if callable(value) else value

    return edit


# (id, edit(state, weights), message regex)
SHRINK_EDITS = [
    ("kept-units-as-dropped", _kept_as_dropped, r"the dropped units are not zero in the weights \(cluster 'hidden'"),
    ("writer-row-not-zero", _writer_row, r"the dropped units are not zero in the weights \(cluster 'hidden' in \['fc1"),
    ("every-unit-dropped", _every_unit, r"`dropped\['hidden'\]` drops every one of the cluster's 32 units"),
    ("member-renamed", _rename, r"`fingerprints\['hidden'\]` is .* but the saved definition of cluster 'hidden'"),
    (
        "member-renamed-refingerprinted",
        lambda s, w: _rename(s, w, refingerprint=True),
        r"names 'fc9.weight' \(a member of cluster 'hidden'\), which is not a parameter of MLPModule",
    ),
    (
        "fingerprint-edited",
        _set("fingerprints", "0123456789abcdef"),
        r"`fingerprints\['hidden'\]` is '0123456789abcdef'",
    ),
    ("index-duplicated", _set("dropped", lambda s: [*s["dropped"]["hidden"], s["dropped"]["hidden"][0]]), r"more than"),
    (
        "index-out-of-range",
        _set("dropped", lambda s: [*s["dropped"]["hidden"][:-1], 999]),
        r"\[999\] outside \[0, 32\)",
    ),
    ("index-float", _set("dropped", lambda s: [2.5]), r"must hold int unit indices, got float 2.5"),
]


@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in SHRINK_EDITS], ids=[c[0] for c in SHRINK_EDITS])
def test_shrink_refuses_an_edited_checkpoint_before_writing(ckpt, tmp_path, edit, match):
    path = edited(ckpt, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        shrink_checkpoint(path, tmp_path / "small", model_class=MODEL)
    assert not (tmp_path / "small").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["edited.ckpt"]  # no partial export either


def test_shrink_of_the_unedited_checkpoint_equals_its_model(ckpt):
    """The checks pass the real thing: ``shrink(model, checkpoint)`` (what ``lightning-pat shrink`` calls)."""
    data = torch.load(ckpt, weights_only=True)
    masked, model = MLPModule(), MLPModule()
    masked.load_state_dict(data["state_dict"])
    model.load_state_dict(data["state_dict"])
    small = shrink(model, data)
    x = torch.randn(5, 8)
    assert small.fc1.out_features == 16
    torch.testing.assert_close(small(x), masked(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- resume
RESUME_EDITS = [
    ("step-negative", lambda s, w: s.update(step=-5), r"`step` must be in \[0, 6\], got -5"),
    ("step-huge", lambda s, w: s.update(step=10**6), r"`step` must be in \[0, 6\], got 1000000"),
    ("step-float", lambda s, w: s.update(step=15.5), r"`step` must be an int, got float 15.5"),
    ("step-string", lambda s, w: s.update(step="15"), r"`step` must be an int, got str '15'"),
    ("index-999", _set("dropped", lambda s: [*s["dropped"]["hidden"][:-1], 999]), r"\[999\] outside \[0, 32\)"),
    ("dropped-none", lambda s, w: s.update(dropped=None), r"`dropped` must be a mapping"),
]


@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in RESUME_EDITS], ids=[c[0] for c in RESUME_EDITS])
def test_resume_refuses_an_edited_state_before_the_first_step(ckpt, tmp_path, edit, match):
    path = edited(ckpt, tmp_path, edit)
    module = StepDataModule(lr=0.1)
    trainer = quiet_trainer(max_steps=8, callbacks=[callback()], default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=match) as caught:
        trainer.fit(module, ckpt_path=str(path))
    assert "IndexError" not in repr(caught.value)
    assert trainer.global_step == 6  # restored, and not one step further
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())  # the mask was not applied


# ---------------------------------------------------------------------------------------------------- console script
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_console_script_refusals_are_one_line_with_exit_status_1(ckpt, tmp_path, capsys):
    """Audit A3, B3, B4: no traceback, our message is the last line, exit status 1.

    The first case runs through the installed ``lightning-pat`` (what ``sys.exit(main())`` makes of the status);
    the others through ``lightning_pat.cli:main``, the function the console script calls, in this process (a
    console-script start costs ~8 s of imports).
    """
    from lightning_pat.cli import main

    not_a_mapping = tmp_path / "passwd.yaml"
    not_a_mapping.write_text("root:x:0:0:root:/root:/bin/bash\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  class_path: [unclosed\n")
    cases = [
        (["--config", str(not_a_mapping)], r"is a YAML mapping .* but the file holds a str"),
        (["--config", str(broken)], r"not valid YAML at line \d+"),
        (["--model_class", MODEL, "--submodule", "nope"], r"--submodule 'nope': MLPModule has no such submodule"),
        (["--model_class", MODEL], r"the dropped units are not zero in the weights"),
    ]
    bad = edited(ckpt, tmp_path, _kept_as_dropped)
    for i, (extra, match) in enumerate(cases):
        source = bad if "not zero" in match else ckpt
        args = ["shrink", "--ckpt_path", str(source), "--output", str(tmp_path / "out"), *extra]
        if i == 0:
            proc = _cli(*args, cwd=tmp_path)
            status, stderr = proc.returncode, proc.stderr
        else:
            status, stderr = main(args), capsys.readouterr().err
        lines = stderr.strip().splitlines()
        assert status == 1, (extra, stderr[-2000:])
        assert "Traceback" not in stderr, stderr[-2000:]
        assert lines[-1].startswith("lightning-pat shrink: error: "), lines[-3:]
        assert re.search(match, lines[-1]), (match, lines[-1])
        assert not (tmp_path / "out").exists()


def test_two_saved_clusters_on_the_same_channels_are_refused():
    """An edit that moves a member onto channels another cluster owns (what resolution never produces)."""
    from torch import nn

    from lightning_pat import Cluster
    from lightning_pat.core.spec import resolve_clusters
    from lightning_pat.shrink.plan import check_source_fits

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    a, b = resolve_clusters(
        net, [Cluster("a", writers=["0.weight"], readers=["2.weight"]), Cluster("b", writers=["2.weight"])]
    )
    check_source_fits(net, [a, b], {}, what="the state")
    moved = ResolvedCluster.from_dict({**b.to_dict(), "members": [{**b.to_dict()["members"][0], "dim": 1}]})
    with pytest.raises(ValueError, match=r"clusters 'a' and 'b' both claim channels \[0, 8\) of dim 1 of '2.weight'"):
        check_source_fits(net, [a, moved], {}, what="the state")


def test_docs_list_the_shrink_cases():
    page = (ROOT / "docs" / "bad-input.md").read_text()
    missing = [c[0] for c in SHRINK_EDITS if f"| `{c[0]}` |" not in page]
    assert not missing, f"docs/bad-input.md lacks {missing}"
