"""The offload policy's copies: round trip, prefetch order, pinned memory decided by the tensor.

On the CPU the hooks are forced to copy host tensors (copy_host_tensors=True), which runs the
same bookkeeping (pack order, prefetch of the input backward needs next) without streams. The
GPU tests prove the side stream: exact gradients, and the copies recorded on a non-compute stream.
Gradients against an un-offloaded reference, float64, tolerance 1e-12.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from microbatch.checkpointing import api as ckpt
from microbatch.checkpointing.api import checkpoint
from microbatch.checkpointing.offload import HostOffload, saved_on_host, thread_offload


def _chain(depth: int = 4, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]).double()


def test_hooks_round_trip_and_prefetch_the_next_input() -> None:
    offload = HostOffload()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: offload.pack(t, copy_host_tensors=True), offload.unpack
    ):
        y = x
        for _ in range(3):
            y = torch.sin(y)  # each sin saves its input
    y.sum().backward()
    want = x.detach()
    for _ in range(2):
        want = torch.sin(want)
    expected = torch.cos(x.detach()) * torch.cos(torch.sin(x.detach())) * torch.cos(want)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)
    # backward needs the last input first (fetched on demand), then each earlier one was prefetched
    assert (offload.fetched_on_demand, offload.prefetched) == (1, 2)


def test_offloaded_blocks_prefetch_across_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "_offload_saved_inputs", lambda **_: saved_on_host(copy_host_tensors=True))
    reference = _chain()
    model = copy.deepcopy(reference)
    handle = checkpoint(model, blocks=[f"{i}" for i in range(4)], policy="offload")
    offload = thread_offload()
    before = (offload.fetched_on_demand, offload.prefetched)
    x = torch.randn(5, 8, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    on_demand, prefetched = offload.fetched_on_demand - before[0], offload.prefetched - before[1]
    assert on_demand == 1 and prefetched >= 3  # only the last block's input waited in backward
    handle.remove()


def test_pinned_memory_is_decided_by_the_tensor_not_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU tensor on a machine with a GPU is copied to plain memory (pinning needs CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    requested: list[bool] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        requested.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    offload = HostOffload()
    entry = offload.pack(torch.ones(4), copy_host_tensors=True)
    assert requested == [False]
    assert torch.equal(offload.unpack(entry), torch.ones(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_is_exact_and_copies_on_a_side_stream() -> None:
    reference = _chain(width=256).cuda()
    model = copy.deepcopy(reference)
    handle = checkpoint(model, blocks=[f"{i}" for i in range(4)], policy="offload")
    offload = thread_offload()
    x = torch.randn(64, 256, dtype=torch.float64, device="cuda")
    model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    side = offload._streams[torch.device("cuda", torch.cuda.current_device())]
    assert side != torch.cuda.current_stream()
    assert offload.prefetched >= 3
    handle.remove()
