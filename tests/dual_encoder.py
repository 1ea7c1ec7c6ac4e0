"""A CLIP-style dual encoder and its InfoNCE loss with a learned temperature, shared by the tests.

The loss is symmetric InfoNCE (Radford et al. 2021): logits = exp(t) * norm(image) @ norm(text)^T,
loss = (CE(logits, diag) + CE(logits^T, diag)) / 2, a mean over the B samples in which each sample
is compared with all B - 1 others, so it is not a sum over micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

IMAGE_FEATURES = 12
TEXT_FEATURES = 10


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(x)))


class Tower(nn.Module):
    def __init__(self, features: int, width: int, dim: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class DualEncoder(nn.Module):
    def __init__(self, width: int = 16, dim: int = 8, depth: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.image = Tower(IMAGE_FEATURES, width, dim, depth, dropout)
        self.text = Tower(TEXT_FEATURES, width, dim, depth, dropout)

    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(batch["image"]), self.text(batch["text"])

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(batch)


class InfoNCE(nn.Module):
    """Symmetric InfoNCE over the whole batch; log_scale is the learned (inverse) temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, representations: Any) -> torch.Tensor:
        image, text = representations
        logits = self.log_scale.exp() * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def make_batch(size: int, *, seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(size, IMAGE_FEATURES, generator=generator, dtype=dtype)
    # Matching texts correlate with their images, so the loss has structure to learn.
    text = image[:, :TEXT_FEATURES] + 0.5 * torch.randn(size, TEXT_FEATURES, generator=generator, dtype=dtype)
    return {"image": image, "text": text}


def make_models(
    *, seed: int = 0, dropout: float = 0.0, width: int = 16, depth: int = 2
) -> tuple[DualEncoder, InfoNCE]:
    torch.manual_seed(seed)
    return DualEncoder(width=width, depth=depth, dropout=dropout).double(), InfoNCE().double()


def grads(*modules: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for index, module in enumerate(modules):
        for name, parameter in module.named_parameters():
            if parameter.grad is not None:
                out[f"{index}.{name}"] = parameter.grad.detach().clone()
    return out


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|a - G| / max|G|."""
    assert actual.keys() == expected.keys()
    return max(float((actual[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)
