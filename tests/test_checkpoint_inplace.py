"""Selective checkpointing of blocks whose in-place ops write into the outputs it would cache.

conv -> ReLU(inplace=True) (torchvision / timm CNNs), ``out += residual`` and in-place SiLU write
into a convolution's output after the selective policy cached it; torch refuses such a cache entry
in backward. The policy must see the write and recompute that output instead.

Tolerances: float64; outputs and gradients rtol = atol = 1e-12 (the same ops on the same inputs,
rounding noise only); buffers bit-identical (only the original forward may touch them).
Recomputation is counted with FlopCounterMode (exact integers).
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import microbatch as mb
from microbatch.checkpointing.api import checkpoint
from microbatch.profile import profile_workload
from microbatch.workload import Workload

selective = importlib.import_module("microbatch.checkpointing.selective")

TOL = {"rtol": 1e-12, "atol": 1e-12}
EXACT = {"rtol": 0.0, "atol": 0.0}


class ReluBlock(nn.Module):
    """conv -> ReLU(inplace=True) -> conv, residual: the first conv's output is overwritten."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act(self.conv1(x)))


class SiluNormBlock(nn.Module):
    """In-place SiLU (not idempotent: applying it twice gives a different value) on a conv output,
    a BatchNorm, and an in-place residual add into the second conv's output through a view."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.SiLU(inplace=True)
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.bn(self.act(self.conv1(x))))
        out[:, :2] += x[:, :2]  # writes into a view of a saved output
        return torch.tanh(out)


def two_blocks(block: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(block(), block())).double()


def step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (out.square().mean() + out.sum()).backward()
    return {"out": out.detach(), "input_grad": x.grad}  # type: ignore[dict-item]


def assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    grads = {name: p.grad for name, p in actual.named_parameters()}
    for name, parameter in expected.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    buffers = dict(actual.named_buffers())
    for name, buffer in expected.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


def total_flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("policy_sees_outputs", [True, False], ids=["op_output", "dispatch-mode"])
@pytest.mark.parametrize("block", [ReluBlock, SiluNormBlock], ids=lambda b: b.__name__)
def test_selective_with_in_place_writes_matches_the_plain_model(
    block: type[nn.Module], policy_sees_outputs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if policy_sees_outputs and not selective.POLICY_SEES_OUTPUTS:
        pytest.skip("this torch does not hand the policy the op's output")
    monkeypatch.setattr(selective, "POLICY_SEES_OUTPUTS", policy_sees_outputs)
    reference = two_blocks(block)
    model = copy.deepcopy(reference)
    handle = checkpoint(model, blocks="auto", policy="selective")
    assert handle.blocks == ["1.0", "1.1"]
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for _ in range(3):  # the first step recomputes without the cache, the later ones learned it
        got, want = step(model, x), step(reference, x)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **TOL)
        assert_same_state(model, reference)
    handle.remove()


def test_only_the_overwritten_conv_is_recomputed_once_learned() -> None:
    """From the second step on, each block reruns exactly its first conv (its output is
    overwritten by the in-place ReLU); the second conv's output stays cached."""
    reference = two_blocks(ReluBlock)
    model = copy.deepcopy(reference)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    baseline = total_flops(lambda: step(reference, x))
    first_conv = total_flops(lambda: reference[1][0].conv1(torch.zeros(2, 4, 6, 6, dtype=torch.float64)))
    with checkpoint(model, policy="selective"):
        flops = [total_flops(lambda: step(model, x)) for _ in range(3)]
    # the first step's uncached recompute stops early after the ReLU as well, hence the same count
    assert flops[0] == flops[1] == flops[2] == baseline + 2 * first_conv


# --------------------------------------------------------------------------------------------------
# Profiling and planning: a policy that raises in some block is dropped there, never escapes


SELECTIVE_MODES = {"_CachingTorchDispatchMode", "_CachedTorchDispatchMode"}  # torch's SAC modes


class MaybeRefusesSelective(nn.Module):
    """A residual MLP block; with ``refuse`` it raises under the selective policy's dispatch modes
    (as a block whose ops the selective cache cannot serve would) and runs under none and full."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.refuse = refuse
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
        if self.refuse and any(type(mode).__name__ in SELECTIVE_MODES for mode in modes):
            raise RuntimeError("this block cannot run under selective checkpointing")
        return x + self.fc2(torch.relu(self.fc1(x)))  # type: ignore[no-any-return]


def refusing_workload(refusing: tuple[int, ...]) -> Workload:
    torch.manual_seed(0)
    blocks = nn.Sequential(*(MaybeRefusesSelective(i in refusing) for i in range(3)))
    model = nn.Sequential(nn.Linear(4, 8), blocks, nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 4, generator=generator), torch.randn(size, 1, generator=generator)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return nn.functional.mse_loss(m(batch[0]), batch[1]), int(batch[0].shape[0])

    return Workload(model=model, make_batch=make_batch, loss=loss, name="refusing")


def test_profiling_drops_selective_only_where_it_raises(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="microbatch.profile.measure"):
        profile = profile_workload(refusing_workload((1,)), micro_batch_sizes=(1, 2), repeats=1)
    policies = {segment.name: segment.policies for segment in profile.blocks}
    assert policies == {
        "1.0": ("none", "full", "selective"),
        "1.1": ("none", "full"),
        "1.2": ("none", "full", "selective"),
    }
    note = "policy selective raised in block '1.1' (RuntimeError: this block cannot run under selective"
    assert any(n.startswith(note) for n in profile.notes), profile.notes
    assert any("'1.1'" in record.message for record in caplog.records)


def test_plan_never_lets_a_policy_error_escape() -> None:
    """Every block refuses selective: the policy is dropped whole and the plan still comes."""
    workload = refusing_workload((0, 1, 2))
    plan = mb.plan(workload, batch=8, memory="64MiB", policies=("none", "full", "selective"))
    assert "selective" not in plan.policies.values()
    assert any("policy selective raised" in note for note in plan.notes), plan.notes
