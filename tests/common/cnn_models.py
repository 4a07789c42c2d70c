"""Small hand-built convolutional models for the discovery and conv-shrink tests (float32, CPU)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ConvChain(nn.Module):
    """conv-bn-relu x2, pooling, flatten -> Linear (the Linear reads H*W columns per channel)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12)
        self.fc = nn.Linear(12 * 2 * 2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = F.max_pool2d(F.relu(self.b2(self.c2(y))), 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 2), 1))


class ResBlockNet(nn.Module):
    """A stem and two residual blocks (identity shortcut, then a 1x1 projection shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bs = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.a1, self.ab1 = nn.Conv2d(8, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.a2, self.ab2 = nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.p1, self.pb1 = nn.Conv2d(8, 10, 3, padding=1, bias=False), nn.BatchNorm2d(10)
        self.p2, self.pb2 = nn.Conv2d(10, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.proj, self.projb = nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bs(self.stem(x)))
        y = F.relu(y + self.ab2(self.a2(F.relu(self.ab1(self.a1(y))))))
        y = F.relu(self.projb(self.proj(y)) + self.pb2(self.p2(F.relu(self.pb1(self.p1(y))))))
        return self.head(y.mean(dim=(2, 3)))


class DepthwiseNet(nn.Module):
    """MobileNet-style: expand (1x1), depthwise with channel multiplier 2, squeeze-excite, project, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bs = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.exp, self.be = nn.Conv2d(6, 12, 1), nn.BatchNorm2d(12)
        self.dw, self.bd = nn.Conv2d(12, 24, 3, padding=1, groups=12), nn.BatchNorm2d(24)
        self.se1, self.se2 = nn.Conv2d(24, 4, 1), nn.Conv2d(4, 24, 1)
        self.proj, self.bp = nn.Conv2d(24, 6, 1), nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bs(self.stem(x)))
        z = F.relu6(self.bd(self.dw(F.relu6(self.be(self.exp(y))))))
        z = z * torch.sigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(z, 1)))))
        y = y + self.bp(self.proj(z))
        return self.head(F.adaptive_avg_pool2d(y, 1).flatten(1))


class ConcatNet(nn.Module):
    """Two branches concatenated on the channel axis, then a GroupNorm-free 1x1 conv and a flatten -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 6, 1)
        self.mix = nn.Conv2d(10, 5, 1)
        self.fc = nn.Linear(5 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([F.gelu(self.left(x)), F.silu(self.right(x))], dim=1)
        return self.fc(F.relu(self.mix(y)).flatten(1))


class MLP(nn.Module):
    """A plain MLP with dropout (no preset family in a custom module)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hid, self.out = nn.Linear(7, 16), nn.Linear(16, 12), nn.Linear(12, 3)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.gelu(self.hid(F.relu(self.inp(x))))))


class GroupedNet(nn.Module):
    """A grouped (not depthwise) convolution between two 1x1 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.g, self.c2 = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.g(self.c1(x)))


class ResNeXtNet(nn.Module):
    """A stem and a ResNeXt bottleneck: 1x1 reduce, 3x3 grouped (4 groups, 2 -> 3 channels each), 1x1 expand,
    identity shortcut; pooled into a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bs = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c1, self.b1 = nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.g, self.bg = nn.Conv2d(8, 12, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(12)
        self.c3, self.b3 = nn.Conv2d(12, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu(self.bs(self.stem(x)))
        y = F.relu(self.b1(self.c1(s)))
        y = F.relu(self.bg(self.g(y)))
        y = F.relu(s + self.b3(self.c3(y)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


class UpNet(nn.Module):
    """A decoder: a strided conv, a transposed conv (dense) and a grouped transposed conv (2 groups, 3 -> 4 channels
    each) upsampling back, a 1x1 conv to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8)
        self.t1 = nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1)
        self.t2 = nn.ConvTranspose2d(6, 8, 3, padding=1, groups=2)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.t2(F.relu(self.t1(y))))
        return self.out(y)


class DataDependent(nn.Module):
    """A forward with data-dependent control flow: ``torch.export`` cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow
            h = h * 2
        return self.b(h)


def masked_vs_shrunk(
    model: nn.Module, clusters: list, x: torch.Tensor, sparsity: float = 0.5
) -> tuple[object, nn.Module, torch.Tensor, torch.Tensor]:
    """Prune ``model`` once, then ``(result, shrunk copy, masked output, shrunk output)`` in eval mode."""
    from lightning_pat import prune_clusters, shrink

    result = prune_clusters(model, clusters, sparsity)
    model.eval()
    with torch.no_grad():
        masked = model(x)
        small = shrink(model, result, inplace=False).eval()
        shrunk = small(x)
    return result, small, masked, shrunk


def exact_shrink(model: nn.Module, clusters: list, x: torch.Tensor) -> nn.Module:
    """Prune ``model`` by half, shrink a copy, check it computes the masked outputs (rel < 1e-5, a real signal) with
    fewer parameters, and return it."""
    before = sum(p.numel() for p in model.parameters())
    _, small, masked, shrunk = masked_vs_shrunk(model, clusters, x)
    assert float(masked.norm()) > 1e-3
    assert float((shrunk - masked).norm() / masked.norm()) < 1e-5
    assert sum(p.numel() for p in small.parameters()) < before
    return small


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BN/GN affine weights and running statistics, so that a wrong slice shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
    return model


INPUTS = {
    ResNeXtNet: (2, 3, 8, 8),
    UpNet: (2, 3, 8, 8),
    ConvChain: (2, 3, 8, 8),
    ResBlockNet: (2, 3, 8, 8),
    DepthwiseNet: (2, 3, 8, 8),
    ConcatNet: (2, 3, 4, 4),
    MLP: (4, 7),
}
