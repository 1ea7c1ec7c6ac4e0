"""blocks="auto" on hierarchical vision models: every repeated residual unit, across stages, in order.

Gradient check: float64, rtol = atol = 1e-10 against the uncheckpointed model (same ops recomputed).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.models import vision


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in mb.find_blocks(model, "auto")]


def test_resnet18_every_basic_block_in_order() -> None:
    expected = [f"layer{stage}.{i}" for stage in range(1, 5) for i in range(2)]
    assert _names(vision.ResNet(vision.BasicBlock, (2, 2, 2, 2))) == expected


def test_resnet50_every_bottleneck_in_order() -> None:
    expected = [f"layer{s + 1}.{i}" for s, n in enumerate((3, 4, 6, 3)) for i in range(n)]
    assert _names(vision.ResNet(vision.Bottleneck, (3, 4, 6, 3))) == expected


def test_convnext_every_block_of_every_stage() -> None:
    # features: 0 stem, 1 stage, 2 downsample, 3 stage, 4 downsample, 5 stage, 6 downsample, 7 stage
    expected = [f"features.{f}.{i}" for f, n in ((1, 2), (3, 2), (5, 6), (7, 2)) for i in range(n)]
    assert _names(vision.ConvNeXt((2, 2, 6, 2))) == expected


def test_efficientnet_every_mbconv_not_the_squeeze_excitation_inside() -> None:
    model = vision.EfficientNet()
    found = mb.find_blocks(model, "auto")
    assert len(found) == 16 and all(isinstance(m, vision.MBConv) for _, m in found)
    assert found[0][0] == "features.1.0" and found[-1][0] == "features.7.0"


def test_deeplab_mobilenet_backbone_units_not_the_aspp_branches() -> None:
    model = vision.DeepLabV3MobileNetV3()
    assert _names(model) == [f"backbone.{i}" for i in range(1, 16)]


class Stage(nn.Module):
    """A timm-style stage class with its own forward around a Sequential of same-shape blocks."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Conv2d(dim, dim, 1)
        self.blocks = nn.Sequential(*(vision.CNBlock(dim) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))  # type: ignore[no-any-return]


def test_a_stage_class_gives_way_to_its_blocks() -> None:
    model = nn.Module()
    model.stages = nn.Sequential(Stage(4, 2), Stage(4, 3), Stage(4, 2))
    assert len(_names(model)) == 7 and _names(model)[0] == "stages.0.blocks.0"


def test_transformer_layer_wins_over_the_attention_inside() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = Attention(), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))

    model = nn.Module()
    model.encoder = nn.ModuleList(Layer() for _ in range(3))
    model.decoder = nn.ModuleList(Layer() for _ in range(2))
    assert _names(model) == ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"]


def test_checkpoint_says_what_auto_picked(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="microbatch"):
        handle = mb.checkpoint(vision.ResNet(), policy="full")
    assert "blocks='auto' picked 8 BasicBlock blocks (layer1.0 .. layer4.1)" in caplog.text
    handle.remove()


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_resnet_gradients_and_running_stats_equal(policy: str) -> None:
    reference = vision.ResNet(width=4).double()
    model = copy.deepcopy(reference)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    reference(x).square().sum().backward()
    handle = mb.checkpoint(model, policy=policy)
    model(x).square().sum().backward()
    tol: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-10}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)
    for b, c in zip(model.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, **tol)  # BatchNorm statistics updated once
    handle.remove()


def test_timm_models_if_installed() -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    assert len(_names(model)) == 8
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    assert len(_names(convnext)) == 2 + 2 + 6 + 2
