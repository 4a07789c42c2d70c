"""The teacher file of ``distill_teacher_store="file"``: reference, write, read and every refusal (one process).

The sharded cases (world size, layout) are checked on references as a 2-rank run writes them; the 2-rank run itself
is ``test_file_store_writes_each_ranks_shards_once_and_resumes_bitwise`` in
``tests/integration/test_distill_model_parallel.py``.
"""

from __future__ import annotations

import hashlib

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
    got = teacher_file.read(entry, directories=[tmp_path / "nowhere", tmp_path], like=t)
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
    assert teacher_file.digest(teacher_file.read(entry, directories=[tmp_path], like=t)) == entry["files"][0]["digest"]


def test_shapes_other_than_the_models_are_refused(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    teacher_file.write(entry, t, tmp_path)
    like = {**t, "a.weight": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=rf"{OPTION}: .* holds tensors of other shapes \['a.weight'\]"):
        teacher_file.read(entry, directories=[tmp_path], like=like)
    with pytest.raises(ValueError, match=r"holds other tensors than the model \(missing \['c'\], unexpected \[\]\)"):
        teacher_file.read(entry, directories=[tmp_path], like={**t, "c": torch.zeros(1)})


def sharded_entry(world: int = 2) -> dict:
    """A reference as ``world`` ranks write it for a sharded teacher."""
    files = [
        {"name": f"pat-teacher-0123456789abcdef-rank{r}of{world}.safetensors", "digest": "0" * 64, "layout": "1" * 64}
        for r in range(world)
    ]
    return {"format": "file", "sharded": True, "world": world, "mesh": "mesh {'data_parallel': 2}", "files": files}


def test_a_sharded_teacher_on_another_world_size_is_refused_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"shards of 2 ranks \(mesh \{'data_parallel': 2\}\), and this run has 1; .*"):
        teacher_file.read(sharded_entry(2), directories=[tmp_path], like=tensors())


def test_a_shard_of_another_layout_is_refused(tmp_path):
    t = tensors()
    entry = {**teacher_file.reference(t), "sharded": True, "world": 1, "mesh": "mesh {'data_parallel': 2}"}
    entry["files"][0]["name"] = "pat-teacher-0123456789abcdef-rank0of1.safetensors"
    teacher_file.write(entry, t, tmp_path)
    entry["files"][0]["layout"] = "f" * 64  # what another mesh would have recorded
    with pytest.raises(ValueError, match=r"another layout \(mesh \{'data_parallel': 2\}\) than this run's model"):
        teacher_file.read(entry, directories=[tmp_path], like=t)


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
        teacher_file.read(entry, directories=[tmp_path], like=tensors())


def test_a_symlink_leading_outside_the_directory_is_refused(tmp_path):
    t = tensors()
    entry = teacher_file.reference(t)
    outside = tmp_path / "outside"
    teacher_file.write(entry, t, outside)
    inside = tmp_path / "ckpts"
    inside.mkdir()
    (inside / entry["files"][0]["name"]).symlink_to(outside / entry["files"][0]["name"])
    with pytest.raises(ValueError, match=r"leads outside .* \(a symlink to"):
        teacher_file.read(entry, directories=[inside], like=t)


def test_a_malformed_reference_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"the checkpoint's teacher reference is malformed"):
        teacher_file.read({"format": "file", "files": []}, directories=[tmp_path], like=tensors())
