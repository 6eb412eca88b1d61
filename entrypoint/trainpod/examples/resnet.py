"""ResNet-50 (and ResNet-18, -34, -101), defined here because torchvision is not a dependency of trainpod.

    model = resnet50(num_classes=1000)                                  # BatchNorm, as torchvision
    model = resnet50(norm_layer=lambda c: nn.GroupNorm(32, c))          # any norm taking the channel count
    model = ARCHS["resnet18"](num_classes=10)                           # by torchvision's name (--arch)
    model = resnet18(num_classes=10, width=8)                           # 1/8 of the channels (--width)

The architecture is torchvision's ResNet-50 ("v1.5", He et al. 2015 with the stride of each
stage's first block on its 3x3 convolution rather than its first 1x1): a 7x7/2 stem convolution,
a 3x3/2 max pool, four stages of 3, 4, 6 and 3 bottleneck blocks (widths 64, 128, 256, 512,
output 4x the width; the first block of a stage projects its shortcut with a strided 1x1
convolution and a norm), global average pooling (adaptive, so any input of at least 32x32 works)
and a linear classifier. 25,557,032 parameters for 1000 classes. ResNet-101 has 3, 4, 23 and 3
blocks. ResNet-18 and -34 are built alike from basic blocks (two 3x3 convolutions, output the
width; 2, 2, 2, 2 and 3, 4, 6, 3 of them): 11,689,512 and 21,797,672 parameters. The smaller ones
train the same job at a fraction of the cost, which is what quick runs and tests want.

`width` is the first stage's width (torchvision's 64; the stem has as many channels, and each later stage
doubles it). A narrower net has the same layers, names and code paths with about (width/64)^2 of the
parameters: width 8 makes ResNet-18 about 180,000 parameters (4 classes), small enough that a CPU test's
steps, gradient reductions and checkpoints cost little. Only width 64 is torchvision's (and loads its
weights).

The parameter and buffer names (conv1, bn1, layer1.0.conv1, ..., layer1.0.downsample.0, fc) and
their order are torchvision's, so a state_dict loads into torchvision's resnet50() and back
(strict), and published ImageNet weights load into this one; the same holds for each depth.

Initialisation is torchvision's too: convolutions kaiming_normal_ (fan_out, relu), norm weights 1
and biases 0, the classifier PyTorch's default for nn.Linear. zero_init_residual=True zeroes the
weight of each block's last norm (bn3 of a bottleneck, bn2 of a basic block), so every block starts
as the identity (Goyal et al. 2017, for large-batch training), as torchvision's flag of that name does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["ARCHS", "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50", "resnet101"]

NormLayer = Callable[[int], nn.Module]  # channels -> a norm module over them

STAGE_WIDTHS = (64, 128, 256, 512)  # at torchvision's width, 64: each stage doubles the first's
WIDTH = STAGE_WIDTHS[0]
RESNET50_BLOCKS = (3, 4, 6, 3)
# Norm modules whose affine parameters start at weight 1, bias 0 (torchvision's list plus SyncBatchNorm,
# which a DDP job may pass as norm_layer).
_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm)


class BasicBlock(nn.Module):
    """3x3 (strided), 3x3, each followed by a norm, output the width; plus the shortcut (ResNet-18, -34)."""

    expansion = 1

    def __init__(
        self,
        in_channels: int,
        width: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        norm_layer: NormLayer = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, padding=1, bias=False)
        self.bn2 = norm_layer(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        y += shortcut
        return self.relu(y)

    def last_norm(self) -> nn.Module:
        return self.bn2


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand to 4x the width, each followed by a norm; plus the shortcut."""

    expansion = 4

    def __init__(
        self,
        in_channels: int,
        width: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        norm_layer: NormLayer = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        out_channels = width * self.expansion
        # No conv biases: every convolution is followed by a norm that has its own.
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = norm_layer(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = norm_layer(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        y += shortcut  # in place, as torchvision: the norm's backward does not need its output
        return self.relu(y)

    def last_norm(self) -> nn.Module:
        return self.bn3


Block = type[BasicBlock] | type[Bottleneck]


class ResNet(nn.Module):
    """A ResNet of `block`s; `blocks` is the number of blocks per stage ((3, 4, 6, 3) of bottlenecks for ResNet-50)."""

    def __init__(
        self,
        blocks: Sequence[int] = RESNET50_BLOCKS,
        num_classes: int = 1000,
        norm_layer: NormLayer = nn.BatchNorm2d,
        zero_init_residual: bool = False,
        block: Block = Bottleneck,
        width: int = WIDTH,
    ) -> None:
        super().__init__()
        if len(blocks) != len(STAGE_WIDTHS):
            raise ValueError(f"ResNet: expected {len(STAGE_WIDTHS)} stages of blocks, got {list(blocks)}")
        if width < 1:
            raise ValueError(f"ResNet: expected a width of at least 1, got {width}")
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        channels = width
        stage_widths = (stage * width // WIDTH for stage in STAGE_WIDTHS)
        for number, (count, stage_width) in enumerate(zip(blocks, stage_widths), start=1):
            stride = 1 if number == 1 else 2  # the stem already quartered the resolution before stage 1
            stage, channels = _stage(block, channels, stage_width, count, stride, norm_layer)
            setattr(self, f"layer{number}", stage)  # layer1..layer4: torchvision's names
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)
        self._initialize(zero_init_residual)

    def _initialize(self, zero_init_residual: bool) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, _NORMS) and module.weight is not None:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, (BasicBlock, Bottleneck)) and getattr(module.last_norm(), "weight", None) is not None:
                    nn.init.zeros_(module.last_norm().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _stage(block: Block, in_channels: int, width: int, count: int, stride: int,
           norm_layer: NormLayer) -> tuple[nn.Sequential, int]:
    """`count` blocks; the first strides and, where the shape changes, projects its shortcut."""
    out_channels = width * block.expansion
    downsample = None
    if stride != 1 or in_channels != out_channels:
        downsample = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
            norm_layer(out_channels),
        )
    blocks = [block(in_channels, width, stride, downsample, norm_layer)]
    blocks += [block(out_channels, width, norm_layer=norm_layer) for _ in range(count - 1)]
    return nn.Sequential(*blocks), out_channels


def resnet50(num_classes: int = 1000, norm_layer: NormLayer = nn.BatchNorm2d, zero_init_residual: bool = False,
             width: int = WIDTH) -> ResNet:
    """ResNet-50 v1.5 with torchvision's names and initialisation; see the module docstring."""
    return ResNet(RESNET50_BLOCKS, num_classes=num_classes, norm_layer=norm_layer, zero_init_residual=zero_init_residual,
                  width=width)


def resnet18(num_classes: int = 1000, norm_layer: NormLayer = nn.BatchNorm2d, zero_init_residual: bool = False,
             width: int = WIDTH) -> ResNet:
    """ResNet-18: basic blocks, (2, 2, 2, 2)."""
    return ResNet((2, 2, 2, 2), num_classes, norm_layer, zero_init_residual, BasicBlock, width)


def resnet34(num_classes: int = 1000, norm_layer: NormLayer = nn.BatchNorm2d, zero_init_residual: bool = False,
             width: int = WIDTH) -> ResNet:
    """ResNet-34: basic blocks, (3, 4, 6, 3)."""
    return ResNet((3, 4, 6, 3), num_classes, norm_layer, zero_init_residual, BasicBlock, width)


def resnet101(num_classes: int = 1000, norm_layer: NormLayer = nn.BatchNorm2d, zero_init_residual: bool = False,
             width: int = WIDTH) -> ResNet:
    """ResNet-101 v1.5: bottlenecks, (3, 4, 23, 3)."""
    return ResNet((3, 4, 23, 3), num_classes, norm_layer, zero_init_residual, Bottleneck, width)


# torchvision's names: what --arch takes (trainpod.examples.imagenet)
ARCHS: dict[str, Callable[..., ResNet]] = {"resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50,
                                           "resnet101": resnet101}
