"""From runs to a Profile: every measured quantity fitted over the micro-batch sizes."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..workload import Workload
from . import reserved
from .costs import BYTES_FLOOR, NONE, SECONDS_FLOOR, Fit, PolicyCost, Profile, SegmentProfile, chain_peak
from .timeline import Run, SegmentRun, gap_names, unique_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurements:
    """What profiling ran: tracked runs (steady and first call), timed rounds, and the optimizer step."""

    sizes: Sequence[int]
    policies: Sequence[str]
    memory_runs: Mapping[tuple[str, int], Run]
    first_runs: Mapping[tuple[str, int], Run]
    timed_runs: Mapping[tuple[str, int], Sequence[Run]]
    static: Mapping[str, int]
    optimizer_name: str
    step_peak_bytes: int
    step_seconds: float
    gradient_bytes: Mapping[str, int]
    # policy -> the blocks profiled without it, because their checkpoint raised under it
    failed: Mapping[str, frozenset[str]] = field(default_factory=dict)


def gradient_bytes_by_segment(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> dict[str, int]:
    """Gradient bytes per segment: a block's own parameters; the rest to the part after the blocks,
    whose backward runs first (a conservative place for embeddings and tied weights)."""
    seen: set[int] = set()
    result: dict[str, int] = {}
    for name, module in blocks:
        params = [p for p in module.parameters() if p.requires_grad]
        result[name] = unique_bytes(params, seen)
    rest = [p for p in model.parameters() if p.requires_grad]
    result[gap_names([name for name, _ in blocks])[-1]] = unique_bytes(rest, seen)
    return result


def _policy_cost(
    sizes: Sequence[int],
    *,
    steady: Sequence[SegmentRun],
    first: Sequence[SegmentRun],
    timed: Sequence[SegmentRun],
) -> PolicyCost:
    """One segment's fits under one policy: bytes from the tracked runs, seconds from the fastest
    timed run at each size (``fastest_runs``)."""

    def bytes_fit(runs: Sequence[SegmentRun], quantity: str) -> Fit:
        return Fit.of(sizes, [getattr(run, quantity) for run in runs], interpolate=True)

    def seconds_fit(quantity: str) -> Fit:
        values = [getattr(run, quantity) for run in timed]
        return Fit.of(sizes, values, nonnegative=True, interpolate=True, line_beyond=True)

    differs = any(
        (a.kept_bytes, a.peak_bytes) != (b.kept_bytes, b.peak_bytes)
        for a, b in zip(first, steady, strict=True)
    )
    return PolicyCost(
        kept_bytes=bytes_fit(steady, "kept_bytes"),
        peak_bytes=bytes_fit(steady, "peak_bytes"),
        forward_seconds=seconds_fit("forward_seconds"),
        backward_seconds=seconds_fit("backward_seconds"),
        first_kept_bytes=bytes_fit(first, "kept_bytes") if differs else None,
        first_peak_bytes=bytes_fit(first, "peak_bytes") if differs else None,
    )


def _segment(measured: Measurements, name: str, is_block: bool, not_linear: list[str]) -> SegmentProfile:
    """One segment's fits under each policy it was run with (blocks: every policy; gaps: none)."""
    sizes, costs = measured.sizes, {}
    fastest = fastest_runs(measured.timed_runs)
    for policy in measured.policies if is_block else (NONE,):
        if name in measured.failed.get(policy, ()):
            continue
        cost = _policy_cost(
            sizes,
            steady=[measured.memory_runs[policy, size].segments[name] for size in sizes],
            first=[measured.first_runs[policy, size].segments[name] for size in sizes],
            timed=[fastest[policy, size].segments[name] for size in sizes],
        )
        for quantity in ("kept_bytes", "peak_bytes", "forward_seconds", "backward_seconds"):
            fit: Fit = getattr(cost, quantity)
            floor = BYTES_FLOOR if quantity.endswith("bytes") else SECONDS_FLOOR
            if not fit.is_linear(floor=floor):
                not_linear.append(f"{name} {policy} {quantity} ({fit.relative_miss():.0%})")
        costs[policy] = cost
    boundary = Fit.of(sizes, [measured.memory_runs[NONE, size].boundary_bytes.get(name, 0) for size in sizes])
    return SegmentProfile(
        name=name,
        is_block=is_block,
        costs=costs,
        boundary_bytes=boundary,
        gradient_bytes=measured.gradient_bytes.get(name, 0),
    )


def _less(fit: Fit, other: Fit) -> Fit:
    """``fit - other`` for two fits over the same sizes (the least-squares line is linear in them)."""
    return dataclasses.replace(
        fit,
        intercept=fit.intercept - other.intercept,
        slope=fit.slope - other.slope,
        values=tuple(a - b for a, b in zip(fit.values, other.values, strict=True)),
    )


def _refit(fit: Fit, values: Sequence[float]) -> Fit:
    """A fit like ``fit`` (its sizes, its interpolation) through other values."""
    return Fit.of(fit.sizes, values, interpolate=fit.interpolate)


def fold_freed_inputs(segments: Sequence[SegmentProfile]) -> list[SegmentProfile]:
    """A block's input that dies after it, credited to the block's own "none" cost.

    A block run without checkpointing that does not save its input (transformers' Llama layer
    saves an fp32 copy made by its RMSNorm, not the input) lets the caller free that input once the
    block returns: the part between it and the next block then keeps a negative number of bytes.
    Fits floor a cost at zero, so the credit was lost and a chain of L such blocks counted up to
    L - 1 inputs too many. The free happens only because the block holds nothing of its input, which
    is so under "none" only (a checkpoint keeps its block's inputs for the recompute), and the
    parts between blocks are measured under "none": so the negative part moves into the preceding
    block's "none" cost (and is recorded as its ``freed_input_bytes``) and the part between keeps
    zero. A 6-layer transformers Llama (d 256, 4 x 256 tokens, bf16): each middle layer's input,
    0.5 MiB, dies after it; with the credit the plan's peak is the measured one within 0.01 %
    (tests/test_freed_inputs.py).
    """
    folded = list(segments)
    for index in range(1, len(folded)):
        block, gap = folded[index - 1], folded[index]
        if not block.is_block or gap.is_block or NONE not in block.costs or NONE not in gap.costs:
            continue
        freed = gap.costs[NONE].kept_bytes
        if not any(value < 0 for value in freed.values):
            continue
        freed_input = _refit(freed, [max(0.0, -value) for value in freed.values])
        remainder = _refit(freed, [max(0.0, value) for value in freed.values])
        own, between = block.costs[NONE], gap.costs[NONE]
        first = own.first_kept_bytes
        own = dataclasses.replace(
            own,
            kept_bytes=_less(own.kept_bytes, freed_input),
            first_kept_bytes=None if first is None else _less(first, freed_input),
        )
        between = dataclasses.replace(between, kept_bytes=remainder, first_kept_bytes=None)
        folded[index - 1] = dataclasses.replace(
            block, costs={**block.costs, NONE: own}, freed_input_bytes=freed_input
        )
        folded[index] = dataclasses.replace(gap, costs={**gap.costs, NONE: between})
    return folded


def fastest_runs(timed_runs: Mapping[tuple[str, int], Sequence[Run]]) -> dict[tuple[str, int], Run]:
    """The fastest timed round of each (policy, size): its segments' times are the profile's.

    Other jobs on a machine only ever add time, so the fastest round is the closest to the work's
    own cost, as the planner benchmark takes a configuration's fastest window; the median of each
    segment over rounds carried the load of the profile's moment into the plan. One whole run, not
    each segment's fastest: per-segment minima sum to less than any run took.
    """
    return {key: min(runs, key=lambda run: run.seconds) for key, runs in timed_runs.items() if runs}


def _reserved_overhead(measured: Measurements) -> Fit | None:
    """Reserved minus live bytes of every tracked run, the worst at each size (profile/reserved.py)."""
    tracked = (measured.memory_runs, measured.first_runs)
    pairs = [(size, run) for runs in tracked for (_, size), run in runs.items()]
    return reserved.overhead_fit(measured.sizes, pairs)


def _loop_seconds(measured: Measurements) -> Fit:
    """Seconds per micro-batch outside the segments (the loss's and the loop's bookkeeping)."""
    fastest = fastest_runs(measured.timed_runs)
    outside_segments = [
        max(
            0.0,
            fastest[NONE, size].seconds
            - sum(s.forward_seconds + s.backward_seconds for s in fastest[NONE, size].segments.values()),
        )
        for size in measured.sizes
    ]
    return Fit.of(measured.sizes, outside_segments, nonnegative=True, interpolate=True, line_beyond=True)


def _slack_bytes(
    measured: Measurements, segments: Sequence[SegmentProfile], static_bytes: int, base: Fit
) -> int:
    """How far each tracked run's peak exceeded what the fitted chain (costs.chain_peak) predicts."""
    slack = 0.0
    for runs, first_call in ((measured.memory_runs, False), (measured.first_runs, True)):
        for (policy, size), run in runs.items():
            parts = []
            for segment in segments:
                cost = segment.costs.get(policy, segment.costs[NONE])
                parts.append((cost.kept(size, first=first_call), cost.peak(size, first=first_call)))
            predicted = static_bytes + base(size) + chain_peak(parts)
            slack = max(slack, run.peak_bytes - predicted)
    return math.ceil(slack)


def assemble(
    workload: Workload,
    device: torch.device,
    measured: Measurements,
    *,
    notes: list[str],
    seconds: float,
    clock: str = "wall",
) -> Profile:
    """Fit every measured quantity over the sizes and build the Profile."""
    sizes = measured.sizes
    reference = measured.memory_runs[NONE, sizes[0]]
    block_names = set(reference.order)
    not_linear: list[str] = []
    segments = fold_freed_inputs(
        [_segment(measured, name, name in block_names, not_linear) for name in reference.segments]
    )
    if not_linear:  # for the curious only: the planner's ties (time_noise) absorb such misses
        logger.debug("profile of %s: not linear in the micro-batch size: %s", workload.name, not_linear)
    if not all(run.in_order for run in measured.memory_runs.values()):
        notes.append("the blocks' backward passes did not run in reverse forward order; peaks may be off")
    parameter_bytes = measured.static.get("parameters", 0)
    gradient_total = measured.static.get("gradients", 0)
    optimizer_bytes = measured.static.get("optimizer state", 0)
    static_bytes = parameter_bytes + gradient_total + optimizer_bytes
    none_runs = [measured.memory_runs[NONE, size] for size in sizes]
    base = Fit.of(sizes, [max(0, run.start_bytes - static_bytes) for run in none_runs], interpolate=True)
    overhead = _reserved_overhead(measured)
    kind = reserved.peak_kind(cuda=overhead is not None)
    if overhead is not None:
        notes.append(reserved.note(kind, overhead))
    for note in notes:
        logger.debug("profile of %s: %s", workload.name, note)  # also in the plan's notes
    return Profile(
        name=workload.name,
        device=str(device),
        micro_batch_sizes=tuple(sizes),
        segments=tuple(segments),
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_total,
        optimizer_bytes=optimizer_bytes,
        optimizer_name=measured.optimizer_name,
        base_bytes=base,
        step_peak_bytes=measured.step_peak_bytes,
        step_seconds=measured.step_seconds,
        loop_seconds=_loop_seconds(measured),
        slack_bytes=_slack_bytes(measured, segments, static_bytes, base),
        profile_seconds=seconds,
        notes=tuple(notes),
        time_noise=time_noise(measured.timed_runs),
        reserved_overhead_bytes=overhead,
        peak_kind=kind,
        clock=clock,
    )


def time_noise(timed_runs: Mapping[tuple[str, int], Sequence[Run]]) -> float:
    """How far the profile's times could move if it were profiled again: the median over (policy,
    size) of the gap between the two fastest timed rounds, relative to the fastest.

    The profile's times are each (policy, size)'s fastest round (fastest_runs), so what matters is
    how well that minimum repeats, not the spread of every round: a loaded moment slows one round
    and leaves the minimum where it was. When the two fastest rounds agree to within n, a further
    round moves the minimum by at most about n (it can only lower it, and rarely by more than the
    gap the two already show). 0.0 with fewer than two rounds.
    """
    gaps = []
    for runs in timed_runs.values():
        seconds = sorted(run.seconds for run in runs)
        if len(seconds) >= 2 and seconds[0] > 0:
            gaps.append((seconds[1] - seconds[0]) / seconds[0])
    return statistics.median(gaps) if gaps else 0.0
