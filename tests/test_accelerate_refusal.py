"""mb.Accumulator refuses an optimizer whose Accelerator accumulates too (its steps would be dropped)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import microbatch as mb

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    # Accelerate keeps its state in process-wide singletons: leave them as other tests expect.
    from accelerate.state import AcceleratorState, GradientState

    yield
    GradientState._reset_state()
    AcceleratorState._reset_state(reset_partial_state=True)


def _prepared(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)
    model = nn.Linear(4, 1)
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[no-any-return]


def test_accelerate_gradient_accumulation_under_the_accumulator_is_refused(
    fresh_accelerate_state: None,
) -> None:
    model, optimizer = _prepared(steps=4)
    with pytest.raises(mb.ConfigError, match="gradient_accumulation_steps=4"):
        mb.Accumulator(model, optimizer, steps=3)


def test_accelerate_without_its_own_accumulation_is_accepted(fresh_accelerate_state: None) -> None:
    model, optimizer = _prepared(steps=1)
    accumulator = mb.Accumulator(model, optimizer, steps=3)
    before = [p.detach().clone() for p in model.parameters()]
    for micro in torch.randn(6, 4).split(2):
        accumulator.backward(model(micro).square().mean(), items=micro.shape[0])
    accumulator.step()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # it stepped
