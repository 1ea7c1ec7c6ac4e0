"""Reference computations shared by the numerical tests: the full batch, done the plain way."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import microbatch as mb

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, int | float | torch.Tensor]"]


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def full_batch_grads(model: nn.Module, loss_fn: LossFn, batch: Any) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients and loss of the full batch's mean loss, on a copy of the model."""
    reference = copy.deepcopy(model)
    loss, _ = loss_fn(reference, batch)
    loss.backward()
    return grads_of(reference), float(loss.detach())


def accumulated_grads(
    model: nn.Module,
    loss_fn: LossFn,
    micro_batches: Sequence[Any],
    *,
    steps: int | None = None,
    **options: Any,
) -> tuple[dict[str, torch.Tensor], mb.WindowStats]:
    """Gradients the Accumulator leaves just before its optimizer step (captured with lr=0 SGD)."""
    clone = copy.deepcopy(model)
    captured: dict[str, torch.Tensor] = {}
    optimizer = torch.optim.SGD(clone.parameters(), lr=0.0)
    hook = optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(clone)))
    acc = mb.Accumulator(clone, optimizer, steps=steps or len(micro_batches), **options)
    stats = None
    for micro in acc.iterate(micro_batches):
        loss, items = loss_fn(clone, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            stats = acc.step()
    hook.remove()
    assert stats is not None
    return captured, stats


def assert_grads_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tol: Any
) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


def max_relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    num = max(float((actual[n] - expected[n]).abs().max()) for n in expected)
    den = max(float(expected[n].abs().max()) for n in expected)
    return num / den
