"""Runs of identical blocks, solved by how many blocks take each option instead of by sequences.

solve.py's chain (segments in forward order, option o of segment k costing kept_bytes,
peak_bytes, extra_seconds) is cut here into *groups*, and each group offers *mixes*: ways to run
all of its segments, each with its kept bytes, its peak above what was kept before it, and its
seconds. The solver's dynamic program then runs over groups; its Pareto arguments (solve.py)
hold for a group exactly as for one segment, since only a mix's three costs reach the rest of
the chain.

**Units.** A segment with a single option (the code between two blocks, the embeddings) joins
the next segment: a unit is a span of single-option segments ending in one that may have many
(a trailing span of single-option segments is a unit of its own). Unit option o runs the span's
last segment under its option o and the others under their only one; its costs compose as a
chain (kept summed, peak max_j(P_{j-1} + peak_j) within the span, seconds summed).

**Runs.** Units u_0, ..., u_{n-1} in a row form a run when they have the same number of options
with equal kept bytes and seconds per option, and peaks that drift by one constant d per unit:
peak(u_j, o) = peak(u_0, o) - j d for every o. Identical blocks have d = 0. The window's first
micro-batch has d = the gradient bytes of one block: block j's backward sees only the gradients
of the blocks after it (planner/search/sizes.py's G_k), one block fewer per step along the chain.

**Counts suffice.** Let a run start on top of P kept bytes and let its units take options
o_0, ..., o_{n-1}. Unit j peaks at

    P + sum_{i<j} kept(o_i) + peak(u_0, o_j) - j d  =  P + sum_{i<j} k'(o_i) + p(o_j)

with k'(o) = kept(o) - d and p(o) = peak(u_0, o). The run's seconds and its total kept bytes are
sums, so they depend only on how many units take each option (the counts c_o), not their order;
later segments see the run only through its total kept bytes. Only the run's own peak,
max_j(sum_{i<j} k'(o_i) + p(o_j)), depends on the order, and the order that minimises it is
the one sorted by

    key(o) = (0, p(o))              when k'(o) < 0  (units that lower the level first, low peak first)
             (1, -(p(o) - k'(o)))   when k'(o) >= 0 (then by peak_bytes - kept_bytes, descending)

Proof (adjacent exchange). Swap the options a, b at positions j, j+1. Every other position's
term is unchanged: those before j see the same prefix, those after j+1 the same prefix sum
k'(a) + k'(b). The pair contributes max(p_a, k'_a + p_b) in order ab and max(p_b, k'_b + p_a)
in order ba. Order ab is no worse when key(a) <= key(b):
  - k'_a, k'_b >= 0 and p_a - k'_a >= p_b - k'_b: then k'_a + p_b <= k'_b + p_a, and
    p_a <= k'_b + p_a, so max(p_a, k'_a + p_b) <= k'_b + p_a <= max(p_b, k'_b + p_a).
  - k'_a < 0 <= k'_b: max(p_a, k'_a + p_b) <= max(p_a, p_b) <= max(p_b, k'_b + p_a).
  - k'_a, k'_b < 0 and p_a <= p_b: max(p_a, k'_a + p_b) <= p_b <= max(p_b, k'_b + p_a).
(Equal keys give equal values both ways.) Any order becomes the sorted one by adjacent swaps
of out-of-order pairs (bubble sort), none raising the peak; so for each count vector the sorted
order is optimal, and its peak has a closed form: the c_o copies of option o placed from level S
peak at S + p(o) + max(0, (c_o - 1) k'(o)). With d = 0 (identical blocks) every k' = kept >= 0
and the key is the peak_bytes - kept_bytes order, descending. This is the rule for scheduling
jobs to minimise the maximum cumulative cost (Abdel-Wahab and Kameda 1978), specialised.

So a run of n units with K options offers C(n + K - 1, K - 1) mixes, each priced in O(K): for 31
identical decoder layers with none / selective / full, 528 mixes instead of a search over 3^31
sequences (or the O(n^2) Pareto states per layer of a dynamic program over them).
``Group.expand`` turns a mix back into one option per real segment, in forward order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


class _Option(Protocol):
    @property
    def kept_bytes(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def extra_seconds(self) -> float: ...


class _Segment(Protocol):
    @property
    def options(self) -> Sequence[_Option]: ...


@dataclass(frozen=True)
class Mix:
    """One way to run a group: its kept bytes, its peak above the level it starts on, its seconds."""

    kept_bytes: int
    peak_bytes: int
    extra_seconds: float
    counts: tuple[int, ...]  # units taking each option


@dataclass(frozen=True)
class Unit:
    """Segments ``start`` .. ``stop - 1``; only the last may have several options."""

    start: int
    stop: int
    costs: tuple[tuple[int, int, float], ...]  # (kept, peak, seconds) per option of the last


@dataclass(frozen=True)
class Group:
    """A run of units (see the module docstring) and the mixes it offers."""

    units: tuple[Unit, ...]
    drift_bytes: int  # d: each unit peaks d bytes lower than the one before, option for option
    mixes: tuple[Mix, ...]

    def expand(self, mix: Mix) -> tuple[int, ...]:
        """One option index per real segment of the group, in forward order (the sorted order)."""
        order = [
            o for o in _sorted_options(self.units[0].costs, self.drift_bytes) for _ in range(mix.counts[o])
        ]
        choice: list[int] = []
        for unit, option in zip(self.units, order, strict=True):
            choice.extend([0] * (unit.stop - unit.start - 1))
            choice.append(option)
        return tuple(choice)


def _unit_costs(segments: Sequence[_Segment], start: int, stop: int) -> tuple[tuple[int, int, float], ...]:
    """Each option of the span's last segment, composed with the only options of the others."""
    head_kept, head_seconds = 0, 0.0
    head_peak: int | None = None  # the highest of the span's earlier segments, above its start
    for segment in segments[start : stop - 1]:
        only = segment.options[0]
        top = head_kept + only.peak_bytes
        head_peak = top if head_peak is None else max(head_peak, top)
        head_kept += only.kept_bytes
        head_seconds += only.extra_seconds
    costs = []
    for option in segments[stop - 1].options:
        peak = head_kept + option.peak_bytes
        costs.append(
            (
                head_kept + option.kept_bytes,
                peak if head_peak is None else max(head_peak, peak),
                head_seconds + option.extra_seconds,
            )
        )
    return tuple(costs)


def units(segments: Sequence[_Segment]) -> list[Unit]:
    """The chain cut into units: single-option segments join the next segment."""
    found: list[Unit] = []
    start = 0
    for index, segment in enumerate(segments):
        if len(segment.options) > 1 or index == len(segments) - 1:
            found.append(Unit(start, index + 1, _unit_costs(segments, start, index + 1)))
            start = index + 1
    return found


def _drift(before: Unit, after: Unit) -> int | None:
    """d when ``after`` repeats ``before`` with every peak d lower; None when it does not."""
    if len(before.costs) != len(after.costs):
        return None
    drifts = set()
    for (kept_a, peak_a, seconds_a), (kept_b, peak_b, seconds_b) in zip(
        before.costs, after.costs, strict=True
    ):
        if kept_a != kept_b or seconds_a != seconds_b:
            return None
        drifts.add(peak_a - peak_b)
    return drifts.pop() if len(drifts) == 1 else None


def groups(segments: Sequence[_Segment]) -> list[Group]:
    """Maximal runs of units, left to right, each with its mixes."""
    cut = units(segments)
    found: list[Group] = []
    index = 0
    while index < len(cut):
        stop, drift = index + 1, 0
        if index + 1 < len(cut):
            step = _drift(cut[index], cut[index + 1])
            if step is not None:
                drift, stop = step, index + 2
                while stop < len(cut) and _drift(cut[stop - 1], cut[stop]) == drift:
                    stop += 1
        run = tuple(cut[index:stop])
        found.append(Group(run, drift, tuple(mixes(run[0].costs, len(run), drift))))
        index = stop
    return found


def _sorted_options(costs: Sequence[tuple[int, int, float]], drift_bytes: int) -> list[int]:
    """Option indices in the order that minimises a run's peak (the module docstring's key)."""

    def key(option: int) -> tuple[int, int, int]:
        kept, peak, _ = costs[option]
        level = kept - drift_bytes
        return (0, peak, option) if level < 0 else (1, level - peak, option)

    return sorted(range(len(costs)), key=key)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` non-negative integers summing to ``total``."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total, -1, -1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def mixes(costs: Sequence[tuple[int, int, float]], count: int, drift_bytes: int) -> Iterator[Mix]:
    """Every count vector of ``count`` units over the options, priced in its sorted order."""
    order = _sorted_options(costs, drift_bytes)
    for counts in _compositions(count, len(costs)):
        level, peak, kept, seconds = 0, None, 0, 0.0
        for option in order:
            copies = counts[option]
            if not copies:
                continue
            option_kept, option_peak, option_seconds = costs[option]
            step = option_kept - drift_bytes
            top = level + option_peak + max(0, (copies - 1) * step)
            peak = top if peak is None else max(peak, top)
            level += copies * step
            kept += copies * option_kept
            seconds += copies * option_seconds
        if peak is None:  # count >= 1, so some option has copies: reaching here is a bug of ours
            raise RuntimeError(f"internal error: a run of {count} blocks priced with no copies")
        yield Mix(kept_bytes=kept, peak_bytes=peak, extra_seconds=seconds, counts=counts)
