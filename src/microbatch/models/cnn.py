"""A small CNN with BatchNorm, and 8x8 digit images to feed it.

BatchNorm is the classic case where accumulation is *not* exactly the full-batch step: its
statistics are per micro-batch. The model exists so tests and the planner can show that.

Images: scikit-learn's bundled ``load_digits`` (1797 8x8 images, 10 classes, shipped inside the
package, nothing downloaded) when scikit-learn is installed; otherwise generated images: a fixed
random template per class plus noise.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError

logger = logging.getLogger(__name__)

NUM_CLASSES = 10
IMAGE_SIZE = 8


class ConvBlock(nn.Module):
    """conv 3x3 -> BatchNorm -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """(batch, 1, 8, 8) images -> (batch, 10) logits; BatchNorm after every convolution."""

    def __init__(self, *, channels: tuple[int, ...] = (16, 32, 32), num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        if not channels:
            raise ConfigError("SmallCNN needs at least one entry in channels")
        widths = (1, *channels)
        self.blocks = nn.ModuleList(ConvBlock(widths[i], widths[i + 1]) for i in range(len(channels)))
        self.head = nn.Linear(channels[-1] * (IMAGE_SIZE // 2) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = F.max_pool2d(x, 2)
        return self.head(x.flatten(1))  # type: ignore[no-any-return]


def _generated_digits(num_images: int = 1800, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    templates = torch.rand(NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.arange(num_images) % NUM_CLASSES
    noise = 0.3 * torch.randn(num_images, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return (templates[labels] + noise).clamp(0, 1), labels


def load_digits_tensors(*, use_sklearn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (n, 1, 8, 8) in [0, 1] as float32 and labels (n,) as int64."""
    images: torch.Tensor | None = None
    if use_sklearn:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            logger.info("scikit-learn is not installed; using generated 8x8 digit images")
        else:
            digits = load_digits()
            images = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # pixel values 0..16
            labels = torch.tensor(digits.target, dtype=torch.int64)
    if images is None:
        images, labels = _generated_digits()
    return images.unsqueeze(1).float(), labels


class DigitBatches:
    """``batches(b)``: b (image, label) pairs drawn with replacement from a seeded generator."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, seed: int = 0) -> None:
        if images.shape[0] != labels.shape[0] or images.shape[0] == 0:
            raise ConfigError("images and labels must be non-empty with the same first dimension")
        self.images, self.labels = images, labels
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        index = torch.randint(0, self.images.shape[0], (batch_size,), generator=self.generator)
        return self.images[index], self.labels[index]
