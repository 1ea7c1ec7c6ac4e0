"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp.

Each expected number is derived in the test from the documented constants (512 B blocks, 1 MiB
small requests, 2 MiB / 20 MiB segments, 10 MiB large-allocation threshold, 2 MiB rounding).
A GPU test compares the model's reserved peak with torch's on a real device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import ConfigError, InfeasibleBudgetError
from microbatch.memory.allocator import (
    AllocatorOutOfMemoryError,
    CachingAllocatorModel,
    allocator_capacity,
    check_cuda_budget,
    current_capacity,
    ddp_bucket_bytes,
    expandable_segments_enabled,
    is_small,
    least_reserved,
    outside_allocator_bytes,
    replay,
    reserved_at,
    round_size,
    segment_size,
)

KiB, MiB = 1024, 1024**2


@pytest.mark.parametrize(("nbytes", "rounded"), [(0, 512), (1, 512), (512, 512), (513, 1024), (4000, 4096)])
def test_requests_round_to_512_bytes(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize(
    ("nbytes", "small", "segment"),
    [
        (4, True, 2 * MiB),  # small pool: 2 MiB segments
        (MiB, True, 2 * MiB),  # exactly 1 MiB is still small
        (MiB + 1, False, 20 * MiB),  # 1-10 MiB: 20 MiB segments
        (10 * MiB - 512, False, 20 * MiB),
        (10 * MiB, False, 10 * MiB),  # from 10 MiB: its own segment, rounded to 2 MiB
        (11 * MiB, False, 12 * MiB),
        (100 * MiB + 1, False, 102 * MiB),
    ],
)
def test_pools_and_segment_sizes(nbytes: int, small: bool, segment: int) -> None:
    assert is_small(nbytes) is small
    assert segment_size(nbytes) == segment


def test_small_requests_share_a_2_mib_segment() -> None:
    # 4 x 400 KiB fit one 2 MiB segment (1600 KiB <= 2048 KiB); the fifth needs a second one.
    peaks = replay([400 * KiB] * 4)
    assert (peaks.peak_allocated_bytes, peaks.peak_reserved_bytes) == (1600 * KiB, 2 * MiB)
    assert replay([400 * KiB] * 6).peak_reserved_bytes == 4 * MiB


def test_medium_requests_share_a_20_mib_segment() -> None:
    # 3 MiB x 6 = 18 MiB fits one 20 MiB segment; a seventh needs another 20 MiB.
    assert replay([3 * MiB] * 6).peak_reserved_bytes == 20 * MiB
    assert replay([3 * MiB] * 7).peak_reserved_bytes == 40 * MiB


def test_large_pool_keeps_a_remainder_of_at_most_1_mib_unsplit() -> None:
    # 19.5 MiB from a 20 MiB segment leaves 0.5 MiB: not split (the large pool splits only > 1 MiB),
    # so the request holds all 20 MiB and counts as allocated.
    model = CachingAllocatorModel()
    model.malloc(19 * MiB + 512 * KiB)
    assert model.allocated_bytes == 20 * MiB
    # 8 MiB (below 10 MiB) takes a 20 MiB segment and leaves 12 MiB: split, and the rest serves
    # later 1-10 MiB requests without a new segment.
    model = CachingAllocatorModel()
    model.malloc(8 * MiB)
    model.malloc(MiB + 512 * KiB)
    model.malloc(9 * MiB)
    assert (model.allocated_bytes, model.reserved_bytes) == (18 * MiB + 512 * KiB, 20 * MiB)


def test_freed_blocks_are_cached_and_reused_best_fit() -> None:
    model = CachingAllocatorModel()
    a = model.malloc(12 * MiB)
    b = model.malloc(30 * MiB)
    model.free(a)
    model.free(b)
    assert (model.allocated_bytes, model.reserved_bytes) == (0, 42 * MiB)  # nothing given back
    model.malloc(11 * MiB)  # the 12 MiB segment is the smallest that holds 11 MiB (12 MiB rounded)
    assert model.reserved_bytes == 42 * MiB
    model.malloc(25 * MiB)  # then the 30 MiB one
    assert model.reserved_bytes == 42 * MiB
    model.malloc(40 * MiB)  # nothing cached holds 40 MiB: a new segment
    assert model.reserved_bytes == 82 * MiB


def test_fragmentation_between_segments_costs_reserved_memory() -> None:
    # Two 12 MiB segments, both freed, cannot serve one 24 MiB request: segments are never merged.
    peaks = replay([12 * MiB, 12 * MiB, -1, -2, 24 * MiB])
    assert peaks.peak_allocated_bytes == 24 * MiB
    assert peaks.peak_reserved_bytes == 48 * MiB
    # With expandable segments the pool is one range that grows: the freed 24 MiB are reused.
    expandable = replay([12 * MiB, 12 * MiB, -1, -2, 24 * MiB], expandable_segments=True)
    assert expandable.peak_reserved_bytes == 40 * MiB  # 24 MiB mapped in 20 MiB pages


def test_freed_neighbours_merge_within_a_segment() -> None:
    model = CachingAllocatorModel()
    handles = [model.malloc(4 * MiB) for _ in range(4)]  # 16 of one 20 MiB segment
    model.free(handles[1])
    model.free(handles[2])
    model.malloc(8 * MiB)  # the merged 8 MiB hole serves it: no new segment
    assert model.reserved_bytes == 20 * MiB


def test_capacity_releases_free_segments_before_failing() -> None:
    model = CachingAllocatorModel(capacity_bytes=40 * MiB)
    first = model.malloc(30 * MiB)
    model.free(first)
    model.malloc(36 * MiB)  # 30 + 36 > 40: the free 30 MiB segment is released, then 36 fits
    assert model.reserved_bytes == 36 * MiB
    with pytest.raises(AllocatorOutOfMemoryError):
        model.malloc(6 * MiB)  # a 20 MiB segment on top of 36 MiB exceeds 40 MiB
    assert model.reserved_bytes == 36 * MiB


def test_expandable_segments_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert expandable_segments_enabled()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments_enabled()


def test_outside_allocator_is_zero_off_cuda() -> None:
    assert outside_allocator_bytes(torch.device("cpu")) == 0


def test_ddp_buckets_are_a_second_copy_of_trainable_gradients() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    model[1].requires_grad_(False)
    trainable = (10 * 10 + 10) * 4
    assert ddp_bucket_bytes(model, world_size=2) == trainable
    assert ddp_bucket_bytes(model, world_size=2, gradient_as_bucket_view=True) == 0
    assert ddp_bucket_bytes(model, world_size=1) == 0


def test_budget_checks_name_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"90.00 GiB.*80.00 GiB"):
        check_cuda_budget(90 * 1024 * MiB, total_bytes=80 * 1024 * MiB, outside_bytes=500 * MiB)
    with pytest.raises(InfeasibleBudgetError, match=r"400 MiB.*500 MiB"):
        check_cuda_budget(400 * MiB, total_bytes=80 * 1024 * MiB, outside_bytes=500 * MiB)
    check_cuda_budget(600 * MiB, total_bytes=80 * 1024 * MiB, outside_bytes=500 * MiB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_matches_torch_reserved_peak_on_cuda() -> None:
    if expandable_segments_enabled():
        pytest.skip("compares the native allocator without expandable segments")
    sizes = [3 * MiB, 700 * KiB, 12 * MiB, 12 * MiB, 5 * MiB, 33 * MiB + 7]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if torch.cuda.memory_reserved() != 0:
        pytest.skip("live tensors of another test hold cached segments")
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    del tensors[2:4]
    tensors.append(torch.empty(24 * MiB, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    events = [*sizes, -3, -4, 24 * MiB]
    peaks = replay(events)
    assert torch.cuda.max_memory_reserved() == peaks.peak_reserved_bytes
    assert torch.cuda.max_memory_allocated() == peaks.peak_allocated_bytes
    del tensors
    torch.cuda.empty_cache()


def test_tracker_events_replay_into_reserved_bytes() -> None:
    """MemoryTracker(record_allocations=True) gives the sequence the allocator model replays."""
    from microbatch.memory import MemoryTracker

    with MemoryTracker("cpu", record_allocations=True) as tracker:
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        b = torch.empty(12 * MiB, dtype=torch.uint8)  # best fit: the 17 MiB left of a's 20 MiB segment
        del a
        c = torch.empty(2 * MiB, dtype=torch.uint8)  # a's freed 3 MiB block
        del b, c
    assert tracker.allocation_events == [3 * MiB, 12 * MiB, -1, 2 * MiB, -2, -3]
    peaks = replay(tracker.allocation_events or [])
    assert (peaks.peak_allocated_bytes, peaks.peak_reserved_bytes) == (15 * MiB, 20 * MiB)


# ----------------------------------------------------------------------------- at the budget's capacity
@st.composite
def event_sequences(draw: st.DrawFn) -> list[int]:
    """Allocations (bytes, small and large pool) and frees of earlier live allocations, in any order."""
    events: list[int] = []
    live: list[int] = []
    made = 0
    for _ in range(draw(st.integers(1, 14))):
        if live and draw(st.booleans()):
            events.append(-live.pop(draw(st.integers(0, len(live) - 1))))
        else:
            made += 1
            live.append(made)
            events.append(
                draw(st.sampled_from([0, 300, 700 * KiB, 3 * MiB, 6 * MiB, 12 * MiB, 22 * MiB, 30 * MiB]))
            )
    return events


@settings(max_examples=400, deadline=None)
@given(events=event_sequences(), capacity_mib=st.integers(1, 120), expandable=st.booleans())
def test_reserved_at_is_the_replay_at_that_capacity(
    events: list[int], capacity_mib: int, expandable: bool
) -> None:
    capacity = capacity_mib * MiB
    found = reserved_at(events, capacity_bytes=capacity, expandable_segments=expandable)
    unlimited = replay(events, expandable_segments=expandable)
    try:
        direct = replay(events, capacity_bytes=capacity, expandable_segments=expandable)
    except AllocatorOutOfMemoryError:
        # Out of memory there: said so, with a peak above the capacity (the unlimited replay's).
        assert found.out_of_memory and found == dataclasses.replace(unlimited, out_of_memory=True)
        assert found.peak_reserved_bytes > capacity
        return
    assert found == direct and not found.out_of_memory
    assert found.peak_reserved_bytes <= capacity
    # The unlimited replay bounds the reserved peak at every capacity the sequence runs at.
    assert unlimited.peak_reserved_bytes >= found.peak_reserved_bytes
    assert reserved_at(events, capacity_bytes=None, expandable_segments=expandable) == unlimited


def test_running_within_a_capacity_is_not_monotone() -> None:
    # 22 and 4 MiB made and freed (a 22 MiB segment and a 20 MiB one cached), 6 MiB (into the 20 MiB
    # segment), 24 MiB, 16 MiB, the 6 MiB freed, 22 MiB. At 62 MiB the 24 MiB request makes the
    # allocator give the free 22 MiB segment back, and the rest fits (62 MiB reserved). At 66 MiB the
    # 24 MiB request fits beside it, the 16 MiB tensor then takes that cached segment, and the last
    # 22 MiB request finds only the 20 MiB segment to give back: out of memory on the larger device.
    events = [22 * MiB, 4 * MiB, -2, -1, 6 * MiB, 24 * MiB, 16 * MiB, -3, 22 * MiB]
    small = reserved_at(events, capacity_bytes=62 * MiB)
    assert not small.out_of_memory and small.peak_reserved_bytes == 62 * MiB
    assert reserved_at(events, capacity_bytes=66 * MiB).out_of_memory  # what a bisection assumed away
    large = reserved_at(events, capacity_bytes=68 * MiB)
    assert not large.out_of_memory and large.peak_reserved_bytes == 68 * MiB
    assert replay(events).peak_reserved_bytes == 88 * MiB  # unlimited: nothing given back


def test_allocator_capacity_nests_and_restores() -> None:
    # plan() sets the capacity its profiling replays at (tests/test_reserved.py); outside, unlimited.
    seen: list[int | None] = []
    with allocator_capacity(40 * MiB):
        seen.append(current_capacity())
        with allocator_capacity(None):
            seen.append(current_capacity())
        seen.append(current_capacity())
    seen.append(current_capacity())
    assert seen == [40 * MiB, None, 40 * MiB, None]


def test_least_reserved_is_an_estimate_a_larger_capacity_may_fail() -> None:
    # The bisection finds a capacity the sequence runs at; the non-monotone sequence above also
    # fails at a larger one, which is why a known capacity is replayed directly (reserved_at).
    events = [22 * MiB, 4 * MiB, -2, -1, 6 * MiB, 24 * MiB, 16 * MiB, -3, 22 * MiB]
    estimate = least_reserved(events)
    assert estimate.peak_reserved_bytes <= 64 * MiB
    assert not reserved_at(events, capacity_bytes=estimate.peak_reserved_bytes).out_of_memory
    assert reserved_at(events, capacity_bytes=66 * MiB).out_of_memory
