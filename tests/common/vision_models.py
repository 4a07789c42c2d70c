"""Tiny vision models from transformers (random init from small configs, no download) for discovery tests and
bench/bench_discover.py. ``transformers`` is imported lazily."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

IMAGE = 32


def _resnet() -> nn.Module:
    import transformers as T

    cfg = T.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], layer_type="bottleneck", num_labels=10
    )
    return T.ResNetForImageClassification(cfg)


def _convnext() -> nn.Module:
    import transformers as T

    return T.ConvNextForImageClassification(T.ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1]))


def _mobilenet_v2() -> nn.Module:
    import transformers as T

    return T.MobileNetV2ForImageClassification(T.MobileNetV2Config(depth_multiplier=0.35, image_size=IMAGE))


def _vit() -> nn.Module:
    import transformers as T

    cfg = T.ViTConfig(
        image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    return T.ViTForImageClassification(cfg)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet": _resnet,
    "convnext": _convnext,
    "mobilenet_v2": _mobilenet_v2,
    "vit": _vit,
}


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh model with healthy norms (random affine weights and running statistics near 1 and 0): freshly
    initialised deep nets with default norm statistics can shrink their logits to ~1e-27."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
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


def images(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))
