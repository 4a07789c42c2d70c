"""Heads of ``nn.MultiheadAttention``, torchvision's Swin V1/V2 window attention and MaxViT's attention: found by
discovery, cut by the shrink (the module is replaced by :mod:`lightning_pat.heads.replace`' own, holding
the same parameters), and the shrunk model equal to the masked one; the MHA configurations and calls that are not
supported are left out with the reason. Small models built from torchvision's own classes (random init, randomised
norms), eval, fp32."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_pat import Cluster, discover, prune_clusters, shrink
from lightning_pat.export.module_tree import describe, rebuild
from lightning_pat.heads import (
    HeadsMultiheadAttention,
    MaxVitAttention,
    WindowAttention,
    WindowAttentionV2,
)
from tests.common import torchvision_zoo as zoo
from tests.common.cnn_models import exact_shrink

tv = zoo.import_torchvision()  # `make setup` installs it; missing, this file fails to collect (never a silent skip)


def _mha(**kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, **kwargs).eval()
    with torch.no_grad():
        for p in (mha.in_proj_bias, mha.out_proj.bias):
            if p is not None:
                p.normal_()
    return mha


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_heads_mha_computes_what_mha_computes(batch_first, need_weights):
    mha = _mha(batch_first=batch_first)
    ours = HeadsMultiheadAttention.adopt(mha)
    assert ours.in_proj_weight is mha.in_proj_weight
    assert ours.out_proj is mha.out_proj
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        (a, wa), (b, wb) = mha(x, x, x, need_weights=need_weights), ours(x, x, x, need_weights=need_weights)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if need_weights:
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)
    assert set(ours.state_dict()) == set(mha.state_dict())


@pytest.mark.parametrize(("shift", "side"), [([0, 0], 8), ([2, 2], 8), ([2, 2], 10), ([2, 2], 4)])
def test_window_attention_computes_what_swin_computes(shift, side):
    from torchvision.models.swin_transformer import ShiftedWindowAttention

    torch.manual_seed(0)
    swin = ShiftedWindowAttention(16, [4, 4], shift, 4).eval()
    ours = WindowAttention.adopt(swin)
    x = torch.randn(2, side, side + 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), swin(x), rtol=1e-5, atol=1e-6)
    assert set(ours.state_dict()) == set(swin.state_dict())


def _stock_v2(shift: list[int], heads: int = 4):
    from torchvision.models.swin_transformer import ShiftedWindowAttentionV2

    torch.manual_seed(0)
    swin = ShiftedWindowAttentionV2(16, [4, 4], shift, heads).eval()
    with torch.no_grad():  # per-head scales apart, and a k bias (torchvision ignores it) that is not zero
        swin.logit_scale.copy_(torch.randn(heads, 1, 1) * 0.5 + 2.3)
        swin.logit_scale[0] = 5.0  # above log(100): clamped
        swin.qkv.bias.normal_()
    return swin


@pytest.mark.parametrize(("shift", "side"), [([0, 0], 8), ([2, 2], 8), ([2, 2], 10), ([2, 2], 4)])
def test_window_attention_v2_computes_what_swin_v2_computes(shift, side):
    swin = _stock_v2(shift)
    ours = WindowAttentionV2.adopt(swin)
    assert ours.logit_scale is swin.logit_scale
    assert (ours.qkv, ours.proj, ours.cpb_mlp) == (swin.qkv, swin.proj, swin.cpb_mlp)  # the modules themselves
    assert (ours.num_heads, ours.head_dim) == (4, 4)
    x = torch.randn(2, side, side + 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), swin(x), rtol=1e-5, atol=1e-6)
    assert list(ours.state_dict()) == list(swin.state_dict())


def test_a_new_window_attention_v2_has_torchvision_s_tables_and_init():
    swin = _stock_v2([2, 2])
    ours = WindowAttentionV2(16, [4, 4], [2, 2], 4, 4)
    for name in ("relative_coords_table", "relative_position_index"):
        assert torch.equal(getattr(ours, name), getattr(swin, name)), name
    assert list(ours.state_dict()) == list(swin.state_dict())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in swin.state_dict().items()}
    assert not ours.qkv.bias[16:32].any()
    torch.testing.assert_close(ours.logit_scale, torch.log(10 * torch.ones(4, 1, 1)))


def test_our_attention_modules_rebuild_from_the_pickle_free_format():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"v1": WindowAttention(16, [4, 4], [2, 2], 3, 4), "v2": WindowAttentionV2(16, [4, 4], [2, 2], 3, 4)}
    ).eval()
    again = rebuild(*describe(model))
    x = torch.randn(2, 8, 8, 16)
    with torch.no_grad():
        for name in ("v1", "v2"):
            assert type(again[name]) is type(model[name])
            assert torch.equal(again[name](x), model[name](x)), name
    maxvit = nn.ModuleDict({"attn": MaxVitAttention(16, 3, 4, 16)}).eval()
    again = rebuild(*describe(maxvit))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert type(again["attn"]) is MaxVitAttention
        assert torch.equal(again["attn"](x), maxvit["attn"](x))


def _stock_maxvit(feat_dim: int = 32, head_dim: int = 8, seq: int = 16):
    from torchvision.models.maxvit import RelativePositionalMultiHeadAttention

    torch.manual_seed(0)
    stock = RelativePositionalMultiHeadAttention(feat_dim, head_dim, seq).eval()
    with torch.no_grad():  # a bias table far from zero, so a wrong column would show
        stock.relative_position_bias_table.normal_()
    return stock


@pytest.mark.parametrize(("feat_dim", "head_dim", "seq"), [(32, 8, 16), (24, 8, 9), (16, 16, 49)])
def test_maxvit_attention_computes_what_maxvit_computes(feat_dim, head_dim, seq):
    stock = _stock_maxvit(feat_dim, head_dim, seq)
    ours = MaxVitAttention.adopt(stock)
    assert (ours.to_qkv, ours.merge) == (stock.to_qkv, stock.merge)  # the modules themselves
    assert ours.relative_position_bias_table is stock.relative_position_bias_table
    assert (ours.n_heads, ours.head_dim, ours.scale_factor) == (feat_dim // head_dim, head_dim, feat_dim**-0.5)
    x = torch.randn(2, 3, seq, feat_dim)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), stock(x), rtol=1e-6, atol=1e-6)
    assert list(ours.state_dict()) == list(stock.state_dict())


def test_a_new_maxvit_attention_has_torchvision_s_index_and_shapes():
    stock = _stock_maxvit(32, 8, 16)
    ours = MaxVitAttention(32, 4, 8, 16)
    assert torch.equal(ours.relative_position_index, stock.relative_position_index)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    assert ours.scale_factor == stock.scale_factor
    ours_cut = MaxVitAttention(32, 2, 8, 16)  # fewer heads: the scale stays the input width's
    assert ours_cut.scale_factor == stock.scale_factor
    assert ours_cut(torch.randn(1, 2, 16, 32)).shape == (1, 2, 16, 32)


def test_maxvit_attention_adopts_only_whole_heads_of_torchvision_s_module():
    with pytest.raises(ValueError, match="MaxVitAttention: cannot adopt Linear"):
        MaxVitAttention.adopt(nn.Linear(4, 4))
    stock = _stock_maxvit(32, 8, 16)
    stock.merge = nn.Linear(20, 32)  # 20 columns: not 4 heads of one head dim, nor a third of to_qkv's rows
    with pytest.raises(ValueError, match=r"to_qkv rows 96, merge columns 20 and 4 heads .* not whole heads"):
        MaxVitAttention.adopt(stock)


def _small_vit() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = tv.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    return zoo.randomize(model).eval(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _small_swin() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)  # 64x64: 16x16 then 8x8 patches, windows of 4: shifted windows in both stages
    model = tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4], num_classes=10
    )
    return zoo.randomize(model).eval(), torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _small_swin_v2() -> tuple[nn.Module, torch.Tensor]:
    from torchvision.models import swin_transformer as st

    torch.manual_seed(0)  # as _small_swin, with V2 blocks (post-norm, cosine attention) and V2 patch merging
    model = tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4], num_classes=10,
        block=st.SwinTransformerBlockV2, downsample_layer=st.PatchMergingV2,
    )  # fmt: skip
    return zoo.randomize(model).eval(), torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _small_maxvit() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)  # 64x64: stem 32x32, then 16x16 and 8x8, partitions of 4x4 (window and grid attention)
    model = tv.models.maxvit.MaxVit(
        input_size=(64, 64), stem_channels=16, partition_size=4, block_channels=[16, 32], block_layers=[1, 1],
        head_dim=8, stochastic_depth_prob=0.0, num_classes=10,
    )  # fmt: skip
    model = zoo.randomize(model)
    with torch.no_grad():  # bias tables far from zero, so a wrong column would show
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_()
    return model.eval(), torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _prune_and_shrink(model: nn.Module, x: torch.Tensor, clusters) -> tuple[nn.Module, float]:
    result = prune_clusters(model, clusters, 0.5, score="rms")
    with torch.no_grad():
        masked = model(x)
    small = shrink(model, result, example_input=x)
    with torch.no_grad():
        out = small(x)
    assert float(masked.norm()) > 1e-3
    return small, float((out - masked).abs().max() / masked.abs().max())


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_vit_heads_are_found_pruned_and_shrunk_exactly():
    model, x = _small_vit()
    found = discover(model, x)
    heads = [c for c in found.clusters if c.name.endswith("self_attention")]
    assert len(heads) == 2
    assert all(c.num_units == 4 for c in heads)
    assert heads[0].writers == [
        f"encoder.layers.encoder_layer_0.self_attention.{p}[{i}:{i + 32}]"
        for p in ("in_proj_weight", "in_proj_bias")
        for i in (0, 32, 64)
    ]
    assert heads[0].readers == ["encoder.layers.encoder_layer_0.self_attention.out_proj.weight"]
    before = _count(model)
    small, rel = _prune_and_shrink(model, x, found.clusters)
    assert rel < 1e-5
    for block in small.encoder.layers:
        attn = block.self_attention
        assert isinstance(attn, HeadsMultiheadAttention)
        assert (attn.num_heads, attn.head_dim, attn.embed_dim) == (2, 8, 32)
        assert attn.in_proj_weight.shape == (48, 32)
        assert attn.out_proj.in_features == 16
        assert block.mlp[0].out_features == 32
    # independent count: per layer, heads 4 -> 2 of 8 (in_proj 3*16 rows of 32 + bias, out_proj 16 columns of 32)
    # and the MLP 64 -> 32 (fc1 32 rows of 32 + bias, fc2 32 columns of 32)
    per_layer = 3 * 16 * 32 + 3 * 16 + 16 * 32 + 32 * 32 + 32 + 32 * 32
    assert before - _count(small) == 2 * per_layer


@pytest.mark.slow
def test_swin_heads_are_found_with_the_bias_table_pruned_and_shrunk_exactly():
    model, x = _small_swin()
    found = discover(model, x)
    heads = {c.name: c for c in found.clusters if c.name.endswith("attn.qkv")}
    assert {n: c.num_units for n, c in heads.items()} == {
        "features.1.0.attn.qkv": 2, "features.1.1.attn.qkv": 2, "features.3.0.attn.qkv": 4, "features.3.1.attn.qkv": 4,
    }  # fmt: skip
    assert set(heads["features.3.1.attn.qkv"].readers) == {
        "features.3.1.attn.proj.weight", "features.3.1.attn.relative_position_bias_table",
    }  # fmt: skip
    before = _count(model)
    small, rel = _prune_and_shrink(model, x, found.clusters)
    assert rel < 1e-5
    cut = 0
    for stage, (heads_before, dim) in ((1, (2, 16)), (3, (4, 32))):
        for block in small.features[stage]:
            attn = block.attn
            assert isinstance(attn, WindowAttention)
            assert (attn.num_heads, attn.head_dim) == (heads_before // 2, 8)
            assert attn.relative_position_bias_table.shape == (49, heads_before // 2)
            d, h = dim // 2, heads_before // 2  # kept inner width, heads dropped
            # qkv: 3*d rows of dim + 3*d biases; proj: d columns of dim; the table: h columns of 49; MLP 4*dim -> 2*dim
            cut += 3 * d * dim + 3 * d + d * dim + 49 * h + 2 * dim * dim + 2 * dim + 2 * dim * dim
    assert before - _count(small) == cut


@pytest.mark.slow
def test_swin_v2_heads_are_found_with_logit_scale_and_cpb_rows_pruned_and_shrunk_exactly():
    model, x = _small_swin_v2()
    with torch.no_grad():  # torchvision ignores the k part of qkv's bias: a non-zero one must not matter
        for name, p in model.named_parameters():
            if name.endswith("qkv.bias"):
                p.normal_()
    found = discover(model, x)
    heads = {c.name: c for c in found.clusters if c.name.endswith(".attn")}
    assert {n: c.num_units for n, c in heads.items()} == {
        "features.1.0.attn": 2, "features.1.1.attn": 2, "features.3.0.attn": 4, "features.3.1.attn": 4,
    }  # fmt: skip
    p = "features.3.1.attn."
    assert heads["features.3.1.attn"].writers == [
        f"{p}logit_scale",
        *(f"{p}qkv.{w}[{i}:{i + 32}]" for w in ("weight", "bias") for i in (0, 32, 64)),
        f"{p}cpb_mlp.2.weight",
    ]
    assert heads["features.3.1.attn"].readers == [f"{p}proj.weight"]
    before = _count(model)
    small, rel = _prune_and_shrink(model, x, found.clusters)
    assert rel < 1e-5
    cut = 0
    for stage, (heads_before, dim) in ((1, (2, 16)), (3, (4, 32))):
        for block in small.features[stage]:
            attn = block.attn
            assert isinstance(attn, WindowAttentionV2)
            h = heads_before // 2  # heads kept (and dropped)
            assert (attn.num_heads, attn.head_dim) == (h, 8)
            assert attn.logit_scale.shape == (h, 1, 1)
            assert attn.cpb_mlp[2].weight.shape == (h, 256)  # the continuous bias MLP's hidden 512 -> 256 too
            d = dim // 2  # inner width kept (and dropped)
            # qkv: 3*d rows of dim + 3*d biases; proj: d columns of dim; logit_scale: h; cpb_mlp: 2 -> 256 -> h
            # from 2 -> 512 -> 2h (256 rows of 2 + 256 biases, 2h*512 - h*256 of the last); MLP 4*dim -> 2*dim
            cut += 3 * d * dim + 3 * d + d * dim + h + 3 * 256 + (2 * h * 512 - h * 256)
            cut += 2 * dim * dim + 2 * dim + 2 * dim * dim
    assert before - _count(small) == cut


@pytest.mark.parametrize("left", ["logit_scale", "cpb_mlp.2.weight"])
def test_a_swin_v2_cut_that_leaves_out_a_per_head_part_is_refused_naming_the_module(left):
    model, x = _small_swin_v2()
    found = discover(model, x)
    [heads] = [c for c in found.clusters if c.name == "features.3.1.attn"]
    writers = [w for w in heads.writers if w != f"features.3.1.attn.{left}"]
    assert len(writers) == len(heads.writers) - 1
    cut = Cluster("heads", writers=writers, readers=heads.readers, num_units=4)
    result = prune_clusters(model, [cut], 0.5, score="rms")
    shown = "logit_scale entries [0, 1, 2, 3]" if left == "logit_scale" else "cpb_mlp.2 rows [0, 1, 2, 3]"
    with pytest.raises(
        ValueError,
        match=rf"attention 'features.3.1.attn' \(ShiftedWindowAttentionV2\): the parts keep different heads"
        rf" \(.*{re.escape(shown)}.*\); prune them with one heads cluster",
    ):
        shrink(model, result)
    assert model.features[3][1].attn.logit_scale.shape == (4, 1, 1)  # nothing changed


_MAXVIT_ATTNS = [f"blocks.{b}.layers.0.layers.{p}_attention.attn_layer.1" for b in (0, 1) for p in ("window", "grid")]


def test_maxvit_heads_are_found_with_the_bias_table_pruned_and_shrunk_exactly():
    model, x = _small_maxvit()
    found = discover(model, x)
    heads = {c.name.removesuffix(".to_qkv"): c for c in found.clusters if c.name.endswith("to_qkv")}
    assert {n: c.num_units for n, c in heads.items()} == dict(zip(_MAXVIT_ATTNS, (2, 2, 4, 4), strict=True))
    p = "blocks.1.layers.0.layers.grid_attention.attn_layer.1."
    assert heads[p[:-1]].writers == [f"{p}to_qkv.{w}[{i}:{i + 32}]" for w in ("weight", "bias") for i in (0, 32, 64)]
    assert set(heads[p[:-1]].readers) == {f"{p}merge.weight", f"{p}relative_position_bias_table"}
    small, rel = _prune_and_shrink(model, x, found.clusters)  # every cluster: heads, MLPs, MBConv, SE
    assert rel < 1e-5
    for name, heads_before in zip(_MAXVIT_ATTNS, (2, 2, 4, 4), strict=True):
        attn = small.get_submodule(name)
        assert isinstance(attn, MaxVitAttention)
        assert (attn.n_heads, attn.head_dim) == (heads_before // 2, 8)
        assert attn.relative_position_bias_table.shape == (49, heads_before // 2)
        assert attn.scale_factor == attn.merge.out_features**-0.5  # the input width's, as before the cut
    # the heads alone, on a fresh model: per attention of width C and H heads of 8, H/2 heads (d = C/2 channels) go:
    # to_qkv 3*d rows of C and 3*d biases, merge d columns of C, the bias table H/2 columns of 49
    model, x = _small_maxvit()
    before = _count(model)
    small, rel = _prune_and_shrink(model, x, list(heads.values()))
    assert rel < 1e-5
    cut = sum(2 * (3 * d * c + 3 * d + d * c + 49 * h) for c, d, h in ((16, 8, 1), (32, 16, 2)))
    assert before - _count(small) == cut


def test_a_maxvit_cut_that_leaves_out_the_bias_table_is_refused_naming_the_module():
    model, x = _small_maxvit()
    found = discover(model, x)
    name = "blocks.1.layers.0.layers.grid_attention.attn_layer.1"
    [heads] = [c for c in found.clusters if c.name == f"{name}.to_qkv"]
    readers = [r for r in heads.readers if not r.endswith("relative_position_bias_table")]
    cut = Cluster("heads", writers=heads.writers, readers=readers, num_units=4)
    result = prune_clusters(model, [cut], 0.5, score="rms")
    with pytest.raises(
        ValueError,
        match=rf"attention '{re.escape(name)}' \(RelativePositionalMultiHeadAttention\): the parts keep different heads"
        r" \(.*relative_position_bias_table columns \[0, 1, 2, 3\].*\); prune them with one heads cluster",
    ):
        shrink(model, result)
    assert model.get_submodule(name).relative_position_bias_table.shape == (49, 4)  # nothing changed


def test_a_maxvit_cut_that_splits_a_head_is_refused_naming_the_module():
    model, _ = _small_maxvit()
    name = "blocks.0.layers.0.layers.window_attention.attn_layer.1"
    writers = [f"{name}.to_qkv.weight[0:16]", f"{name}.to_qkv.bias[0:16]"]  # q channels, one by one
    cut = Cluster("channels", writers=writers, readers=[f"{name}.merge.weight"], num_units=16)
    result = prune_clusters(model, [cut], 0.25, score="rms")
    with pytest.raises(
        ValueError, match=rf"attention '{re.escape(name)}' .*q rows: 12 kept channels are not whole heads of head_dim 8"
    ):
        shrink(model, result)
    assert model.get_submodule(name).to_qkv.out_features == 48  # nothing changed


class _Block(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, call: str = "self") -> None:
        super().__init__()
        self.inp, self.mha, self.out, self.call = nn.Linear(8, 16), mha, nn.Linear(16, 4), call

    def forward(self, x):
        a = self.inp(x)
        if self.call == "mask3d":  # one mask per (batch entry, head): which heads are kept is not known to the module
            mask = torch.zeros(a.shape[0] * 4, a.shape[1], a.shape[1], dtype=torch.bool, device=a.device)
            return self.out(self.mha(a, a, a, need_weights=False, attn_mask=mask)[0])
        if self.call == "cross":
            return self.out(self.mha(a, a.flip(1), a.flip(1), need_weights=False)[0])
        if self.call == "kdim":
            return self.out(self.mha(a, a[..., :12], a[..., :12], need_weights=False)[0])
        return self.out(self.mha(a, a, a, need_weights=False)[0])


def test_mha_heads_are_cut_and_the_model_shrunk_exactly():
    model = _Block(_mha(batch_first=True)).eval()
    found = discover(model, torch.randn(2, 5, 8))
    [heads] = [c for c in found.clusters if c.name == "mha"]
    assert heads.num_units == 4
    small = exact_shrink(model, found.clusters, torch.randn(3, 7, 8))
    assert isinstance(small.mha, HeadsMultiheadAttention)
    assert small.mha.num_heads < 4


@pytest.mark.parametrize(
    ("kwargs", "call", "reason"),
    [
        ({"add_bias_kv": True}, "self", "add_bias_kv=True"),
        ({"add_zero_attn": True}, "self", "add_zero_attn=True"),
        ({"kdim": 12, "vdim": 12}, "kdim", "kdim or vdim differs from embed_dim"),
        ({}, "mask3d", "called with a 3-D attn_mask"),
        ({}, "cross", "called as cross-attention"),
    ],
)
def test_unsupported_mha_is_left_out_with_its_reason(kwargs, call, reason):
    mha = _mha(batch_first=True, **kwargs)
    model = _Block(mha, call).eval()
    x = torch.randn(2, 5, 8)
    found = discover(model, x)

    def packed(member: str) -> bool:  # in_proj_weight/bias, or q/k/v_proj_weight with kdim
        return member.startswith("mha.") and not member.startswith("mha.out_proj")

    assert not [m for c in found.clusters for m in (*c.writers, *c.readers) if packed(m)]
    reasons = [r for lo in found.left_out if any(packed(m) for m in lo.members) for r in lo.reasons]
    assert any(f"nn.MultiheadAttention 'mha': {reason}" in r for r in reasons), reasons
    exact_shrink(model, found.clusters, x)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_small_vit, _small_swin, _small_swin_v2, _small_maxvit])
def test_a_shrunk_model_is_discovered_and_shrunk_again(build):
    model, x = build()
    found = discover(model, x)
    small, _ = _prune_and_shrink(model, x, found.clusters)
    again = discover(small, x)  # our modules traced as they are: heads of 2 (ViT, Swin's second stage) found again
    names = ("self_attention", "attn.qkv", ".attn", "to_qkv")
    heads = [c for c in again.clusters if c.name.endswith(names) and c.num_units == 2]
    assert len(heads) == 2
    smaller, rel = _prune_and_shrink(small, x, again.clusters)
    assert rel < 1e-5
    attns = [
        m
        for m in smaller.modules()
        if isinstance(m, (HeadsMultiheadAttention, WindowAttention, WindowAttentionV2, MaxVitAttention))
    ]
    assert sorted(getattr(m, "num_heads", getattr(m, "n_heads", 0)) for m in attns) == [1] * len(attns)


def _masks(kinds: tuple[str | None, str | None], batch: int, length: int) -> dict[str, torch.Tensor | None]:
    """A causal bool or a distance-decay float ``attn_mask`` ``(L, L)``; a bool or float ``key_padding_mask``
    ``(B, L)`` padding the last ``2 * b`` positions of batch entry ``b``."""
    attn, pad = kinds
    pos = torch.arange(length)
    causal = pos[None, :] > pos[:, None]
    padded = pos[None, :] + 2 * torch.arange(batch)[:, None] >= length
    return {
        "attn_mask": {None: None, "bool": causal, "float": -0.3 * (pos[:, None] - pos[None, :]).abs().float()}[attn],
        "key_padding_mask": {None: None, "bool": padded, "float": -1.5 * padded.float()}[pad],
    }


#: (attn_mask, key_padding_mask), is_causal, need_weights
_MASK_CALLS = [
    (("bool", None), False, False),
    (("float", None), False, True),
    ((None, "bool"), False, False),
    ((None, "float"), False, True),
    (("bool", "bool"), False, True),
    (("float", "float"), False, False),
    (("bool", None), True, False),  # scaled_dot_product_attention(is_causal=True), the mask ignored
    (("bool", None), True, True),  # the mask used
    (("bool", "bool"), True, False),  # the masks merged, is_causal dropped
]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(("kinds", "is_causal", "need_weights"), _MASK_CALLS)
def test_heads_mha_applies_masks_as_mha_does(kinds, is_causal, need_weights, batch_first):
    mha = _mha(batch_first=batch_first)
    ours = HeadsMultiheadAttention.adopt(mha)
    x = torch.randn(3, 7, 16) if batch_first else torch.randn(7, 3, 16)
    masks = _masks(kinds, 3, 7)
    kwargs = {"need_weights": need_weights, "is_causal": is_causal, "average_attn_weights": False, **masks}
    with torch.no_grad():
        (a, wa), (b, wb) = mha(x, x, x, **kwargs), ours(x, x, x, **kwargs)
    assert "refused_call" not in ours.__dict__  # computed by our forward, not by torch's function
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if need_weights:
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)


class _MaskedBlock(nn.Module):
    def __init__(self, kinds: tuple[str | None, str | None], is_causal: bool, need_weights: bool) -> None:
        super().__init__()
        self.inp, self.mha, self.out = nn.Linear(8, 16), _mha(batch_first=True), nn.Linear(16, 4)
        self.kinds, self.is_causal, self.need_weights = kinds, is_causal, need_weights

    def forward(self, x):
        a = self.inp(x)
        masks = _masks(self.kinds, a.shape[0], a.shape[1])
        masks = {k: None if m is None else m.to(a.device) for k, m in masks.items()}
        kwargs = {"need_weights": self.need_weights, "is_causal": self.is_causal, **masks}
        out, _ = self.mha(a, a, a, average_attn_weights=False, **kwargs)  # a mean over heads would leave them out
        return self.out(out)


@pytest.mark.parametrize(("kinds", "is_causal", "need_weights"), _MASK_CALLS)
def test_mha_called_with_masks_is_cut_and_shrunk_exactly(kinds, is_causal, need_weights):
    """The masked model is torch's own ``nn.MultiheadAttention`` with half its heads zeroed; the shrunk one is ours."""
    torch.manual_seed(0)
    model = _MaskedBlock(kinds, is_causal, need_weights).eval()
    found = discover(model, torch.randn(2, 5, 8))
    [heads] = [c for c in found.clusters if c.name == "mha"]
    assert heads.num_units == 4
    small = exact_shrink(model, found.clusters, torch.randn(3, 7, 8))
    assert isinstance(small.mha, HeadsMultiheadAttention)
    assert small.mha.num_heads == 2


def test_a_shrunk_mha_refuses_a_3d_mask_naming_the_fix():
    mha = _mha(batch_first=True)
    model = _Block(mha).eval()
    found = discover(model, torch.randn(2, 5, 8))
    small = exact_shrink(model, found.clusters, torch.randn(2, 5, 8))
    a = torch.randn(2, 5, 16)
    mask = torch.zeros(2 * small.mha.num_heads, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"HeadsMultiheadAttention: called with a 3-D attn_mask .* pass a 2-D mask"):
        small.mha(a, a, a, attn_mask=mask)


class _Encoder(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3)
        self.causal = causal

    def forward(self, x):
        if not self.causal:
            return self.head(self.enc(x))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)  # float, -inf above
        pos, rows = torch.arange(x.shape[1], device=x.device), torch.arange(x.shape[0], device=x.device)
        padding = pos[None, :] >= x.shape[1] - rows[:, None]  # batch entry b: its last b positions padded
        return self.head(self.enc(x, mask=mask, src_key_padding_mask=padding.float() * -1e4, is_causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_heads_of_a_torch_transformer_encoder_are_cut_exactly(causal):
    """``nn.TransformerEncoderLayer`` calls its ``self_attn`` with or without masks; ours keeps it off the fused
    path (causal: a float causal mask, a float key padding mask and ``is_causal=True``)."""
    torch.manual_seed(0)
    model = _Encoder(causal).eval()
    found = discover(model, torch.randn(2, 5, 16))
    assert sorted(c.name for c in found.clusters if c.num_units == 4) == [
        "enc.layers.0.self_attn",
        "enc.layers.1.self_attn",
    ]
    small = exact_shrink(model, found.clusters, torch.randn(3, 6, 16))
    assert [layer.self_attn.num_heads for layer in small.enc.layers] == [2, 2]


def test_an_export_written_before_heads_moved_out_of_shrink_still_loads(tmp_path):
    """Exports of lightning_pat before the move name ``lightning_pat.shrink.window_attention.WindowAttention``."""
    import json

    from lightning_pat import load_pretrained, save_pretrained

    torch.manual_seed(0)
    model = nn.ModuleDict({"v1": WindowAttention(16, [4, 4], [2, 2], 3, 4)}).eval()
    save_pretrained(model, tmp_path / "old")
    meta_file = tmp_path / "old" / "lightning_pat.json"
    text = meta_file.read_text()
    assert "lightning_pat.heads.window.WindowAttention" in text
    meta_file.write_text(text.replace("lightning_pat.heads.window.", "lightning_pat.shrink.window_attention."))
    assert "lightning_pat.shrink.window_attention.WindowAttention" in json.dumps(json.loads(meta_file.read_text()))
    again = load_pretrained(tmp_path / "old")
    x = torch.randn(2, 8, 8, 16)
    with torch.no_grad():
        assert type(again["v1"]) is WindowAttention
        assert torch.equal(again["v1"](x), model["v1"](x))
    meta_file.write_text(text.replace("lightning_pat.heads.window.", "lightning_pat.shrink.nowhere."))
    with pytest.raises(ValueError, match=r"lightning_pat\.shrink\.nowhere\.WindowAttention"):
        load_pretrained(tmp_path / "old")
