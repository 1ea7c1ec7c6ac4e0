"""Small vision models laid out as torchvision lays out ResNet, ConvNeXt, EfficientNet and DeepLabV3.

Module classes, nesting and names follow torchvision (``layer1.0``, ``features.1.0``,
``backbone.3``, ``classifier.0.convs``), widths are small: the models exist so that
``blocks="auto"``, the planner and the segmentation benchmark can be tried without torchvision,
whose wheels must match the installed torch exactly.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F


class ConvNormActivation(nn.Sequential):
    """conv -> BatchNorm -> activation, a Sequential as torchvision's Conv2dNormActivation."""

    def __init__(
        self,
        cin: int,
        cout: int,
        k: int = 3,
        stride: int = 1,
        groups: int = 1,
        dilation: int = 1,
        activation: type[nn.Module] | None = nn.ReLU,
    ) -> None:
        padding = (k - 1) // 2 * dilation
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, k, stride, padding, dilation=dilation, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.downsample = _shortcut(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ResNet-18 (BasicBlock, (2, 2, 2, 2)) or ResNet-50 (Bottleneck, (3, 4, 6, 3)) at ``width``."""

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck] = BasicBlock,
        layers: tuple[int, ...] = (2, 2, 2, 2),
        *,
        width: int = 8,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width)
        cin = width
        for index, count in enumerate(layers):
            planes, stride = width * 2**index, 1 if index == 0 else 2
            blocks = []
            for i in range(count):
                blocks.append(block(cin, planes, stride if i == 0 else 1))
                cin = planes * block.expansion
            setattr(self, f"layer{index + 1}", nn.Sequential(*blocks))
        self.num_layers = len(layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for index in range(self.num_layers):
            x = getattr(self, f"layer{index + 1}")(x)
        return self.fc(x.mean((2, 3)))  # type: ignore[no-any-return]


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7, LayerNorm, MLP x4, layer scale, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim)
        self.block = nn.Sequential(nn.Conv2d(dim, 4 * dim, 1), nn.GELU(), nn.Conv2d(4 * dim, dim, 1))
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer_scale * self.block(self.norm(self.dwconv(x)))  # type: ignore[no-any-return]


class ConvNeXt(nn.Module):
    """features = [stem, stage, downsample, stage, ...] as torchvision's ConvNeXt (atto: (2, 2, 6, 2))."""

    def __init__(
        self, depths: tuple[int, ...] = (2, 2, 6, 2), *, width: int = 8, num_classes: int = 10
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, width, 4, 4), LayerNorm2d(width))]
        for index, depth in enumerate(depths):
            dim = width * 2**index
            layers.append(nn.Sequential(*(CNBlock(dim) for _ in range(depth))))
            if index + 1 < len(depths):
                layers.append(nn.Sequential(LayerNorm2d(dim), nn.Conv2d(dim, 2 * dim, 2, 2)))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width * 2 ** (len(depths) - 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))  # type: ignore[no-any-return]


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet (MBConv) unit: expand 1x1, depthwise, squeeze-excite, project."""

    def __init__(self, cin: int, cout: int, *, expand: int = 4, stride: int = 1, dilation: int = 1) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        self.block = nn.Sequential(
            ConvNormActivation(cin, hidden, 1, activation=nn.Hardswish),
            ConvNormActivation(
                hidden, hidden, 3, stride, groups=hidden, dilation=dilation, activation=nn.Hardswish
            ),
            SqueezeExcitation(hidden, max(8, hidden // 4)),
            ConvNormActivation(hidden, cout, 1, activation=None),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x)
        return x + out if self.use_residual else out


MBConv = InvertedResidual  # EfficientNet's name for the same unit


def _inverted_stages(stages: tuple[tuple[int, int, int], ...], width: int) -> list[nn.Module]:
    """(repeats, channels, stride) per stage -> a list of stages of InvertedResidual units."""
    cin, out = width, list[nn.Module]()
    for repeats, channels, stride in stages:
        units = [
            InvertedResidual(cin if i == 0 else channels, channels, stride=stride if i == 0 else 1)
            for i in range(repeats)
        ]
        out.append(nn.Sequential(*units))
        cin = channels
    return out


class EfficientNet(nn.Module):
    """features = [stem, stage of MBConv, ..., head conv] as torchvision's EfficientNet-B0 (narrow)."""

    STAGES = ((1, 8, 1), (2, 12, 2), (2, 16, 2), (3, 24, 2), (3, 32, 1), (4, 40, 2), (1, 48, 1))

    def __init__(self, *, width: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        stages = _inverted_stages(self.STAGES, width)
        last = self.STAGES[-1][1]
        self.features = nn.Sequential(
            ConvNormActivation(3, width, 3, 2), *stages, ConvNormActivation(last, 4 * last, 1)
        )
        self.classifier = nn.Linear(4 * last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))  # type: ignore[no-any-return]


class ASPPConv(nn.Sequential):
    def __init__(self, cin: int, cout: int, dilation: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )


class ASPPPooling(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(super().forward(x), size=x.shape[-2:], mode="bilinear", align_corners=False)


class ASPP(nn.Module):
    def __init__(self, cin: int, rates: tuple[int, ...] = (12, 24, 36), cout: int = 32) -> None:
        super().__init__()
        branches: list[nn.Module] = [ConvNormActivation(cin, cout, 1)]
        branches += [ASPPConv(cin, cout, rate) for rate in rates]
        branches.append(ASPPPooling(cin, cout))
        self.convs = nn.ModuleList(branches)
        self.project = ConvNormActivation(len(branches) * cout, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.cat([branch(x) for branch in self.convs], dim=1))  # type: ignore[no-any-return]


class DeepLabHead(nn.Sequential):
    def __init__(self, cin: int, num_classes: int, *, channels: int = 32) -> None:
        super().__init__(
            ASPP(cin, cout=channels),
            ConvNormActivation(channels, channels, 3),
            nn.Conv2d(channels, num_classes, 1),
        )


class DeepLabV3MobileNetV3(nn.Module):
    """Segmentation: a MobileNetV3-style backbone (15 inverted residuals, dilated last stages, output
    stride 8 as torchvision's ``deeplabv3_mobilenet_v3_large``), an ASPP head, logits upsampled to the
    input. The backbone is a ModuleDict-like ``backbone`` whose children are named 0 .. 16."""

    STAGES = ((1, 8, 1), (2, 12, 2), (3, 16, 2), (4, 24, 1), (2, 32, 1), (3, 40, 1))

    def __init__(self, *, width: int = 8, num_classes: int = 6) -> None:
        super().__init__()
        units: list[nn.Module] = [ConvNormActivation(3, width, 3, 2, activation=nn.Hardswish)]
        for stage in _inverted_stages(self.STAGES, width):
            units.extend(stage.children())
        last = self.STAGES[-1][1]
        units.append(ConvNormActivation(last, 4 * last, 1, activation=nn.Hardswish))
        self.backbone = nn.ModuleDict(OrderedDict((str(i), unit) for i, unit in enumerate(units)))
        self.classifier = DeepLabHead(4 * last, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = x
        for unit in self.backbone.values():
            features = unit(features)
        logits = self.classifier(features)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
