"""blocks="auto" on timm's layouts: blocks held as numbered attributes, and a leading block of
another class (local replicas of timm's RegNet and EfficientNet; timm itself in benchmarks/).

Gradient check: float64, rtol = atol = 1e-12 against the uncheckpointed model (the same ops rerun);
BatchNorm buffers bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import microbatch as mb

TOL = {"rtol": 1e-12, "atol": 1e-12}


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class SqueezeExcite(nn.Module):
    """As timm's: fc1 -> ReLU(inplace=True) on the conv's output -> fc2 -> sigmoid gate."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Conv2d(channels, 4, 1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True)))).sigmoid()


class RegBottleneck(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv_bn(cin, cout, 1), conv_bn(cout, cout, 3, stride, groups=2)
        self.se, self.conv3 = SqueezeExcite(cout), conv_bn(cout, cout, 1)
        self.act = nn.ReLU(inplace=True)
        self.downsample = conv_bn(cin, cout, 1, stride) if (cin, stride) != (cout, 1) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv3(self.se(self.act(self.conv2(self.act(self.conv1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.act(out + shortcut)  # type: ignore[no-any-return]


class RegStage(nn.Module):
    """As timm's RegStage: the blocks are attributes b1 .. bN, not a ModuleList."""

    def __init__(self, cin: int, cout: int, depth: int, stride: int) -> None:
        super().__init__()
        for index in range(depth):
            self.add_module(
                f"b{index + 1}", RegBottleneck(cin if index == 0 else cout, cout, stride if index == 0 else 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = block(x)
        return x


class RegNet(nn.Module):
    def __init__(self, depths: tuple[int, ...] = (1, 3, 2)) -> None:
        super().__init__()
        self.stem = conv_bn(3, 4, 3, 2)
        widths = [4 * 2**index for index in range(len(depths) + 1)]
        for index, depth in enumerate(depths):
            self.add_module(f"s{index + 1}", RegStage(widths[index], widths[index + 1], depth, 2))
        self.head = nn.Linear(widths[len(depths)], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for name, module in self.named_children():
            if name.startswith("s") and name[1:].isdigit():
                x = module(x)
        return self.head(x.mean((2, 3)))  # type: ignore[no-any-return]


class DepthwiseSeparable(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dw, self.pw, self.act = (
            conv_bn(channels, channels, 3, groups=channels),
            conv_bn(channels, channels, 1),
            nn.SiLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw(self.act(self.dw(x)))  # type: ignore[no-any-return]


class Inverted(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.expand, self.dw = conv_bn(cin, 2 * cin, 1), conv_bn(2 * cin, 2 * cin, 3, stride, groups=2 * cin)
        self.project, self.act = conv_bn(2 * cin, cout, 1), nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.act(self.dw(self.act(self.expand(x)))))  # type: ignore[no-any-return]


class TimmEfficientNet(nn.Module):
    """As timm's: blocks = stages of blocks; stage 0 holds one depthwise separable block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_stem = conv_bn(3, 4, 3, 2)
        self.blocks = nn.Sequential(
            nn.Sequential(DepthwiseSeparable(4)),
            nn.Sequential(Inverted(4, 8, 2), Inverted(8, 8, 1)),
            nn.Sequential(Inverted(8, 12, 2), Inverted(12, 12, 1)),
        )
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.conv_stem(x)).mean((2, 3)))  # type: ignore[no-any-return]


def names(model: nn.Module) -> list[str]:
    return [name for name, _ in mb.find_blocks(model, "auto")]


def test_blocks_held_as_numbered_attributes_are_the_units_not_their_stages() -> None:
    assert names(RegNet()) == ["s1.b1", "s2.b1", "s2.b2", "s2.b3", "s3.b1", "s3.b2"]


def test_the_leading_block_of_another_class_is_included() -> None:
    assert names(TimmEfficientNet()) == ["blocks.0.0", "blocks.1.0", "blocks.1.1", "blocks.2.0", "blocks.2.1"]


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("build", [RegNet, TimmEfficientNet], ids=lambda b: b.__name__)
def test_checkpointed_replicas_match_the_plain_model(build: type[nn.Module], policy: str) -> None:
    torch.manual_seed(0)
    reference = build().double()
    model = copy.deepcopy(reference)
    handle = mb.checkpoint(model, blocks="auto", policy=policy)
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    for _ in range(2):
        grads = []
        for net in (model, reference):
            inputs = x.clone().requires_grad_(True)
            out = net(inputs)
            out.square().sum().backward()
            grads.append((out.detach(), inputs.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0], **TOL)
        torch.testing.assert_close(grads[0][1], grads[1][1], **TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for b, c in zip(model.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=0.0, atol=0.0)
    handle.remove()
