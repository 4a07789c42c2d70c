"""Issue 23 (audit A5): ``save_pretrained(..., overwrite=True)`` never leaves the path without an export.

Where Linux's ``renameat2(RENAME_EXCHANGE)`` works, the new export and the old one swap in one syscall: a process
killed right after it leaves the new export in place (the old one in a hidden ``.partial-*`` folder). Elsewhere the
swap takes two renames; a kill between them leaves no export at the path, and ``load_pretrained`` then names the
leftover folders and how to put the previous export back. Both paths are tested with a real kill (``os._exit``) in a
child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from lightning_pat import load_pretrained, save_pretrained
from lightning_pat.core import safe_io

ROOT = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent(
    """
    import os, shutil, sys
    from torch import nn
    from lightning_pat import save_pretrained
    from lightning_pat.core import safe_io

    out, path = sys.argv[1], sys.argv[2]
    save_pretrained(nn.Linear(2, 3), out)  # the previous export
    if path == "exchange":
        shutil.rmtree = lambda *a, **k: os._exit(9)  # killed right after the swap, before the old copy is removed
    else:
        safe_io.exchange = lambda a, b: False  # no RENAME_EXCHANGE: two renames
        real = os.rename
        def dying(src, dst):
            real(src, dst)
            os._exit(9)  # killed between the two renames
        os.rename = dying
    save_pretrained(nn.Linear(2, 4), out, overwrite=True)
    """
)


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("a")
    (b / "f").write_text("b")
    assert safe_io.exchange(a, b), "renameat2(RENAME_EXCHANGE) should work on Linux (ext4, tmpfs)"
    assert ((a / "f").read_text(), (b / "f").read_text()) == ("b", "a")
    with pytest.raises(FileNotFoundError):
        safe_io.exchange(a, tmp_path / "missing")  # a real error is an error, not a fallback


def test_overwrite_replaces_the_export_and_leaves_nothing_behind(tmp_path, monkeypatch):
    for exchange in (True, False):
        out = tmp_path / f"export_{exchange}"
        save_pretrained(nn.Linear(2, 3), out)
        if not exchange:
            monkeypatch.setattr(safe_io, "exchange", lambda a, b: False)
        save_pretrained(nn.Linear(2, 4), out, overwrite=True)
        assert load_pretrained(out).out_features == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export_False", "export_True"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["exchange", "two-renames"])
def test_a_kill_during_the_overwrite(tmp_path, path):
    out = tmp_path / "exp_kill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out), path], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "exp_kill")
    if path == "exchange":  # the new export is in place; the old one waits in the hidden folder
        assert load_pretrained(out).out_features == 4
        assert len(leftovers) == 1
        assert leftovers[0].startswith(".exp_kill.partial-")
        return
    assert not out.exists()
    leftover = r"interrupted.*\.exp_kill\.old-\w+/export.*\.exp_kill\.partial-"
    with pytest.raises(FileNotFoundError, match=leftover) as err:
        load_pretrained(out)
    old = next(p for p in tmp_path.iterdir() if p.name.startswith(".exp_kill.old-")) / "export"
    assert f"mv {old} {out}" in str(err.value)
    os.rename(old, out)  # what the message says to do: the previous export is back, complete
    assert load_pretrained(out).out_features == 3


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys
    import safetensors.torch
    from torch import nn
    from lightning_pat import save_pretrained

    real = safetensors.torch.save_file
    def dying(*args, **kwargs):
        real(*args, **kwargs)
        os._exit(9)  # killed while the export is built in its hidden folder
    safetensors.torch.save_file = dying
    save_pretrained(nn.Linear(2, 5), sys.argv[1], overwrite=True)
    """
)


def test_a_later_save_removes_the_folders_of_killed_saves_and_names_what_it_keeps(tmp_path, caplog):
    """Issue 39 (audit C6): leftovers of killed saves are removed when provably ours and stale, else named."""
    out = tmp_path / "exp"
    save_pretrained(nn.Linear(2, 3), out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(2):  # the second killed save removes the first one's folder
        proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(out)], env=env, capture_output=True, timeout=120)
        assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    killed = sorted(p for p in tmp_path.iterdir() if p.name.startswith(".exp.partial-"))
    assert len(killed) == 1  # (a full copy of the weights) each killed save removed the one before it
    assert load_pretrained(out).out_features == 3  # the previous export is intact
    alive = tmp_path / f"{safe_io.partial_prefix(out)}live"  # a save still running in this process: not stale
    legacy = tmp_path / ".exp.partial-k2j4x9"  # an older name, no host or process: cannot be proved stale
    other = tmp_path / ".other.partial-00000000-1-x"  # another export's folder: not looked at
    huge = tmp_path / f".exp.partial-{safe_io._host_key()}-{10**30}-x"  # no process has that id: kept, no crash
    for folder in (alive, legacy, other, huge):
        folder.mkdir()
    with caplog.at_level("WARNING", logger="lightning_pat.core.safe_io"):
        save_pretrained(nn.Linear(2, 4), out, overwrite=True)
    assert load_pretrained(out).out_features == 4
    assert not any(p.exists() for p in killed)
    assert alive.exists()
    assert legacy.exists()
    assert other.exists()
    assert huge.exists()
    text = caplog.text
    assert "removed 1 folder(s) left by an earlier save" in text
    assert all(str(p) in text for p in killed)
    assert "cannot prove stale" in text
    assert str(alive) in text
    assert str(legacy) in text
    assert str(other) not in text


def test_leftovers_of_an_interrupted_overwrite_are_kept_for_the_user(tmp_path, caplog):
    """A kill between the two renames leaves no export and the folders the error names: nothing is removed."""
    out = tmp_path / "exp"
    old = tmp_path / ".exp.old-abc"
    (old / "export").mkdir(parents=True)
    new = tmp_path / f".exp.partial-{safe_io._host_key()}-999999999-new"  # a dead process, yet needed to restore
    new.mkdir()
    with caplog.at_level("WARNING", logger="lightning_pat.core.safe_io"):
        assert safe_io.clean_stale_partials(out, what="save_pretrained") == []
    assert new.exists()
    assert old.exists()
    assert "cannot prove stale" in caplog.text
