"""Vision models from transformers (random init from small configs, no download) for the discovery tests (tiny) and
bench/bench_discover.py (``wide``: large enough that a forward takes tens of milliseconds on a CPU).
``transformers`` is imported lazily."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

IMAGE = 32  # the tests' image size; the wide models take ``WIDE_IMAGE``
WIDE_IMAGE = 64


def _resnet(wide: bool) -> nn.Module:
    import transformers as T

    sizes = [64, 128, 256, 512] if wide else [16, 32, 48, 64]
    cfg = T.ResNetConfig(
        embedding_size=32 if wide else 16, hidden_sizes=sizes, depths=[1, 1, 1, 1], layer_type="bottleneck"
    )
    return T.ResNetForImageClassification(cfg)


def _convnext(wide: bool) -> nn.Module:
    import transformers as T

    sizes = [48, 96, 192, 384] if wide else [16, 32, 48, 64]
    return T.ConvNextForImageClassification(T.ConvNextConfig(hidden_sizes=sizes, depths=[1, 1, 1, 1]))


def _mobilenet_v2(wide: bool) -> nn.Module:
    import transformers as T

    cfg = T.MobileNetV2Config(depth_multiplier=1.0 if wide else 0.35, image_size=WIDE_IMAGE if wide else IMAGE)
    return T.MobileNetV2ForImageClassification(cfg)


def _vit(wide: bool) -> nn.Module:
    import transformers as T

    if wide:
        cfg = T.ViTConfig(
            image_size=WIDE_IMAGE, patch_size=8, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
            intermediate_size=768,
        )  # fmt: skip
    else:
        cfg = T.ViTConfig(
            image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64,
        )  # fmt: skip
    return T.ViTForImageClassification(cfg)


BUILDERS: dict[str, Callable[[bool], nn.Module]] = {
    "resnet": _resnet,
    "convnext": _convnext,
    "mobilenet_v2": _mobilenet_v2,
    "vit": _vit,
}


def build(name: str, seed: int = 0, *, wide: bool = False) -> nn.Module:
    """A fresh model (eval mode) with healthy norms.

    Norm weights and running statistics are drawn near 1 and 0: freshly initialised deep nets with default norm
    statistics can shrink their logits to ~1e-27, which would make an exactness check vacuous.
    """
    torch.manual_seed(seed)
    model = BUILDERS[name](wide)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and m.weight is not None:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return model.eval()


def images(batch: int, seed: int = 0, *, size: int = IMAGE) -> torch.Tensor:
    """Random ``[batch, 3, size, size]`` images."""
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
