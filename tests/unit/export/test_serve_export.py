"""Serving exports: the tokenizer next to the model, GGUF (read back by transformers and by ``gguf``'s reader) and
DeciLM (read back by load_pretrained), and what each format refuses.

References: transformers' own GGUF loader (it undoes llama.cpp's q/k row order itself) and the Hugging Face model's
logits; the per-layer arrays and the q/k row order against the modules, written out here index by index.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from lightning_pat import presets, prune_clusters, shrink
from lightning_pat.export.pretrained import load_pretrained, save_pretrained
from lightning_pat.shrink import hf_entry
from tests.common import serve_models

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tok():
    return serve_models.tokenizer()


def _ids(tok, texts=serve_models.PROMPTS):
    return [tok(t)["input_ids"] for t in texts]


def _logits(model, tok):
    with torch.no_grad():
        return model(torch.tensor([tok("def main():\n    return 1234 # x")["input_ids"]])).logits


def ranked_mlp(residual=False, **kw):
    """Per-layer MLP widths (and a narrower residual), heads untouched: what DeciLM expresses."""
    model = serve_models.llama(**kw)
    if residual:
        policy = presets.llama(model, heads=False, residual=True)
        small = shrink(model, prune_clusters(model, policy, target_params=0.6, target_widths="ranked"))
        assert small.model.embed_tokens.embedding_dim % 4  # not a multiple of the heads: a config transformers refuses
        return small
    return shrink(
        model, prune_clusters(model, presets.llama(model, heads=False), target_params=0.8, target_widths="ranked")
    )


def ranked_heads():
    """Per-layer MLP widths and GQA groups (query heads differ per layer): GGUF's deci arch only."""
    model = serve_models.llama(layers=3, heads=8, kv=4, hidden=256)
    small = shrink(model, prune_clusters(model, "llama", target_params=0.7, target_widths="ranked", min_kept=0.25))
    heads = [layer.self_attn.q_proj.out_features // 32 for layer in small.model.layers]
    assert len(set(heads)) > 1, heads  # the case under test
    return small


def uniform():
    model = serve_models.llama()
    return shrink(model, prune_clusters(model, "llama", target_params=0.7))


# ---------------------------------------------------------------------------------------------------- tokenizer
def test_the_tokenizer_goes_next_to_the_model_from_an_object_a_directory_or_the_source(tmp_path, tok):
    from transformers import AutoTokenizer, LlamaForCausalLM

    text = "The capital of France is 1234. <|im_end|>"
    model = serve_models.llama(layers=1)
    save_pretrained(model, tmp_path / "obj", tokenizer=tok)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "obj"))
    assert AutoTokenizer.from_pretrained(tmp_path / "obj")(text)["input_ids"] == tok(text)["input_ids"]
    save_pretrained(model, tmp_path / "dir", tokenizer=tmp_path / "obj")  # copied from a directory
    assert AutoTokenizer.from_pretrained(tmp_path / "dir")(text)["input_ids"] == tok(text)["input_ids"]
    # a model loaded from a directory with a tokenizer: "auto" (the default) finds it through config.name_or_path
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "obj")
    small = shrink(loaded, prune_clusters(loaded, "llama", target_params=0.8))
    save_pretrained(small, tmp_path / "auto")
    assert AutoTokenizer.from_pretrained(tmp_path / "auto")(text)["input_ids"] == tok(text)["input_ids"]
    save_pretrained(small, tmp_path / "none", tokenizer=None)
    assert "tokenizer.json" not in os.listdir(tmp_path / "none")
    save_pretrained(model, tmp_path / "obj", tokenizer=None, overwrite=True)  # an export with a tokenizer is replaced
    assert "tokenizer.json" not in os.listdir(tmp_path / "obj")
    with pytest.raises(ValueError, match="not a directory holding tokenizer.json"):
        save_pretrained(model, tmp_path / "bad", tokenizer=tmp_path / "none")
    with pytest.raises(ValueError, match="must be 'auto', None, a directory or an object with save_pretrained"):
        save_pretrained(model, tmp_path / "bad", tokenizer=42)
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------------- GGUF
def test_uniform_gguf_loads_in_transformers_with_the_models_logits_and_tokens(tmp_path, tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = uniform()
    save_pretrained(small, tmp_path / "u", format="gguf", tokenizer=tok)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "u", gguf_file="model.gguf", dtype=torch.float32).eval()
    assert again.config.num_attention_heads == small.model.layers[0].self_attn.q_proj.out_features // 32
    torch.testing.assert_close(_logits(again, tok), _logits(small, tok), rtol=1e-5, atol=1e-5)
    gguf_tok = AutoTokenizer.from_pretrained(tmp_path / "u", gguf_file="model.gguf")
    for text in [*serve_models.TEXT, "digits 0123456789 and ünïcode", "<|im_start|>user\nhi<|im_end|>"]:
        assert gguf_tok(text)["input_ids"] == tok(text)["input_ids"], text


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _llama_cpp_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order written out: head h's row ``2 i + j`` is Hugging Face's row ``j * half + i``."""
    head_dim = weight.shape[0] // n_head
    half = head_dim // 2
    rows = []
    for h in range(n_head):
        for i in range(half):
            for j in range(2):
                rows.append(weight[h * head_dim + j * half + i])
    return torch.stack(rows)


def test_per_layer_gguf_has_the_deci_arrays_the_row_order_and_the_tokenizer(tmp_path, tok):
    from gguf import GGUFReader

    small = ranked_heads()
    big_tok = serve_models.tokenizer()
    save_pretrained(small, tmp_path / "p", format="gguf", tokenizer=big_tok)  # main format: hf (lightning_pat entry)
    reader = GGUFReader(tmp_path / "p" / "model.gguf")
    fields = _fields(reader)
    layers = small.model.layers
    assert fields["general.architecture"] == "deci"
    assert fields["deci.block_count"] == len(layers)
    assert fields["deci.attention.head_count"] == [la.self_attn.q_proj.out_features // 32 for la in layers]
    assert fields["deci.attention.head_count_kv"] == [la.self_attn.k_proj.out_features // 32 for la in layers]
    assert fields["deci.feed_forward_length"] == [la.mlp.down_proj.in_features for la in layers]
    assert fields["deci.attention.key_length"] == fields["deci.rope.dimension_count"] == 32
    assert fields["deci.embedding_length"] == 256
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        expected = {
            f"blk.{i}.attn_q.weight": _llama_cpp_rows(attn.q_proj.weight, attn.q_proj.out_features // 32),
            f"blk.{i}.attn_k.weight": _llama_cpp_rows(attn.k_proj.weight, attn.k_proj.out_features // 32),
            f"blk.{i}.attn_v.weight": attn.v_proj.weight,
            f"blk.{i}.attn_output.weight": attn.o_proj.weight,
            f"blk.{i}.ffn_down.weight": layer.mlp.down_proj.weight,
            f"blk.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
        }
        for name, weight in expected.items():
            data = torch.from_numpy(tensors[name].data.copy())
            assert list(data.shape) == list(weight.shape), name
            assert torch.equal(data, weight.detach()), name
    vocab = tok.get_vocab()
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == small.config.vocab_size
    assert all(tokens[i] == t for t, i in vocab.items())
    assert fields["tokenizer.ggml.token_type"][:3] == [3, 3, 3]  # the special tokens are CONTROL
    assert set(fields["tokenizer.ggml.token_type"][3:]) == {1}
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert len(fields["tokenizer.ggml.merges"]) == len(
        json.loads(big_tok.backend_tokenizer.to_str())["model"]["merges"]
    )
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert fields["tokenizer.ggml.add_bos_token"] is False
    # the main export still reloads exactly
    assert hf_entry.differences(small, load_pretrained(tmp_path / "p")) == []


@pytest.mark.parametrize(
    ("dtype", "ggml", "tol"), [("f16", "F16", 1e-3), ("bf16", "BF16", 1e-2), ("q8_0", "Q8_0", 2e-2)]
)
def test_gguf_types_hold_the_weights(tmp_path, tok, dtype, ggml, tol):
    from gguf import GGUFReader, LlamaFileType
    from gguf.quants import dequantize

    small = uniform()
    save_pretrained(small, tmp_path / dtype, format="gguf", tokenizer=tok, gguf_dtype=dtype)
    reader = GGUFReader(tmp_path / dtype / "model.gguf")
    assert _fields(reader)["general.file_type"] == int(getattr(LlamaFileType, f"MOSTLY_{ggml}"))
    tensors = {t.name: t for t in reader.tensors}
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type.name == "F32"  # norms stay f32
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type.name == ggml
    values = torch.from_numpy(
        dequantize(up.data, up.tensor_type).reshape(small.model.layers[0].mlp.up_proj.weight.shape)
    )
    torch.testing.assert_close(values, small.model.layers[0].mlp.up_proj.weight.detach(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------- DeciLM
@pytest.mark.parametrize(("tied", "residual"), [(True, False), (False, False), (True, True)])
def test_decilm_export_has_block_configs_and_loads_back_exactly(tmp_path, tok, tied, residual):
    small = ranked_mlp(tied=tied, residual=residual)
    widths = [layer.mlp.down_proj.in_features for layer in small.model.layers]
    assert len(set(widths)) > 1, widths
    save_pretrained(small, tmp_path / "d", format="decilm", tokenizer=tok)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas"
    assert config["architectures"] == ["DeciLMForCausalLM"]
    assert config["auto_map"] == {"AutoConfig": "configuration_decilm.DeciLMConfig"}
    assert [b["ffn"]["intermediate_size"] for b in config["block_configs"]] == widths
    assert {b["attention"]["n_heads_in_group"] for b in config["block_configs"]} == {2}  # 4 query / 2 KV heads
    assert "lightning_pat" not in config
    assert config["tie_word_embeddings"] is tied
    back = load_pretrained(tmp_path / "d")
    assert hf_entry.differences(small, back) == []
    torch.testing.assert_close(_logits(back, tok), _logits(small, tok), rtol=1e-5, atol=1e-5)  # eager vs sdpa
    # the loaded model saves again, in either format, and the tokenizer follows it (name_or_path is the export)
    save_pretrained(back, tmp_path / "again", format="decilm")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    assert (tmp_path / "again" / "tokenizer.json").is_file()
    save_pretrained(back, tmp_path / "hf")
    assert hf_entry.differences(small, load_pretrained(tmp_path / "hf")) == []


def test_the_shipped_config_class_reads_the_export_as_vllm_does(tmp_path, tok):
    import importlib.util

    save_pretrained(ranked_mlp(), tmp_path / "d", format="decilm", tokenizer=tok)
    spec = importlib.util.spec_from_file_location("configuration_decilm", tmp_path / "d" / "configuration_decilm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.DeciLMConfig.from_pretrained(tmp_path / "d")
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert [b.ffn.intermediate_size for b in config.block_configs] == [
        b["ffn"]["intermediate_size"] for b in written["block_configs"]
    ]
    assert not hasattr(config.block_configs[0].ffn, "ffn_mult")  # vLLM would read ffn_mult first
    assert config.to_dict()["block_configs"] == written["block_configs"]


def test_uniform_and_depth_pruned_models_export_as_decilm_too(tmp_path, tok):
    model = serve_models.llama(layers=4)
    small = shrink(model, prune_clusters(model, presets.llama(model, layers=True), target_params=0.6))
    assert len(small.model.layers) < 4  # dropped layers are deleted, not written as no_op blocks
    save_pretrained(small, tmp_path / "d", format=["decilm", "gguf"], tokenizer=tok)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["num_hidden_layers"] == len(config["block_configs"]) == len(small.model.layers)
    back = load_pretrained(tmp_path / "d")
    torch.testing.assert_close(_logits(back, tok), _logits(small, tok), rtol=1e-5, atol=1e-5)  # eager vs sdpa


def test_decilm_refuses_query_heads_that_differ_between_layers(tmp_path, tok):
    small = ranked_heads()
    with pytest.raises(ValueError, match=r"DeciLM has one query-head count for all layers.*\[\d+, \d+, \d+\] query"):
        save_pretrained(small, tmp_path / "d", format="decilm", tokenizer=tok)
    assert not (tmp_path / "d").exists()


def _edit_config(directory, edit):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_decilm_reader_refuses_what_a_llama_cannot_hold_and_reads_ffn_mult(tmp_path, tok):
    save_pretrained(ranked_mlp(), tmp_path / "d", format="decilm", tokenizer=tok)
    bad = tmp_path / "bad"
    for edit, match in [
        (
            lambda c: c["block_configs"][1]["attention"].update(no_op=True),
            r"block_configs\[1\] sets \['attention.no_op'\]",
        ),
        (lambda c: c["block_configs"][0]["ffn"].update(replace_with_linear=True), r"ffn.replace_with_linear"),
        (lambda c: c["block_configs"].pop(), r"one block_configs entry per layer \(3\), got 2"),
        (lambda c: c["block_configs"][0]["attention"].update(n_heads_in_group=3), r"does not divide"),
        (lambda c: c.update(hidden_size="128"), r"hidden_size must be a positive integer"),
    ]:
        import shutil

        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(tmp_path / "d", bad)
        _edit_config(bad, edit)
        with pytest.raises(ValueError, match=match):
            load_pretrained(bad)
    from lightning_pat.export.decilm import read_blocks

    _, _, shapes = read_blocks(
        {
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_hidden_layers": 1,
            "block_configs": [{"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 2.5}}],
        }
    )
    assert shapes[0].ffn == 1024
    assert shapes[0].n_kv_head == 3


# ---------------------------------------------------------------------------------------------------- refusals
def test_bad_formats_are_refused_before_anything_is_written(tmp_path, tok):
    from lightning_pat.demo import TinyGPT, TinyGPTConfig

    model = serve_models.llama(layers=1)
    cases = [
        ({"format": "onnx"}, r"`format` must be one of \['hf', 'decilm', 'gguf'\]"),
        ({"format": ["hf", "decilm"]}, "holds both 'hf' and 'decilm'"),
        ({"format": "gguf", "gguf_dtype": "q4_k"}, r"`gguf_dtype` must be one of"),
        ({"format": "gguf", "tokenizer": None}, "a GGUF file embeds the tokenizer, and none was found"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            save_pretrained(model, tmp_path / "x", **kwargs)
    with pytest.raises(ValueError, match="writes Llama-family Hugging Face models; TinyGPT is not one"):
        save_pretrained(TinyGPT(TinyGPTConfig(n_layer=1)), tmp_path / "x", format="decilm")
    from tests.common.tiny_families import llama_like

    qwen = llama_like("qwen2", n_head=4, n_kv=2).fresh()
    with pytest.raises(ValueError, match="writes the Llama family only.*Qwen2ForCausalLM"):
        save_pretrained(qwen, tmp_path / "x", format="decilm")
    assert not (tmp_path / "x").exists()


def test_a_tokenizer_llama_cpp_would_split_differently_is_refused_and_the_old_export_stays(tmp_path, tok):
    from tokenizers import pre_tokenizers

    model = serve_models.llama(layers=1)
    save_pretrained(model, tmp_path / "e", tokenizer=tok)
    before = sorted(os.listdir(tmp_path / "e"))
    other = copy.deepcopy(tok)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="has no llama.cpp name this writer knows"):
        save_pretrained(model, tmp_path / "e", format="gguf", tokenizer=other, overwrite=True)
    assert sorted(os.listdir(tmp_path / "e")) == before
