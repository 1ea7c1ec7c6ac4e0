"""The Lightning and Accelerate examples, run at tiny sizes against a full-batch reference.

Reference: the same initial network trained with plain SGD on the full windows (12, 12 and the short
last 2 samples of 26), float32; rtol = atol = 1e-6 (float32 rounding of a different summation
order; an inexact weighting such as dividing by the step count misses by 1e-2 and more).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

TOL = {"rtol": 1e-6, "atol": 1e-6}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(net: nn.Module, dataset: Any, windows: list[int]) -> nn.Module:
    """Plain SGD (lr 0.1), one step per full window, from the example's initial weights."""
    x, y = dataset.tensors
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    start = 0
    for size in windows:
        optimizer.zero_grad()
        F.mse_loss(net(x[start : start + size]), y[start : start + size]).backward()
        optimizer.step()
        start += size
    return net


def _initial_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_lightning_manual_optimization_is_exact_and_counts_global_steps() -> None:
    pytest.importorskip("lightning")
    example = _load("lightning_manual")
    module, trainer = example.main(["--samples", "26", "--micro-batch", "4", "--steps", "3"])
    assert trainer.global_step == 3  # self.optimizers() was stepped: two full windows, one short
    reference = _reference(_initial_net(), example.data(26), [12, 12, 2])
    for p, q in zip(module.net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)


def test_accelerate_prepared_model_is_exact() -> None:
    pytest.importorskip("accelerate")
    example = _load("accelerate_loop")
    model, losses = example.main(["--cpu", "--samples", "26", "--micro-batch", "4", "--steps", "3"])
    assert len(losses) == 3
    reference = _reference(_initial_net(), example.data(26), [12, 12, 2])
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
