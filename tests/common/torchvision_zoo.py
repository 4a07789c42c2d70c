"""torchvision's classification models for the zoo tests and ``bench/bench_zoo.py`` (random init, no download).

The package index's torchvision wheels are CUDA builds: next to our CPU torch, ``import torchvision`` fails with
"operator torchvision::nms does not exist" (it registers fake kernels for detection ops whose C++ library did not
load). :func:`import_torchvision` declares the two schemas first (classification models never call them), so the
Python parts import. This is a test and benchmark helper only, never library code. ``make setup`` installs
``torchvision==0.29.1`` with ``--no-deps`` (with its dependencies it would replace torch) into its own folder,
``.venv/torchvision`` (``LPAT_TORCHVISION_DIR``), not into site-packages: there, every process that imports
``torchmetrics`` or ``transformers`` (which import torchvision when they find it) would fail the same way. Only a
process that calls :func:`import_torchvision` sees it.

:func:`build` makes a model with small inputs in mind (``num_classes=10``; a ViT's ``image_size`` set to the
input) and randomises what a fresh init leaves at a constant (norm weights and biases, running statistics, layer
scales, class tokens, Swin V2's logit scales) so that a shrink that is not exact shows in the outputs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

#: Input side per model family (the first matching prefix wins); the rest take ``DEFAULT_SIZE``.
SIZES: dict[str, int] = {"maxvit": 224, "inception": 80, "vit_h": 28, "vit": 32, "swin": 64}
DEFAULT_SIZE = 64
#: The CI subset: a residual CNN, a depthwise/SE net, a ViT, a Swin V1 and V2, a ShuffleNet, a MaxViT (their cheapest
#: members; maxvit_t is the slowest, about 17 s on one thread).
CI_SUBSET = ("resnet18", "mobilenet_v3_small", "vit_b_32", "swin_t", "swin_v2_t", "shufflenet_v2_x0_5", "maxvit_t")
#: Where ``make setup`` puts torchvision (``pip install --no-deps --target``).
TORCHVISION_DIR = Path(
    os.environ.get("LPAT_TORCHVISION_DIR", Path(__file__).resolve().parents[2] / ".venv" / "torchvision")
)


def import_torchvision() -> ModuleType:
    """``torchvision``, imported after declaring ``torchvision::nms`` and ``torchvision::qnms`` (see the module doc).

    Raises:
        ImportError: If torchvision is not installed (``make setup`` installs it).
    """
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already declared (a second call, or a working build)
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    # On sys.path only for this import: spawned workers (multiprocessing) inherit the parent's sys.path, and a
    # worker that imports torchmetrics would then find this torchvision and fail before our declarations run.
    # Submodules imported later resolve through ``torchvision.__path__``, so the package keeps working.
    added = TORCHVISION_DIR.is_dir() and str(TORCHVISION_DIR) not in sys.path
    if added:
        sys.path.append(str(TORCHVISION_DIR))
    try:
        import torchvision
        import torchvision.models  # noqa: F401  (eagerly, while the folder is on the path)
    except ImportError as err:
        raise ImportError(
            f"torchvision is not importable from {TORCHVISION_DIR} ({err}); `make setup` installs it there, or set "
            "LPAT_TORCHVISION_DIR to a folder holding it (e.g. a worktree: /path/to/main/.venv/torchvision)"
        ) from err
    finally:
        if added:
            sys.path.remove(str(TORCHVISION_DIR))
    return torchvision


def names() -> list[str]:
    """Every classification model of ``torchvision.models``."""
    tv = import_torchvision()
    return list(tv.models.list_models(module=tv.models))


def image_size(name: str) -> int:
    """The input side used for ``name``."""
    return next((s for prefix, s in SIZES.items() if name.startswith(prefix)), DEFAULT_SIZE)


def _kwargs(name: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"weights": None, "num_classes": 10}
    if name.startswith("vit"):
        kwargs["image_size"] = image_size(name)
    if name in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True
    return kwargs


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Draw norm weights near 1, biases and running means near 0, variances in [0.5, 1.5), layer scales, class
    tokens, Swin V2's logit scales and zero-initialised weights (ViT's head) at random, so that an inexact shrink
    changes the outputs visibly."""
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=gen))

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)):  # noqa: SLF001
                if getattr(m, "weight", None) is not None:
                    draw(m.weight, 1.0, 0.1)
                if getattr(m, "bias", None) is not None:
                    draw(m.bias, 0.0, 0.1)
                if getattr(m, "running_mean", None) is not None:
                    draw(m.running_mean, 0.0, 0.1)
                    m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() >= 2 and not bool(p.any()):  # a zero-initialised head (ViT's) would make every logit 0
                draw(p, 0.0, p[0].numel() ** -0.5)
            if leaf == "layer_scale":
                draw(p, 0.5, 0.2)
            elif leaf in ("class_token", "cls_token"):
                draw(p, 0.0, 0.5)
            elif leaf == "logit_scale":
                draw(p, 2.3, 0.1)
    return model


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh torchvision model ``name`` (eval mode, 10 classes, randomised norms: see :func:`randomize`)."""
    tv = import_torchvision()
    torch.manual_seed(seed)
    model = tv.models.get_model(name, **_kwargs(name))
    return randomize(model, seed).eval()


def images(name: str, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Random ``[batch, 3, S, S]`` images of the side :func:`image_size` gives ``name``."""
    side = image_size(name)
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed))
