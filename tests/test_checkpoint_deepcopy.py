"""A deep copy of a checkpointed model is a model of its own: its forward runs its own weights.

An EMA copy, a trial copy or a Trainer's copy of a checkpointed model used to keep calling the
original blocks (the wrapped forward was a closure, which deepcopy shares): the copy's outputs came
from the original's weights and its gradients landed on the original's parameters. Reference: the
same copy with checkpointing removed from its source before copying, float64, rtol 1e-12.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import microbatch as mb


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2)),
        nn.Sequential(nn.Linear(8, 8), nn.GELU()),
        nn.Linear(8, 1),
    ).double()


@pytest.mark.parametrize("policy", ["full", "selective", "selective-half", "offload"])
def test_a_deep_copy_trains_its_own_weights(policy: str) -> None:
    reference_source = _net()
    source = _net()
    handle = mb.checkpoint(source, blocks=["0", "1"], policy=policy)
    copied, reference = copy.deepcopy(source), copy.deepcopy(reference_source)
    with torch.no_grad():  # the copies move away from their sources
        for model in (copied, reference):
            for parameter in model.parameters():
                parameter.add_(0.5)
    x = torch.randn(10, 6, dtype=torch.float64)
    torch.manual_seed(1)
    copied(x).pow(2).sum().backward()
    torch.manual_seed(1)
    reference(x).pow(2).sum().backward()

    assert all(parameter.grad is None for parameter in source.parameters())  # nothing reached the source
    for (name, got), want in zip(copied.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=0, msg=name)
    # BatchNorm's running statistics moved once, on the copy only
    torch.testing.assert_close(copied[0][1].running_mean, reference[0][1].running_mean, rtol=1e-12, atol=0)
    assert int(copied[0][1].num_batches_tracked) == 1 and int(source[0][1].num_batches_tracked) == 0
    # the copy stays checkpointed; removing the handle restores the source only
    handle.remove()
    assert "forward" not in source[0].__dict__ and "forward" in copied[0].__dict__


def test_the_copy_keeps_the_blocks_signature() -> None:
    source = _net()
    mb.checkpoint(source, blocks=["0"], policy="full")
    copied = copy.deepcopy(source)
    assert copied[0].forward.__name__ == "forward"
    assert copied[0].forward.original.__self__ is copied[0]
