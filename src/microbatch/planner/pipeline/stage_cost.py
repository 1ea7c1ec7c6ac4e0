"""A pipeline's stages priced from a Profile: each stage's peak bytes and seconds, any policy per block.

A Profile (measured here, or simulated for a device that is not here) cuts one micro-batch's forward
and backward into segments: what runs before the first block (embeddings), each block, the parts
between blocks, and what runs after the last block (final norm, head, loss). A stage is a contiguous
run of blocks; the first stage also holds the part before the first block, the last stage the part
after the last one, and a part between two blocks goes with the block before it (the cut is at a
block's beginning, as distributed/stages.py cuts). Identical decoder layers need no tracer: the
segments say everything.

For stage s with a policy per block, at micro-batch size b (the Profile's fits):

    kept_s    sum over its segments of kept_bytes: what one micro-batch leaves alive until its backward;
              on the last stage also its output (a token LM's logits), which torch's stage keeps for
              the backward while one process frees it once the loss is computed
    chain_s   max_k (P_{k-1} + peak_k + G_k): one micro-batch's own peak above that (costs.chain_peak),
              with G_k the stage's gradients that exist while segment k runs
    t_s       its segments' forward + backward seconds, and the recomputed forwards

A schedule keeps up to k_s micro-batches in flight on stage s (in_flight: GPipe m, 1F1B
min(m, S - s)), so the stage peaks at a backward:

    peak_s = fixed_s + max((k_s - 1) kept_s + chain_s(first),         the window's first backward:
                                                                       G_k = gradients of the later segments
                           (k'_s - 1) kept_s + chain_s(steady))        a later one: all the stage's gradients

with k'_s = k_s when a forward comes between two backwards (1F1B with m > k_s), else k_s - 1 (GPipe's
second backward holds one micro-batch less). fixed_s: the stage's parameters and optimizer state, and
the receive buffers torch's stage allocates once per micro-batch of a step: m activations coming in
(s > 0) and m gradients of its output coming back (s < S - 1), each one boundary tensor. The optimizer
step peaks at parameters + gradients + state + the step's own temporaries (the Profile's step peak, by
the stage's share of the parameters).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...distributed.stages import balanced_cuts
from ...errors import ConfigError
from ...profile import NONE, Profile
from ...profile.costs import SegmentProfile
from ..search.sizes import RECOMPUTE_FLOOR
from ..search.thinning import thin

MAX_STATES = 2048  # partial choices kept per block by the per-stage solver (thinned above it)

# (P, first-window chain peak, steady chain peak, seconds, option index per segment so far)
_StageState = tuple[int, int, int, float, tuple[int, ...]]


def in_flight(schedule: str, num_stages: int, micro_batches: int) -> tuple[int, ...]:
    """Micro-batches whose activations stage s holds at once: GPipe all m (every forward before any
    backward); 1F1B min(m, S - s) (stage s runs S - s forwards before its first backward, then one
    forward per backward; Narayanan et al. 2021, PipeDream-Flush)."""
    if schedule == "gpipe":
        return tuple(micro_batches for _ in range(num_stages))
    if schedule == "1f1b":
        return tuple(min(micro_batches, num_stages - s) for s in range(num_stages))
    raise ConfigError(f"schedule must be gpipe or 1f1b for a prediction, got {schedule!r}")


def stage_segments(profile: Profile, cuts: Sequence[int]) -> list[list[int]]:
    """Indices into ``profile.segments`` per stage, for stages beginning at blocks ``cuts`` (1 .. S-1)."""
    stages: list[list[int]] = [[] for _ in range(len(cuts) + 1)]
    current, blocks_seen = 0, 0
    for index, segment in enumerate(profile.segments):
        if segment.is_block:
            current = sum(1 for cut in cuts if cut <= blocks_seen)
            blocks_seen += 1
        stages[current].append(index)
    return stages


def block_seconds(profile: Profile, micro_batch_size: int) -> list[float]:
    """Each block's forward + backward seconds without checkpointing, the parts outside blocks added to
    the block whose stage runs them (the first block takes the part before it, the last the part after).

    Blocks alike (the same gradient and kept bytes: a transformer's layers) take their median time:
    their measured times differ by noise only, which must not move the cuts from one run to the next.
    """
    alike: dict[tuple[int, int], list[float]] = {}
    for segment in profile.blocks:
        alike.setdefault(_shape(segment, micro_batch_size), []).append(
            segment.costs[NONE].seconds(micro_batch_size)
        )
    costs: list[float] = []
    before = 0.0
    for segment in profile.segments:
        seconds = segment.costs[NONE].seconds(micro_batch_size)
        if segment.is_block:
            seconds = statistics.median(alike[_shape(segment, micro_batch_size)])
            costs.append(seconds + before)
            before = 0.0
        elif costs:
            costs[-1] += seconds
        else:
            before += seconds
    if not costs:
        raise ConfigError("the profile has no blocks to cut into pipeline stages (blocks='auto' found none)")
    return costs


def _shape(segment: SegmentProfile, micro_batch_size: int) -> tuple[int, int]:
    return segment.gradient_bytes, math.ceil(segment.costs[NONE].kept(micro_batch_size))


def balanced_block_cuts(profile: Profile, num_stages: int, micro_batch_size: int) -> list[int]:
    """Blocks where stages 1 .. S-1 begin, balancing the profile's seconds per stage."""
    return balanced_cuts(block_seconds(profile, micro_batch_size), num_stages)


# ---------------------------------------------------------------------- parameters per stage


@dataclass(frozen=True)
class StageParameters:
    """One stage's parameters as its rank holds them (a tied weight on each stage that uses it)."""

    parameter_bytes: int
    trainable_bytes: int


def stage_parameters(
    model: nn.Module, block_names: Sequence[str], cuts: Sequence[int]
) -> list[StageParameters]:
    """Parameter bytes per stage. A block's go to its stage; a module outside the blocks goes with the
    last block registered before it (registration order standing for execution order), so embeddings
    go to the first stage and the final norm and head to the last. A weight tied between both ends
    counts on both, as torch's tracer gives each stage that uses it a copy."""
    stage_of_block = {name: sum(1 for cut in cuts if cut <= i) for i, name in enumerate(block_names)}
    totals = [[0, 0] for _ in range(len(cuts) + 1)]
    seen: set[tuple[int, int]] = set()
    position = 0
    for name, module in model.named_modules():
        position = stage_of_block.get(name, position)
        for parameter in module._parameters.values():
            if parameter is None or (position, id(parameter)) in seen:
                continue
            seen.add((position, id(parameter)))
            size = parameter.numel() * parameter.element_size()
            totals[position][0] += size
            totals[position][1] += size if parameter.requires_grad else 0
    return [StageParameters(total, trainable) for total, trainable in totals]


# ---------------------------------------------------------------------- one stage


@dataclass(frozen=True)
class _Option:
    policy: str
    kept_bytes: int
    first_peak_bytes: int  # peak_k + G_k in the window's first backward
    steady_peak_bytes: int  # peak_k + every gradient of the stage
    seconds: float  # forward + backward + recompute


@dataclass(frozen=True)
class StageChoice:
    """A policy per block of one stage and what it costs at one micro-batch size."""

    policies: tuple[tuple[str, str], ...]
    kept_bytes: int
    first_chain_bytes: int
    steady_chain_bytes: int
    seconds: float
    extra_seconds: float  # the recompute's share of ``seconds``

    def activation_peak(self, held_first: int, held_steady: int | None) -> int:
        """The stage's activation peak with ``held_*`` other micro-batches in flight (module docstring)."""
        first = held_first * self.kept_bytes + self.first_chain_bytes
        if held_steady is None:
            return first
        return max(first, held_steady * self.kept_bytes + self.steady_chain_bytes)


def _options(
    segments: Sequence[SegmentProfile],
    size: int,
    gradient_bytes: int,
    policies: Sequence[str] | None,
) -> list[list[_Option]]:
    """Per segment its options; G_k as the module docstring says (backward runs the segments in reverse).

    A stage after the first begins at a block whose input torch's receive buffer holds (in fixed_s):
    a credit for that input dying after the block (SegmentProfile.freed_input_bytes) is taken back.
    """
    later = 0
    result: list[list[_Option]] = []
    for position, segment in reversed(list(enumerate(segments))):
        held_input = math.ceil(segment.freed_input_bytes(size)) if position == 0 and segment.is_block else 0
        base = segment.costs[NONE]
        forward = base.forward_seconds(size)
        options = []
        for policy, cost in segment.costs.items():
            if policy != NONE and policies is not None and policy not in policies:
                continue
            extra = 0.0
            if policy != NONE:
                extra = max(
                    RECOMPUTE_FLOOR.get(policy, 1.0) * forward, cost.seconds(size) - base.seconds(size)
                )
            options.append(
                _Option(
                    policy=policy,
                    kept_bytes=math.ceil(max(cost.kept(size), cost.kept(size, first=True)))
                    + (held_input if policy == NONE else 0),
                    first_peak_bytes=math.ceil(cost.peak(size, first=True)) + later,
                    steady_peak_bytes=math.ceil(cost.peak(size)) + gradient_bytes,
                    seconds=base.seconds(size) + extra,
                )
            )
        result.append(options)
        later += segment.gradient_bytes
    result.reverse()
    return result


def solve_stage(
    segments: Sequence[SegmentProfile],
    *,
    size: int,
    gradient_bytes: int,
    held_first: int,
    held_steady: int | None,
    capacity_bytes: float,
    policies: Sequence[str] | None = None,
    output_bytes: int = 0,
) -> StageChoice | None:
    """The fastest policy per block of one stage whose activation peak fits ``capacity_bytes``.

    Dynamic programming over the stage's segments with the states (P, first chain, steady chain,
    seconds) that no other state beats in all four: the peak depends on the past only through
    them. ``output_bytes``: kept by each micro-batch before its first segment (the last stage's output,
    which torch's stage keeps for its backward where one process frees it after the loss). None when
    nothing fits.
    """
    table = _options(segments, size, gradient_bytes, policies)
    states: list[_StageState] = [(output_bytes, 0, 0, 0.0, ())]
    for options in table:
        grown = []
        for kept, first, steady, seconds, choice in states:
            for index, option in enumerate(options):
                state = (
                    kept + option.kept_bytes,
                    max(first, kept + option.first_peak_bytes),
                    max(steady, kept + option.steady_peak_bytes),
                    seconds + option.seconds,
                    (*choice, index),
                )
                # P only grows, so a partial choice over the capacity stays over it.
                if held_first * state[0] + state[1] <= capacity_bytes:
                    grown.append(state)
        if not grown:
            return None
        states = _pareto(grown)
    candidates = [s for s in states if _peak(s, held_first, held_steady) <= capacity_bytes]
    if not candidates:
        return None
    best = min(candidates, key=lambda s: (s[3], _peak(s, held_first, held_steady), s[4]))
    return _choice(segments, table, best)


def least_stage(
    segments: Sequence[SegmentProfile],
    *,
    size: int,
    gradient_bytes: int,
    held_first: int,
    held_steady: int | None,
    policies: Sequence[str] | None = None,
    output_bytes: int = 0,
) -> StageChoice:
    """The policy per block with the lowest activation peak, whatever it costs in time."""
    table = _options(segments, size, gradient_bytes, policies)
    states: list[_StageState] = [(output_bytes, 0, 0, 0.0, ())]
    for options in table:
        states = _pareto(
            [
                (
                    kept + o.kept_bytes,
                    max(first, kept + o.first_peak_bytes),
                    max(steady, kept + o.steady_peak_bytes),
                    seconds + o.seconds,
                    (*choice, i),
                )
                for kept, first, steady, seconds, choice in states
                for i, o in enumerate(options)
            ],
            rank=lambda s: (_peak(s, held_first, held_steady), s[3], s[4]),
        )
    best = min(states, key=lambda s: (_peak(s, held_first, held_steady), s[3], s[4]))
    return _choice(segments, table, best)


def _peak(state: _StageState, held_first: int, held_steady: int | None) -> int:
    first = held_first * state[0] + state[1]
    return first if held_steady is None else max(first, held_steady * state[0] + state[2])


def _fastest(state: _StageState) -> tuple[float, int, int, tuple[int, ...]]:
    return (state[3], state[1], state[2], state[4])


def _pareto(
    states: list[_StageState], rank: Callable[[_StageState], tuple[Any, ...]] = _fastest
) -> list[_StageState]:
    """The states no other one beats in all of (P, first chain, steady chain, seconds); at most MAX_STATES."""
    states.sort(key=lambda s: (s[3], s[0], s[1], s[2], s[4]))
    front: list[_StageState] = []
    for state in states:
        if not any(o[0] <= state[0] and o[1] <= state[1] and o[2] <= state[2] for o in front):
            front.append(state)
    # The planner's one thinning rule (search/thinning.py): per bucket of kept bytes, the least rank.
    return thin(front, MAX_STATES, kept_bytes=lambda s: s[0], rank=rank, solver="stage solver")


def _choice(
    segments: Sequence[SegmentProfile],
    table: Sequence[Sequence[_Option]],
    state: _StageState,
) -> StageChoice:
    chosen = [options[i] for options, i in zip(table, state[4], strict=True)]
    base = sum(next(o.seconds for o in options if o.policy == NONE) for options in table)
    return StageChoice(
        policies=tuple(
            (segment.name, option.policy)
            for segment, option in zip(segments, chosen, strict=True)
            if segment.is_block
        ),
        kept_bytes=state[0],
        first_chain_bytes=state[1],
        steady_chain_bytes=state[2],
        seconds=state[3],
        extra_seconds=state[3] - base,
    )
