"""Choosing a policy per block for one micro-batch size: an exact chain knapsack.

The model is a chain of segments in forward order (embeddings, block 1, ..., block L, head and
loss). Each segment k runs under one option o_k (a checkpoint policy; the parts outside blocks have
a single option) that has three costs:

    kept_bytes[k, o]     bytes it adds to the live set from its forward until its backward
                         (what autograd saves, the boundary a checkpoint keeps, its output)
    peak_bytes[k, o]     the most bytes above the live set it found at its start, while it runs
                         forward or backward (a recomputed block's activations live again here)
    extra_seconds[k, o]  time it adds to an optimizer step over running without checkpointing

With P_k = kept_bytes[1, o_1] + ... + kept_bytes[k, o_k], segment k's forward starts on top of
P_{k-1}, and so does its backward: by then every later segment has released what it kept. So

    activation peak = max_k (P_{k-1} + peak_bytes[k, o_k])

This sharpens "everything kept + the largest transient" (P_L + max_k transient_k, an upper bound
of it): a block recomputed late in the backward pass no longer sits on top of what later blocks
kept, so checkpointing early blocks buys more than checkpointing late ones.

The policy problem for a capacity C is: minimise sum_k extra_seconds[k, o_k] subject to
P_{k-1} + peak_bytes[k, o_k] <= C for every k. Each block picks one of its options (a
multiple-choice knapsack) and the constraint holds at every prefix.

Exact solution: dynamic programming over the chain, keeping after each step the Pareto set of
partial plans (P_k, seconds): a partial plan with no more kept bytes and no more seconds than
another is as good for every continuation, because the later constraints depend on the past only
through P_k. Bytes are integers, so nothing is rounded. A step is a *group* (solve_runs.py): a
run of identical blocks (and the single-option code between them) is one step whose options are
the counts of blocks taking each policy, each priced in the order proven best there. So L
identical blocks with K policies cost C(L + K - 1, K - 1) mixes in one step, not a dynamic
program over L steps of O(L^(K-1)) partial plans each; a chain with no repeats has one group per
block, as before. ``max_states`` bounds the Pareto set for large heterogeneous chains by the one
thinning rule of every policy solver (thinning.py, which proves what it gives up).

``frontier`` keeps the Pareto set of (P_k, peak so far, seconds) in one pass (a partial plan no
worse in all three is as good for every continuation: the final peak is max(peak so far, P_k +
what follows)), and the final (peak, seconds) Pareto set is the frontier.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...profile.costs import chain_peak
from . import solve_runs
from .thinning import thin

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATES = 4096


@dataclass(frozen=True)
class Option:
    """One way to run a segment: its policy name and its three costs (see the module docstring)."""

    policy: str
    kept_bytes: int
    peak_bytes: int
    extra_seconds: float


@dataclass(frozen=True)
class Segment:
    """A part of the model in forward order, with the options it may run under."""

    name: str
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Solution:
    """A choice of one option per segment: ``choice[k]`` indexes ``segments[k].options``."""

    choice: tuple[int, ...]
    extra_seconds: float
    peak_bytes: int  # activation peak, max_k (P_{k-1} + peak_bytes[k, o_k])
    kept_bytes: int  # P_L, what the whole forward keeps

    def policies(self, segments: Sequence[Segment]) -> dict[str, str]:
        return {
            segment.name: segment.options[i].policy for segment, i in zip(segments, self.choice, strict=True)
        }


def evaluate(segments: Sequence[Segment], choice: Sequence[int]) -> Solution:
    """The costs of one choice, summed in chain order (the order the solver sums in).

    The peak is ``chain_peak``, the one definition the profile uses too.
    """
    options = [segment.options[index] for segment, index in zip(segments, choice, strict=True)]
    seconds = 0.0
    for option in options:
        seconds += option.extra_seconds
    peak = int(chain_peak([(option.kept_bytes, option.peak_bytes) for option in options]))
    kept = sum(option.kept_bytes for option in options)
    return Solution(choice=tuple(choice), extra_seconds=seconds, peak_bytes=peak, kept_bytes=kept)


@dataclass
class _State:
    kept_bytes: int
    seconds: float
    peak_bytes: int
    choice: tuple[int, ...]  # the mix index taken in each group so far


def _pareto(states: list[_State]) -> list[_State]:
    """States not dominated in (kept_bytes, seconds); ties broken by the lower peak, then the choice."""
    states.sort(key=lambda s: (s.kept_bytes, s.seconds, s.peak_bytes, s.choice))
    front: list[_State] = []
    best_seconds = math.inf
    for state in states:
        if state.seconds < best_seconds:
            front.append(state)
            best_seconds = state.seconds
    return front


def _thin(states: list[_State], max_states: int) -> list[_State]:
    """thinning.thin's buckets of kept bytes, the fastest in each (then the lowest peak)."""
    kept = thin(
        states,
        max_states,
        kept_bytes=lambda s: s.kept_bytes,
        rank=lambda s: (s.seconds, s.peak_bytes, s.choice),
        solver="policy solver",
    )
    return kept if len(kept) == len(states) else _pareto(kept)


def _groups(segments: Sequence[Segment]) -> list[solve_runs.Group]:
    empty = [segment.name for segment in segments if not segment.options]
    if empty:
        raise ConfigError(f"policy solver: segment(s) {', '.join(empty)} have no options")
    return solve_runs.groups(segments)


def _expand(groups: Sequence[solve_runs.Group], choice: Sequence[int]) -> tuple[int, ...]:
    """Mix indices per group -> one option index per real segment, in forward order."""
    expanded: list[int] = []
    for group, index in zip(groups, choice, strict=True):
        expanded.extend(group.expand(group.mixes[index]))
    return tuple(expanded)


def solve(
    segments: Sequence[Segment], capacity_bytes: float, *, max_states: int = DEFAULT_MAX_STATES
) -> Solution | None:
    """A choice with the least extra seconds whose activation peak is <= capacity_bytes.

    None when nothing fits. Equally fast choices are told apart by peak only among those the
    pruning keeps; ``frontier`` gives the lowest peak for each time exactly.
    """
    groups = _groups(segments)
    states = [_State(kept_bytes=0, seconds=0.0, peak_bytes=0, choice=())]
    for group in groups:
        grown: list[_State] = []
        for state in states:
            room = capacity_bytes - state.kept_bytes
            for index, mix in enumerate(group.mixes):
                if mix.peak_bytes > room:
                    continue
                grown.append(
                    _State(
                        kept_bytes=state.kept_bytes + mix.kept_bytes,
                        seconds=state.seconds + mix.extra_seconds,
                        peak_bytes=max(state.peak_bytes, state.kept_bytes + mix.peak_bytes),
                        choice=(*state.choice, index),
                    )
                )
        if not grown:
            return None
        states = _thin(_pareto(grown), max_states)
    best = min(states, key=lambda s: (s.seconds, s.peak_bytes, s.choice))
    # Recompute the sums in chain order so equal choices report bit-identical costs.
    return evaluate(segments, _expand(groups, best.choice))


def minimum_peak(segments: Sequence[Segment]) -> Solution:
    """The choice with the lowest activation peak, whatever it costs in time.

    Dynamic programming over the groups with the Pareto set of (P_k, peak so far): a partial plan
    that keeps no more and has peaked no higher than another is as good for every continuation.
    """
    groups = _groups(segments)
    # (kept, peak, seconds, choice), pruned to the states no other beats in both kept and peak.
    states: list[tuple[int, int, float, tuple[int, ...]]] = [(0, 0, 0.0, ())]
    for group in groups:
        grown = [
            (
                kept + mix.kept_bytes,
                max(peak, kept + mix.peak_bytes),
                seconds + mix.extra_seconds,
                (*choice, i),
            )
            for kept, peak, seconds, choice in states
            for i, mix in enumerate(group.mixes)
        ]
        grown.sort(key=lambda state: (state[0], state[1], state[2]))
        states, lowest_peak = [], math.inf
        for state in grown:
            if state[1] < lowest_peak:
                states.append(state)
                lowest_peak = state[1]
        states = thin(
            states,
            DEFAULT_MAX_STATES,
            kept_bytes=lambda state: state[0],
            rank=lambda state: (state[1], state[2], state[3]),
            solver="least-peak solver",
        )
    best = min(states, key=lambda state: (state[1], state[2]))
    return evaluate(segments, _expand(groups, best[3]))


_Partial = tuple[int, int, float, tuple[int, ...]]  # (P_k, peak so far, seconds, mix per group)


def _undominated(states: list[_Partial]) -> list[_Partial]:
    """The states no other beats in kept, peak and seconds together (ties: the first in order).

    In order of kept bytes, a state is dominated when an earlier one has peaked no higher and
    taken no longer: the staircase of earlier (peak, seconds) pairs answers that by bisection.
    """
    states.sort()
    peaks: list[int] = []  # ascending
    seconds: list[float] = []  # strictly descending, seconds[i] the least time among peaks <= peaks[i]
    front: list[_Partial] = []
    for state in states:
        _, peak, time, _ = state
        below = bisect.bisect_right(peaks, peak) - 1
        if below >= 0 and seconds[below] <= time:
            continue
        front.append(state)
        low = bisect.bisect_left(peaks, peak)
        high = low
        while high < len(peaks) and seconds[high] >= time:
            high += 1
        peaks[low:high], seconds[low:high] = [peak], [time]
    return front


def frontier(
    segments: Sequence[Segment], *, max_points: int = 64, max_states: int = DEFAULT_MAX_STATES
) -> list[Solution]:
    """Pareto-optimal choices in (activation peak, extra seconds), fastest first: the fastest
    ``max_points`` of them.

    One pass over the groups with the (kept, peak, seconds) Pareto set (see the module
    docstring). When that set outgrows ``max_states`` (long heterogeneous chains), the points are
    found by solving at a capacity one byte below the previous point's peak instead: every Pareto
    point (p, t) is reached, because the first capacity below the previous peak that is >= p has
    min time t.
    """
    groups = _groups(segments)
    states: list[_Partial] = [(0, 0, 0.0, ())]
    for group in groups:
        grown = [
            (
                kept + mix.kept_bytes,
                max(peak, kept + mix.peak_bytes),
                seconds + mix.extra_seconds,
                (*choice, i),
            )
            for kept, peak, seconds, choice in states
            for i, mix in enumerate(group.mixes)
        ]
        states = _undominated(grown)
        if len(states) > max_states:
            return _frontier_by_solving(segments, max_points=max_points)
    states.sort(key=lambda state: (state[2], state[1], state[3]))
    points: list[Solution] = []
    for _, peak, _, choice in states:
        if len(points) == max_points:
            break
        if not points or peak < points[-1].peak_bytes:
            points.append(evaluate(segments, _expand(groups, choice)))
    return points


def _frontier_by_solving(segments: Sequence[Segment], *, max_points: int) -> list[Solution]:
    points: list[Solution] = []
    capacity: float = math.inf
    while len(points) < max_points:
        found = solve(segments, capacity)
        if found is None:
            break
        if points and found.extra_seconds <= points[-1].extra_seconds:
            points[-1] = found  # same time, lower peak: the earlier point was dominated
        else:
            points.append(found)
        capacity = found.peak_bytes - 1
    return points
