"""Peaks in CUDA *reserved* bytes: a run's recorded allocations replayed through the allocator model.

On CUDA (a real device, or a CUDA target simulated under fake tensors) a budget is the caching
allocator's peak reserved bytes, not the peak of the live tensors MemoryTracker counts. One code
path turns the one into the other: every tracked run records its allocation sequence
(``MemoryTracker(record_allocations=True)``: the model's and the optimizer's storages first, then
each storage made and freed in order), and ``microbatch.memory.allocator.reserved_at`` serves it as
the caching allocator would, from an empty cache, at the capacity the planner sets around its
profiling (``allocator_capacity``: the budget's share of the allocator; the allocator gives its
cached free segments back only when a new one does not fit there): that reserved peak R is what
the budget must hold for the run. Without a capacity (a profile made outside plan(): a simulated
architecture's two-layer copy; a sharded plan, whose runs are of the whole model) the run is not
the plan's memory and has no capacity of its own: R is then ``least_reserved``'s estimate, the
device taken as tight (fitting is not monotone in the capacity, so it is an estimate, not a bound;
the unlimited replay, a bound, overstates these runs by far: 3.0 GiB against 219 MiB for
llama-3.1-8b's two-layer run at micro-batch 2, seq 4096). The tracker gives the same run's peak
live bytes A (each storage rounded to 512 B, as ``memory_allocated`` counts). The profile carries

    overhead(b) = max over the profiled runs at b (every policy, first call and steady state) of R - A

as ``Profile.reserved_overhead_bytes`` (interpolated between the sizes: ``Profile.reserved_overhead``), and
the search adds it to its prediction in live bytes, so that a CUDA plan's predicted peak is reserved
bytes. The optimizer step's peak (``step_peak_bytes``) is in reserved bytes directly: R of the
step's replay less the live bytes before it. The step runs while the segments the micro-batches
reserved are still cached, so the search adds the overhead to the step's peak too (a bound, not
a replay: it can overstate a step-bound peak by up to the overhead). On the CPU nothing
changes: a budget is live tensor bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..memory import MemoryTracker, format_bytes
from ..memory.allocator import current_capacity, expandable_segments_enabled, least_reserved, reserved_at
from .costs import Fit
from .timeline import Run

LIVE = "live tensor bytes"
ALLOCATOR_MODEL = "reserved (allocator model)"
EXPANDABLE = "reserved (expandable segments)"


def peak_kind(*, cuda: bool) -> str:
    """What a predicted peak counts: live tensor bytes off CUDA; on CUDA reserved bytes, from the
    allocator model with or without ``expandable_segments`` (as PYTORCH_CUDA_ALLOC_CONF says)."""
    if not cuda:
        return LIVE
    return EXPANDABLE if expandable_segments_enabled() else ALLOCATOR_MODEL


def reserved_peak_bytes(tracker: MemoryTracker) -> int | None:
    """Peak reserved bytes of the allocations ``tracker`` recorded; None when it recorded none."""
    if tracker.allocation_events is None:
        return None
    events, expandable = tracker.allocation_events, expandable_segments_enabled()
    capacity = current_capacity()
    if capacity is None:
        return least_reserved(events, expandable_segments=expandable).peak_reserved_bytes
    return reserved_at(events, capacity_bytes=capacity, expandable_segments=expandable).peak_reserved_bytes


def with_reserved_peak(run: Run, tracker: MemoryTracker | None) -> Run:
    """``run`` with its peak reserved bytes set from ``tracker``'s recorded allocations, if any."""
    if tracker is not None:
        run.reserved_peak_bytes = reserved_peak_bytes(tracker)
    return run


def overhead_bytes(run: Run) -> int:
    """Reserved minus live at the run's peak (never negative); 0 for a run with nothing replayed."""
    if run.reserved_peak_bytes is None:
        return 0
    return max(0, run.reserved_peak_bytes - run.peak_bytes)


def overhead_fit(sizes: Sequence[int], runs: Iterable[tuple[int, Run]]) -> Fit | None:
    """``overhead(b)`` at the profiled sizes from (size, run) pairs (the worst run at each size),
    interpolated between them; None when no run was replayed (off CUDA)."""
    worst: dict[int, int] = {}
    replayed = False
    for size, run in runs:
        replayed = replayed or run.reserved_peak_bytes is not None
        worst[size] = max(worst.get(size, 0), overhead_bytes(run))
    if not replayed:
        return None
    return Fit.of(sizes, [worst.get(size, 0) for size in sizes], interpolate=True)


def step_peak_bytes(tracker: MemoryTracker, start_bytes: int) -> int:
    """The optimizer step's peak above the live bytes before it: reserved when recorded, else live."""
    reserved = reserved_peak_bytes(tracker)
    peak = reserved if reserved is not None else tracker.peak_bytes
    return max(0, peak - start_bytes)


def note(kind: str, fit: Fit) -> str:
    """The profile's (and so the plan's) statement of what its peaks count, on CUDA."""
    spread = ", ".join(f"{format_bytes(round(v))} at {s}" for s, v in zip(fit.sizes, fit.values, strict=True))
    return (
        f"predicted peak: {kind}: the profiled runs' allocations replayed through "
        f"microbatch.memory.allocator; reserved minus live bytes per micro-batch size: {spread}"
    )
