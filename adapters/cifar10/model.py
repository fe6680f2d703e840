"""ResNet-18 for 32x32 CIFAR images, and a narrower twin for quick CPU demos and tests.

The full model is torchvision's ``resnet18(num_classes=10)`` with the usual CIFAR stem (conv1 3x3
stride 1, no max-pool). Training, data and checkpointing do not belong here.
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock, ResNet

__all__ = ["build_model"]


def _cifar_stem(model: ResNet, width: int) -> ResNet:
    # 32x32 inputs: a 7x7 stride-2 conv plus max-pool would leave 8x8 maps before layer1 and cost
    # several accuracy points, hence the 3x3 stride-1 stem every CIFAR ResNet uses.
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    # AdaptiveAvgPool2d has no deterministic CUDA backward (it raises under
    # torch.use_deterministic_algorithms); a plain mean over H, W is the same function and is.
    model.avgpool = _GlobalAvgPool()
    return model


class _GlobalAvgPool(nn.Module):
    """Mean over the spatial dimensions: ``AdaptiveAvgPool2d(1)`` with a deterministic backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3), keepdim=True)


class _NarrowResNet18(ResNet):
    """torchvision's ResNet-18 layout with every channel count scaled by ``width / 64``.

    Same blocks, same parameter names and the same initialisation as ``resnet18``; only the
    widths differ, so a CPU test exercises the exact code path of the full job in seconds.
    """

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        widths = [width, 2 * width, 4 * width, 8 * width]
        self.inplanes = width
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(BasicBlock, widths[0], 2)
        self.layer2 = self._make_layer(BasicBlock, widths[1], 2, stride=2)
        self.layer3 = self._make_layer(BasicBlock, widths[2], 2, stride=2)
        self.layer4 = self._make_layer(BasicBlock, widths[3], 2, stride=2)
        self.fc = nn.Linear(widths[3], num_classes)
        # ResNet.__init__ initialised its own 64-wide layers; redo it for the replacements.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


def build_model(*, width: int = 64, num_classes: int = 10) -> nn.Module:
    """Build the CIFAR ResNet-18.

    Args:
        width: channels of the first stage (64 = torchvision's ResNet-18, 11.2 M parameters;
            smaller values give the same architecture, narrower, for CPU demos).
        num_classes: size of the classifier output.

    Returns:
        The model on the CPU, initialised from the global torch RNG (seed it first).

    Example:
        >>> torch.manual_seed(0)
        >>> model = build_model()
        >>> model(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if width <= 0:
        raise ValueError(f"width must be a positive number of channels, got {width}")
    if width == 64:
        model: ResNet = resnet18(num_classes=num_classes)
    else:
        model = _NarrowResNet18(width, num_classes)
    stem: nn.Module = _cifar_stem(model, width)
    return stem
