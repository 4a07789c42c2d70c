"""lightning_pat.lm.weights: a model built with its parameters on meta, then filled from the checkpoint.

The reference is transformers' own ``from_pretrained`` of the same directory; the sharded load (each rank its own
shards) runs under ModelParallelStrategy in ``tests/integration/test_shrink_on_freeze_sharded.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lightning_pat.lm import CausalLM
from lightning_pat.lm.weights import empty_model, load_weights
from tests.common.tiny_lm import tiny_lm_dir


def test_empty_init_allocates_no_weight_and_then_equals_from_pretrained(tmp_path):
    source = tiny_lm_dir(tmp_path)
    lm = CausalLM(str(source), empty_init=True)
    assert all(p.is_meta for p in lm.model.parameters())
    assert not any(b.is_meta for b in lm.model.buffers())  # the rotary frequencies are computed as usual
    lm.configure_model()  # one device: read every tensor
    reference = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=False).eval()
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight  # tied again
    x = torch.randint(0, reference.config.vocab_size, (2, 9))
    lm.model.eval()
    with torch.no_grad():
        assert torch.equal(lm.model(x).logits, reference(x).logits)
    lm.configure_model()  # a second call (a second fit) reads nothing again
    with torch.no_grad():
        assert torch.equal(lm.model(x).logits, reference(x).logits)


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    source = tiny_lm_dir(tmp_path / "a")
    split = tmp_path / "split"
    split.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (split / name).write_bytes((source / name).read_bytes())
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    halves = {"part-1.safetensors": names[: len(names) // 2], "part-2.safetensors": names[len(names) // 2 :]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, split / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (split / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = empty_model(split, dtype=torch.float32, what="test")
    load_weights(model, split, device=torch.device("cpu"), what="test")
    for name, tensor in tensors.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_refusals_name_the_file_and_happen_before_anything_is_allocated(tmp_path):
    source = tiny_lm_dir(tmp_path / "a")
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(ValueError, match="empty_init=True reads the weights from a local directory"):
        CausalLM(str(tmp_path / "no-weights"), empty_init=True)
    model = empty_model(source, dtype=torch.float32, what="test")
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(source / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight is \(3,\) in model.safetensors.*expects \(48,\)"):
        load_weights(model, bad, device=torch.device("cpu"), what="test")
    assert all(p.is_meta for p in model.parameters())  # refused before the first allocation
    index = tmp_path / "escape"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../a/tiny-lm/x"}}))
    with pytest.raises(ValueError, match="not a plain relative name"):
        load_weights(model, index, device=torch.device("cpu"), what="test")


@pytest.mark.parametrize("empty_init", [False, True], ids=["from_pretrained", "empty_init"])
def test_num_layers_keeps_the_checkpoints_first_layers_and_refuses_a_count_out_of_range(tmp_path, empty_init):
    source = tiny_lm_dir(tmp_path)  # 2 layers
    lm = CausalLM(str(source), num_layers=1, empty_init=empty_init)
    lm.configure_model()
    full = load_file(source / "model.safetensors")
    got = lm.model.state_dict()
    assert lm.model.config.num_hidden_layers == 1
    assert len(lm.model.model.layers) == 1
    assert sorted(got) == sorted([*(k for k in full if not k.startswith("model.layers.1.")), "lm_head.weight"])
    for name, tensor in got.items():  # the checkpoint's own tensors, the tied head included
        assert torch.equal(tensor, full[name if name != "lm_head.weight" else "model.embed_tokens.weight"]), name
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match=r"`num_layers` must be an int in \[1, 2\]"):
            CausalLM(str(source), num_layers=bad, empty_init=empty_init)
