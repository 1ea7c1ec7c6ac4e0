"""Predictions in CUDA reserved bytes: the profile's recorded allocations replayed (profile/reserved.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.allocator import expandable_segments_enabled, replay
from microbatch.devices import devices
from microbatch.memory import MemoryTracker
from microbatch.profile import profile_workload
from microbatch.profile.reserved import ALLOCATOR_MODEL, LIVE, overhead_fit, step_peak_bytes
from microbatch.profile.simulate import simulate_window
from microbatch.profile.timeline import Run

MiB = 1024**2


def _run(peak_bytes: int, reserved_peak_bytes: int | None) -> Run:
    return Run({}, 0, peak_bytes, 0.0, True, (), {}, reserved_peak_bytes=reserved_peak_bytes)


def test_overhead_is_the_worst_run_at_every_size() -> None:
    runs = [(1, _run(100, 2 * MiB)), (1, _run(3 * MiB, 4 * MiB)), (8, _run(5 * MiB, 5 * MiB + 7))]
    fit = overhead_fit([1, 8], runs)
    assert fit is not None
    # Per size: max(2 MiB - 100, 1 MiB) at 1 and 7 at 8; the fit is their maximum everywhere.
    assert fit.values == (2 * MiB - 100, 7)
    assert fit(1) == fit(8) == fit(512) == 2 * MiB - 100
    assert overhead_fit([1], [(1, _run(100, None))]) is None  # nothing replayed: off CUDA


def test_step_peak_is_the_replayed_reserved_peak_above_the_start() -> None:
    with MemoryTracker("cpu", record_allocations=True) as tracker:
        kept = torch.ones(1000)  # 4000 B: one small segment of 2 MiB
        temporary = torch.ones(3 * MiB // 4)  # 3 MiB: a 20 MiB large-pool segment
        del temporary
    assert tracker.allocation_events is not None
    assert step_peak_bytes(tracker, 4000) == 22 * MiB - 4000
    plain = MemoryTracker("cpu")
    plain.peak_bytes = 5000
    assert step_peak_bytes(plain, 4000) == 1000  # not recorded: live bytes
    del kept


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def _many_small_tensors(width: int = 32, depth: int = 6) -> mb.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(width) for _ in range(depth)], nn.Linear(width, 1))

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, width), torch.randn(b, 1)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        return nn.functional.mse_loss(m(x), y), x.shape[0]

    return mb.Workload(model=model, make_batch=make_batch, loss=loss, name="small-tensors")


@pytest.mark.skipif(expandable_segments_enabled(), reason="compares the native allocator")
def test_simulated_cuda_plan_predicts_the_replayed_reserved_peak() -> None:
    workload, spec = _many_small_tensors(), devices()["l4"]
    plan = mb.plan(workload, batch=16, memory="600MiB", device="l4")
    tracker = simulate_window(
        workload, spec, micro_batch_sizes=plan.micro_batch_sizes, policies=dict(plan.block_policies)
    )
    assert tracker.allocation_events is not None
    window = replay(tracker.allocation_events)
    predicted = plan.predicted_peak_bytes - spec.context_bytes  # the allowance outside the allocator
    overhead = dict(plan.peak_parts)["caching allocator (reserved - live)"]
    # The step bounds this plan's peak; the prediction adds the micro-batches' cached segments as a
    # bound (profile/reserved.py): without it, it is the window's replayed peak to the byte.
    assert predicted - overhead == window.peak_reserved_bytes
    assert window.peak_reserved_bytes <= predicted <= window.peak_reserved_bytes + overhead
    # Rounding matters here: 2 MiB of segments hold a quarter MiB of live tensors.
    assert window.peak_reserved_bytes >= 8 * tracker.peak_bytes
    assert any(ALLOCATOR_MODEL in note for note in plan.notes)


def test_cpu_profiles_stay_in_live_bytes() -> None:
    profile = profile_workload(_many_small_tensors(depth=2), micro_batch_sizes=[1, 2], repeats=1)
    assert profile.reserved_overhead_bytes is None and profile.peak_kind == LIVE
    assert profile.reserved_overhead(64) == 0
    assert not any("reserved" in note for note in profile.notes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_predicts_reserved_bytes() -> None:
    workload = _many_small_tensors(width=512, depth=4)
    workload.model.cuda()
    profile = profile_workload(workload, micro_batch_sizes=[1, 8], repeats=1)
    assert profile.peak_kind.startswith("reserved") and profile.reserved_overhead(8) > 0
    chosen = mb.plan(workload, batch=16, memory="2GiB", profile=profile)
    assert chosen.measured_peak_bytes is not None
    assert chosen.measured_peak_bytes <= chosen.budget_bytes
    assert any(profile.peak_kind in note for note in chosen.notes)
