"""Predictions in CUDA reserved bytes: the profile's recorded allocations replayed (profile/reserved.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.memory import MemoryTracker
from microbatch.memory.allocator import (
    AllocatorOutOfMemoryError,
    expandable_segments_enabled,
    least_reserved,
    replay,
    reserved_at,
)
from microbatch.memory.device_specs import devices
from microbatch.profile import profile_workload
from microbatch.profile.costs import Fit, Profile
from microbatch.profile.reserved import ALLOCATOR_MODEL, LIVE, overhead_fit, step_peak_bytes
from microbatch.profile.simulate import simulate_window
from microbatch.profile.timeline import Run

MiB = 1024**2


def _run(peak_bytes: int, reserved_peak_bytes: int | None) -> Run:
    return Run({}, 0, peak_bytes, 0.0, True, (), {}, reserved_peak_bytes=reserved_peak_bytes)


def test_overhead_is_the_worst_run_at_each_size_interpolated() -> None:
    runs = [(1, _run(100, 2 * MiB)), (1, _run(3 * MiB, 4 * MiB)), (8, _run(5 * MiB, 5 * MiB + 7))]
    fit = overhead_fit([1, 8], runs)
    assert fit is not None
    # Per size: max(2 MiB - 100, 1 MiB) at 1 and 7 at 8.
    assert fit.values == (2 * MiB - 100, 7)
    profile = dataclasses.replace(_profile(), reserved_overhead_bytes=fit)
    assert profile.reserved_overhead(1) == 2 * MiB - 100 and profile.reserved_overhead(8) == 7
    assert profile.reserved_overhead(4.5) == math.ceil((2 * MiB - 100 + 7) / 2)  # halfway
    assert profile.reserved_overhead(512) == 7  # falling beyond the sizes: held at the least value
    growing = Fit.of([1, 8], [MiB, 8 * MiB], interpolate=True)
    assert dataclasses.replace(profile, reserved_overhead_bytes=growing).reserved_overhead(16) == 16 * MiB
    assert overhead_fit([1], [(1, _run(100, None))]) is None  # nothing replayed: off CUDA
    assert dataclasses.replace(profile, reserved_overhead_bytes=None).reserved_overhead(8) == 0


def _profile() -> Profile:
    zero = Fit.constant(0)
    return Profile("p", "cuda", (1, 8), (), 0, 0, 0, "SGD", zero, 0, 0.0, zero)


def test_reserved_at_gives_cached_segments_back_before_failing() -> None:
    # Two 12 MiB tensors, the first freed, then 24 MiB: unlimited, the free 12 MiB segment stays
    # cached beside a new 24 MiB one (48 MiB reserved); on a 36-47 MiB device the allocator releases
    # it and the sequence runs with 36 MiB reserved, its allocated peak; below 36 MiB nothing runs it.
    events = [12 * MiB, 12 * MiB, -1, 24 * MiB]
    assert replay(events).peak_reserved_bytes == 48 * MiB
    for capacity in (36 * MiB, 40 * MiB, 47 * MiB):
        assert reserved_at(events, capacity_bytes=capacity).peak_reserved_bytes == 36 * MiB
    assert reserved_at(events, capacity_bytes=48 * MiB).peak_reserved_bytes == 48 * MiB
    short = reserved_at(events, capacity_bytes=36 * MiB - 512)
    assert short.out_of_memory and short.peak_reserved_bytes == 48 * MiB
    with pytest.raises(AllocatorOutOfMemoryError):
        replay(events, capacity_bytes=36 * MiB - 512)
    # Nothing to give back: the unlimited peak at any capacity that holds it.
    assert reserved_at([3 * MiB, 700 * 1024], capacity_bytes=None).peak_reserved_bytes == 22 * MiB


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


def _many_small_tensors(width: int = 32, depth: int = 6, seq: int = 1) -> mb.Workload:
    """Residual MLP blocks on (b, seq, width) inputs: every tensor small next to a 2 MiB segment."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(width) for _ in range(depth)], nn.Linear(width, 1))

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, seq, width), torch.randn(b, seq, 1)

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
    # What the budget must hold for the window: the replay at the budget's share of the allocator
    # (the budget less the context allowance), as plan() replayed its profiled runs.
    window = reserved_at(tracker.allocation_events, capacity_bytes=600 * MiB - spec.context_bytes)
    assert not window.out_of_memory
    predicted = plan.predicted_peak_bytes - spec.context_bytes  # the allowance outside the allocator
    overhead = dict(plan.peak_parts)["caching allocator (reserved - live)"]
    # The step bounds this plan's peak; the prediction adds the micro-batches' cached segments as a
    # bound (profile/reserved.py): without it, it is the window's replayed peak to the byte.
    assert predicted - overhead == window.peak_reserved_bytes
    assert window.peak_reserved_bytes <= predicted <= window.peak_reserved_bytes + overhead
    # Rounding matters here: 2 MiB of segments hold under 0.3 MiB of live tensors (the step's
    # foreach temporaries, all parameters at once as AdamW takes them on CUDA, are the live peak).
    assert window.peak_reserved_bytes >= 7 * tracker.peak_bytes
    assert any(ALLOCATOR_MODEL in note for note in plan.notes)


@pytest.mark.skipif(expandable_segments_enabled(), reason="compares the native allocator")
def test_simulated_cuda_plan_bound_by_activations_predicts_reserved_within_3_percent() -> None:
    workload, spec = _many_small_tensors(width=128, depth=6, seq=256), devices()["l4"]
    plan = mb.plan(workload, batch=16, memory="1GiB", device="l4")
    parts = dict(plan.peak_parts)
    assert "activations" in parts and plan.micro_batch_sizes == (16,)
    tracker = simulate_window(
        workload, spec, micro_batch_sizes=plan.micro_batch_sizes, policies=dict(plan.block_policies)
    )
    assert tracker.allocation_events is not None
    window = reserved_at(tracker.allocation_events, capacity_bytes=1024 * MiB - spec.context_bytes)
    assert not window.out_of_memory
    predicted = plan.predicted_peak_bytes - spec.context_bytes
    # Measured when written: predicted 45.66 MB, window 46.14 MB reserved (-1.0 %), 33.94 MB live.
    assert predicted == pytest.approx(window.peak_reserved_bytes, rel=0.03)
    assert window.peak_reserved_bytes >= 1.3 * tracker.peak_bytes  # the allocator's share matters
    assert parts["caching allocator (reserved - live)"] >= 0.2 * parts["activations"]


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
    # The trial measures torch's reserved peak (+ the same allowance): the prediction models it.
    assert chosen.predicted_peak_bytes == pytest.approx(chosen.measured_peak_bytes, rel=0.15)
    assert any(profile.peak_kind in note for note in chosen.notes)


def test_plan_replays_its_runs_at_the_budgets_share_of_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    # The profile's replays run at the capacity the device has under the budget (the budget less
    # the context allowance outside the allocator). A sharded plan's runs (the whole model, not a
    # rank's memory) have no capacity of their own: least_reserved's estimate.
    import microbatch.profile.reserved as reserved_module

    capacities: list[int | None] = []

    def at(events: list[int], *, capacity_bytes: int | None, expandable_segments: bool) -> object:
        capacities.append(capacity_bytes)
        return reserved_at(events, capacity_bytes=capacity_bytes, expandable_segments=expandable_segments)

    def estimate(events: list[int], *, expandable_segments: bool) -> object:
        capacities.append(None)
        return least_reserved(events, expandable_segments=expandable_segments)

    monkeypatch.setattr(reserved_module, "reserved_at", at)
    monkeypatch.setattr(reserved_module, "least_reserved", estimate)
    workload, spec = _many_small_tensors(), devices()["l4"]
    mb.plan(workload, batch=16, memory="600MiB", device="l4")
    assert capacities and set(capacities) == {600 * MiB - spec.context_bytes}
    capacities.clear()
    mb.plan(workload, batch=16, memory="600MiB", device="l4", world_size=2, shard="fsdp")
    assert capacities and set(capacities) == {None}
