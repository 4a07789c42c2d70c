"""The teacher file of ``distill_teacher_store="file"``: reference, write, read and every refusal (one process).

The sharded cases (world size, layout) are checked on references as a 2-rank run writes them; the 2-rank run itself
is ``test_file_store_writes_each_ranks_shards_once_and_resumes_bitwise`` in
``tests/integration/test_distill_model_parallel.py``.
"""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
import torch

from lightning_pat.training import teacher_file

OPTION = "distill_teacher_store='file'"


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, generator=g)
    return {"a.weight": weight, "tied.weight": weight, "b.bias": torch.randn(4, generator=g).to(torch.bfloat16)}


def test_the_digest_is_sha256_of_names_dtypes_shapes_and_bytes():
    t = tensors()
    sha = hashlib.sha256()  # written out independently of the module
    for name in sorted(t):
        sha.update(f"{name}|{t[name].dtype}|{tuple(t[name].shape)}\n".encode())
        sha.update(t[name].contiguous().view(torch.uint8).numpy().tobytes())
    assert teacher_file.digest(t) == sha.hexdigest()
    flipped = {**t, "b.bias": t["b.bias"].clone()}
    flipped["b.bias"][0] = -flipped["b.bias"][0]
    assert teacher_file.digest(flipped) != teacher_file.digest(t)
    assert teacher_file.digest({**t, "b.bias": t["b.bias"].float()}) != teacher_file.digest(t)  # the dtype counts


def test_write_once_then_read_back_bitwise_and_the_name_follows_the_content(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    (item,) = entry["files"]
    assert teacher_file.NAME.fullmatch(item["name"])
    assert not entry["sharded"]
    path = teacher_file.write(entry, t, tmp_path)
    assert path == tmp_path / item["name"]
    mtime = path.stat().st_mtime_ns
    assert teacher_file.write(entry, t, tmp_path) == path  # an intact file is kept
    assert path.stat().st_mtime_ns == mtime
    got = teacher_file.read_teacher_file(entry, directories=[tmp_path / "nowhere", tmp_path], like=t)
    assert set(got) == set(t)
    assert all(torch.equal(got[n], t[n]) and got[n].dtype == t[n].dtype for n in t)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    other = teacher_file.reference({**t, "b.bias": t["b.bias"] + 1})
    assert other["files"][0]["name"] != item["name"]  # a new teacher never overwrites an old one's file


def test_a_damaged_file_is_rewritten_on_the_next_save(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    path = teacher_file.write(entry, t, tmp_path)
    path.write_bytes(b"garbage")
    teacher_file.write(entry, t, tmp_path)
    assert (
        teacher_file.digest(teacher_file.read_teacher_file(entry, directories=[tmp_path], like=t))
        == entry["files"][0]["digest"]
    )


def test_shapes_other_than_the_models_are_refused(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    teacher_file.write(entry, t, tmp_path)
    like = {**t, "a.weight": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=rf"{OPTION}: .* holds tensors of other shapes \['a.weight'\]"):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like=like)
    with pytest.raises(ValueError, match=r"holds other tensors than the model \(missing \['c'\], unexpected \[\]\)"):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like={**t, "c": torch.zeros(1)})


def sharded_entry(world: int = 2) -> dict:
    """A reference as ``world`` ranks write it for a sharded teacher."""
    files = [
        {"name": f"pat-teacher-0123456789abcdef-rank{r}of{world}.safetensors", "digest": "0" * 64, "layout": "1" * 64}
        for r in range(world)
    ]
    return {"format": "file", "sharded": True, "world": world, "mesh": "mesh {'data_parallel': 2}", "files": files}


def test_a_sharded_teacher_on_another_world_size_is_refused_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"shards of 2 ranks \(mesh \{'data_parallel': 2\}\), and this run has 1; .*"):
        teacher_file.read_teacher_file(sharded_entry(2), directories=[tmp_path], like=tensors())


def test_a_shard_of_another_layout_is_refused(tmp_path):
    t = tensors()
    entry = {**teacher_file.reference(t), "sharded": True, "world": 1, "mesh": "mesh {'data_parallel': 2}"}
    entry["files"][0]["name"] = "pat-teacher-0123456789abcdef-rank0of1.safetensors"
    teacher_file.write(entry, t, tmp_path)
    entry["files"][0]["layout"] = "f" * 64  # what another mesh would have recorded
    with pytest.raises(ValueError, match=r"another layout \(mesh \{'data_parallel': 2\}\) than this run's model"):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like=t)


@pytest.mark.parametrize(
    "name",
    [
        "../pat-teacher-0123456789abcdef.safetensors",
        "/tmp/pat-teacher-0123456789abcdef.safetensors",
        "sub/pat-teacher-0123456789abcdef.safetensors",
        "pat-teacher-0123456789abcdef.safetensors/..",
        "model.safetensors",
        42,
    ],
)
def test_names_that_are_not_plain_teacher_file_names_are_refused(tmp_path, name):
    entry = teacher_file.reference(tensors())
    entry["files"][0]["name"] = name
    with pytest.raises(ValueError, match=rf"{OPTION}: the checkpoint names the teacher file .* is not a teacher file"):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like=tensors())


def test_a_symlink_leading_outside_the_directory_is_refused(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    outside = tmp_path / "outside"
    teacher_file.write(entry, t, outside)
    inside = tmp_path / "ckpts"
    inside.mkdir()
    (inside / entry["files"][0]["name"]).symlink_to(outside / entry["files"][0]["name"])
    with pytest.raises(ValueError, match=r"leads outside .* \(a symlink to"):
        teacher_file.read_teacher_file(entry, directories=[inside], like=t)


def test_a_malformed_reference_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"the checkpoint's teacher reference is malformed"):
        teacher_file.read_teacher_file({"format": "file", "files": []}, directories=[tmp_path], like=tensors())


# ------------------------------------------------------------------------------------ issue 23 (B1, C8, C9, C13)
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"world": "two"}, r"`world` of the checkpoint's teacher reference must be an int >= 1, got 'two'"),
        ({"sharded": "yes"}, r"`sharded` of the checkpoint's teacher reference must be a bool, got 'yes'"),
    ],
)
def test_a_reference_with_fields_of_the_wrong_type_is_refused(tmp_path, edit, match):
    entry = {**teacher_file.reference(tensors()), **edit}
    with pytest.raises(ValueError, match=match):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like=tensors())


def test_a_directory_in_the_teacher_files_place_is_named_as_such(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    (tmp_path / entry["files"][0]["name"]).mkdir()
    with pytest.raises(ValueError, match=r"is a directory, not a file"):
        teacher_file.read_teacher_file(entry, directories=[tmp_path], like=t)
    with pytest.raises(ValueError, match=r"is a directory, not a file"):
        teacher_file.write(entry, t, tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_teacher_file_gets_the_mode_a_checkpoint_gets(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = teacher_file.write(teacher_file.reference(tensors()), tensors(), tmp_path)
        plain = tmp_path / "like_a_checkpoint"
        plain.write_bytes(b"")  # what torch.save / open() give a new file under this umask
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~umask


def test_teacher_directories_are_checked_before_training(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=rf"{OPTION}: the teacher directory .*afile is a file, not a directory"):
        teacher_file.check_directories([a_file])
    with pytest.raises(ValueError, match=r"is a file, not a directory"):
        teacher_file.check_directories([a_file / "below"])  # cannot be created either
    teacher_file.check_directories([tmp_path / "new" / "dir"])  # created when the file is written
    assert not (tmp_path / "new").exists()  # nothing is created by the check
    blocked = tmp_path / "blocked"
    (blocked / "pat-teacher-0123456789abcdef.safetensors").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"pat-teacher-0123456789abcdef.safetensors' is a directory, not a file"):
        teacher_file.check_directories([blocked])
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "pat-teacher-0123456789abcdef.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=r"leads outside .* \(a symlink to"):
        teacher_file.check_directories([linked])


def test_a_symlink_refusal_on_write_does_not_speak_of_exports(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / entry["files"][0]["name"]).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"leads outside") as caught:
        teacher_file.write(entry, t, tmp_path / "ckpts")
    assert "export" not in str(caught.value)


def test_a_saved_teacher_of_another_model_is_refused_at_fit_start():
    from torch import nn

    from lightning_pat.training.distill import Distiller

    distiller = Distiller(alpha=0.5, temperature=1.0, teacher=None)
    distiller.bind(nn.Linear(3, 2), "")
    distiller.load_state_dict({"teacher": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}})
    with pytest.raises(ValueError, match=r"does not fit .*other shapes or dtypes \['weight'\]"):
        distiller.check_saved()
    distiller.load_state_dict({"teacher": {"weight": torch.zeros(2, 3)}})
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        distiller.check_saved()
    distiller.load_state_dict({"teacher": {**nn.Linear(3, 2).state_dict(), "extra": 1}})
    with pytest.raises(ValueError, match=r"not tensors \['extra'\]"):
        distiller.check_saved()
    distiller.load_state_dict({"teacher": nn.Linear(3, 2).state_dict()})
    distiller.check_saved()
    distiller.load_state_dict({"teacher": {**teacher_file.reference(tensors()), "world": "two"}})
    with pytest.raises(ValueError, match=r"`world` .* must be an int >= 1, got 'two'"):
        distiller.check_saved()
