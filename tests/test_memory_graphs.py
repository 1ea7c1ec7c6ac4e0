"""MemoryTracker lets go of graphs that are never backpropagated.

Its saved-tensor hook used to hand autograd the tensor itself; for tensors a node saves of its own
output (ReLU, tanh) that made a cycle through autograd's graph, so the graph of a forward without
backward, or of a forward cut short by an exception, stayed alive. Live bytes must come back to the
baseline exactly: the tracker counts every storage, so any leftover is a whole tensor.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import microbatch as mb

BATCH, WIDTH, HIDDEN = 64, 32, 128


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)
    )


def forward_without_backward(model: nn.Module, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    assert loss.grad_fn is not None  # a graph was built


def forward_cut_short(model: nn.Module, x: torch.Tensor) -> None:
    hidden = torch.tanh(model[2](torch.relu(model[0](x))))
    assert hidden.grad_fn is not None
    raise torch.OutOfMemoryError("CUDA out of memory (simulated mid-forward)")


def test_forwards_without_backward_return_to_the_baseline() -> None:
    model, x = mlp(), torch.randn(BATCH, WIDTH)
    with mb.MemoryTracker(model=model) as mem:
        model(x).sum().backward()  # every tensor the model keeps (gradients, the input) seen once
        model.zero_grad(set_to_none=False)
        baseline = mem.current_bytes
        for _ in range(3):
            forward_without_backward(model, x)
            assert mem.current_bytes == baseline
        gc.collect()
        assert mem.current_bytes == baseline
        model(x).sum().backward()  # and the next step still trains and is counted
        assert mem.current_bytes == baseline


def test_an_exception_mid_forward_leaves_nothing_alive() -> None:
    model, x = mlp(), torch.randn(BATCH, WIDTH)
    with mb.MemoryTracker(model=model) as mem:
        model(x).sum().backward()
        baseline = mem.current_bytes
        for _ in range(2):
            with pytest.raises(torch.OutOfMemoryError):
                forward_cut_short(model, x)
        gc.collect()  # the exception's traceback frames are gone once handled
        assert mem.current_bytes == baseline
