"""The peak and time model of a plan, and the search over micro-batch sizes.

A plan runs a rank's share of the batch, B_rank = B / W samples, as N micro-batches of sizes
micro_batch_sizes(B_rank, b) = [b] * (N - 1) + [r] with N = ceil(B_rank / b) and 0 < r <= b, so the
effective batch is exactly B. With the profile's fits, for a choice o (one policy per block):

    seconds_per_step = sum over micro-batches m of (loop(m) + sum_k seconds_k(o_k, m)) + step
    peak_bytes       = max(parameters + optimizer state + base(b) + (1 + margin) * chain peak,
                           static + base(b) + step_peak) + slack + correction
    chain peak       = max_k (P_{k-1} + peak_k(o_k, b) + G_k)

(solve.py defines P_k and the activation term). G_k is the gradient memory live while segment k
runs: all gradients from a window's second micro-batch on (the earlier ones created them); in
its first, only those of the segments after k (backward creates them in reverse order; k's own
are in its measured peak). The first micro-batch also differs in that a checkpoint may keep more
on its first call (selective learns what to skip in its first recompute). So a choice is priced
in both phases (Model.price), and its chain peak is the larger.

For a fixed b the choice is the fastest point of the steady chain's frontier (solve.frontier)
whose two-phase peak fits: exact when the steady phase bounds the first, as without selective
checkpointing. Only the smallest b for each N is searched: with time linear in b, N
micro-batches cost N * a + k * B_rank whatever their split, and the smallest b needs the least
memory; every other b is dominated (the profile's times run through its measurements, Fit.line_beyond:
linear between them, so nearly so).

The search is bounded. Up to EXACT_SEARCH_BATCH samples per rank every such b is tried (about
2 sqrt(B_rank) of them). Above, b runs over every value up to SMALL_SIZES and a geometric grid
(ratio GRID_RATIO) above it, O(log B_rank) sizes; then a bisection over N between the fastest
fitting grid point and the next larger grid size finds the largest b that fits there (fitting is
monotone in b: a larger micro-batch holds more). A window is at most MAX_STEPS_PER_WINDOW
micro-batches, and each is priced from (size, count) pairs, never a list of N sizes.

Ties: predicted times are fits of measured ones, which repeat only to within the profile's noise
n = Profile.time_noise. Two plans' times can each be off by n in opposite directions, so plans
whose predicted times differ by less than 2 n (at least MIN_TIE_FRACTION, at most
MAX_TIE_FRACTION) are not told apart by the measurement: every fitting plan within that fraction
of the fastest is a tie, and ties are broken by a fixed rule (``tie_key``): fewer recomputed FLOPs
(each checkpointed block weighs by the share of its forward it recomputes, RECOMPUTE_FLOOR), then
the larger micro-batch, then fewer steps. So the same command on the same machine gives the same
plan although its timings differ from run to run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..profile import NONE, Profile
from . import solve
from .windows import EXACT_SEARCH_BATCH, WindowSizes, candidate_sizes, size_counts

FRONTIER_POINTS = 256  # per micro-batch size
STEADY, FIRST, BOTH = "steady", "first", "both"  # phases of a window; see Model.chain
# Added to the chain's peak: the loop's few scalars from earlier micro-batches, and the fits'
# error beyond the profiled sizes, stay under it.
SAFETY_MARGIN = 0.01
# Least extra time per policy, as a fraction of the block's forward: full and offload recompute
# the whole forward; selective recomputes its cheap ops, taken as at least a tenth of it.
RECOMPUTE_FLOOR = {"full": 1.0, "offload": 1.0, "selective": 0.1}
# Predicted times closer than this fraction are ties even when the profile's timings repeated
# more closely: their spread between separate runs of the planner is larger than within one.
MIN_TIE_FRACTION = 0.05
# ... and never wider than this: a profile timed on a loaded machine can spread by 1000 % between
# rounds (seen: 18.3 on 2 shared cores), which would call a plan 13 times slower a tie and let the
# tie rule pick it. Beyond this fraction the predicted times are told apart whatever the noise.
MAX_TIE_FRACTION = 0.25


@dataclass(frozen=True)
class Candidate:
    """One point of the search: sizes, a policy per block, and the model's peak and time."""

    micro_batch_sizes: Sequence[int]  # a WindowSizes from the search
    block_policies: tuple[tuple[str, str], ...]
    peak_bytes: int
    seconds_per_step: float
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batch_sizes[0]

    @property
    def steps(self) -> int:
        return len(self.micro_batch_sizes)


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None  # the chosen candidate within the capacity (see choose); None when nothing fits
    frontier: tuple[Candidate, ...]  # Pareto-optimal in (peak, seconds), fastest first
    minimum: Candidate  # the lowest peak any candidate reaches


class Model:
    """The peak and time model of one profile; builds solver chains and prices their solutions."""

    def __init__(
        self,
        profile: Profile,
        *,
        correction_bytes: int = 0,
        safety_margin: float = SAFETY_MARGIN,
        bytes_per_sample: int = 0,
    ) -> None:
        self.profile = profile
        self.correction_bytes = correction_bytes
        self.safety_margin = safety_margin
        self.bytes_per_sample = bytes_per_sample

    def batch_bytes(self, sizes: Sequence[int]) -> int:
        """The largest micro-batch and the loop: the profile's fit, at least the batch's own tensors.

        Beyond the profiled sizes the floor keeps a fit measured on a few small micro-batches (which
        may be views of data already held, so cost nothing) from predicting that a huge micro-batch
        costs nothing; within them the measurement stands.
        """
        b = largest(sizes)
        fitted = math.ceil(self.profile.base_bytes(b))
        if b <= max(self.profile.micro_batch_sizes, default=0):
            return fitted
        return max(fitted, b * self.bytes_per_sample)

    def _gradient_terms(self, steps: int) -> list[int]:
        segments = self.profile.segments
        if steps >= 2:
            return [self.profile.gradient_bytes] * len(segments)
        # G_k = gradients of the segments after k: their backwards, which ran before k's, created them.
        # Segment k's own new gradients are inside its measured peak already: the profiled runs
        # hold all gradients, so each backward made its new gradient as a temporary before adding it.
        terms, running = [0] * len(segments), 0
        for k in range(len(segments) - 1, -1, -1):
            terms[k] = running
            running += segments[k].gradient_bytes
        return terms

    def chain(self, sizes: Sequence[int], *, phase: str = STEADY) -> list[solve.Segment]:
        """Solver segments for a window of micro-batches of ``sizes``: memory per phase, time summed.

        ``phase``: STEADY, a micro-batch after the window's first (all gradients live, checkpoints
        in their steady state); FIRST, the window's first micro-batch (its gradients appear as its
        backward runs) with checkpoints on their first call; BOTH, each option at the larger of the
        two, a chain whose peak bounds both phases.
        """
        # The first phase is the window's first micro-batch; the steady phase the largest later one
        # (with one micro-batch per window, every window's only one: the same size).
        counts = size_counts(sizes)
        first_size = sizes[0]
        # The largest after the first: all sizes but one copy of the first.
        later = [size for size, count in counts if count > (size == first_size)]
        steady_size = max(later, default=first_size)
        steady_gradients = self._gradient_terms(len(sizes))
        first_gradients = self._gradient_terms(1)
        chain = []
        for k, segment in enumerate(self.profile.segments):
            base = segment.costs[NONE]
            base_seconds = sum(n * base.seconds(m) for m, n in counts)
            forward_seconds = sum(n * base.forward_seconds(m) for m, n in counts)
            options = []
            for policy, cost in segment.costs.items():
                extra = 0.0
                if policy != NONE:
                    # A recompute repeats (part of) the forward: a smaller measured cost is noise.
                    floor = RECOMPUTE_FLOOR.get(policy, 1.0) * forward_seconds
                    extra = max(floor, sum(n * cost.seconds(m) for m, n in counts) - base_seconds)
                steady = (cost.kept(steady_size), cost.peak(steady_size) + steady_gradients[k])
                first = (
                    cost.kept(first_size, first=True),
                    cost.peak(first_size, first=True) + first_gradients[k],
                )
                if phase == STEADY:
                    kept, peak = steady
                elif phase == FIRST:
                    kept, peak = first
                else:
                    kept, peak = max(steady[0], first[0]), max(steady[1], first[1])
                options.append(
                    solve.Option(
                        policy=policy,
                        kept_bytes=math.ceil(kept),
                        peak_bytes=math.ceil(peak),
                        extra_seconds=extra,
                    )
                )
            chain.append(solve.Segment(name=segment.name, options=tuple(options)))
        return chain

    def base_seconds(self, sizes: Sequence[int]) -> float:
        """Seconds per step with no block checkpointed."""
        total = self.profile.step_seconds
        for m, n in size_counts(sizes):
            total += n * self.profile.loop_seconds(m)
            total += n * sum(segment.costs[NONE].seconds(m) for segment in self.profile.segments)
        return total

    def fixed_bytes(self, sizes: Sequence[int]) -> int:
        """Bytes live under the activations: parameters, optimizer state, the batches, the correction."""
        profile = self.profile
        return (
            profile.parameter_bytes
            + profile.optimizer_bytes
            + self.batch_bytes(sizes)
            + profile.slack_bytes
            + profile.reserved_overhead(max(sizes))
            + self.correction_bytes
        )

    def step_bytes(self, sizes: Sequence[int]) -> int:
        """Peak of the optimizer step: static memory, the batch, and the step's own temporaries."""
        profile = self.profile
        return (
            profile.static_bytes
            + self.batch_bytes(sizes)
            + profile.step_peak_bytes
            + profile.slack_bytes
            + profile.reserved_overhead(max(sizes))  # the micro-batches' cached segments (CUDA)
            + self.correction_bytes
        )

    def activation_bytes(self, chain_peak_bytes: int) -> int:
        """The chain's peak (activations and the gradients live with them) with the safety margin."""
        return math.ceil(chain_peak_bytes * (1 + self.safety_margin))

    def room(self, sizes: Sequence[int], capacity_bytes: float) -> float:
        """The largest chain peak whose plan stays within ``capacity_bytes``."""
        room = (capacity_bytes - self.fixed_bytes(sizes)) / (1 + self.safety_margin)
        return math.floor(room) if math.isfinite(room) else room

    def price(self, sizes: Sequence[int], choice: Sequence[int]) -> Candidate:
        """A choice of one option per segment (indices as in ``chain``) with its peak and time."""
        profile = self.profile
        steady = solve.evaluate(self.chain(sizes, phase=STEADY), choice)
        first = solve.evaluate(self.chain(sizes, phase=FIRST), choice)
        chain_peak = max(steady.peak_bytes, first.peak_bytes)
        fixed = self.fixed_bytes(sizes)
        chain_bytes = self.activation_bytes(chain_peak)
        parts = {**profile.static_parts(), "batch and loop": self.batch_bytes(sizes)}
        if fixed + chain_bytes >= self.step_bytes(sizes):
            margin = chain_bytes - chain_peak
            # The chain's peak holds the gradients that are live then; the rest of it is activations.
            # (fixed holds the slack and the correction too: they are parts of their own below)
            outside = sum(parts.values()) + profile.slack_bytes + self.correction_bytes
            outside += profile.reserved_overhead(max(sizes))
            parts["activations"] = fixed + chain_bytes - margin - outside
            if margin:
                parts[f"safety margin ({self.safety_margin:.0%})"] = margin
        else:
            parts["optimizer step temporaries"] = profile.step_peak_bytes
        if profile.slack_bytes:
            parts["slack"] = profile.slack_bytes
        if profile.reserved_overhead(max(sizes)):
            parts["caching allocator (reserved - live)"] = profile.reserved_overhead(max(sizes))
        if self.correction_bytes:
            parts["correction from trials"] = self.correction_bytes
        policies = tuple(
            (segment.name, segment.policies[index])
            for segment, index in zip(profile.segments, choice, strict=True)
            if segment.is_block
        )
        return Candidate(
            micro_batch_sizes=sizes if isinstance(sizes, WindowSizes) else tuple(sizes),
            block_policies=policies,
            peak_bytes=max(fixed + chain_bytes, self.step_bytes(sizes)),
            seconds_per_step=self.base_seconds(sizes) + steady.extra_seconds,
            parts=tuple(parts.items()),
        )

    def evaluate(self, sizes: Sequence[int], policies: dict[str, str]) -> Candidate:
        """The model's peak and time for given sizes and block policies (blocks not named: none)."""
        choice = []
        for segment in self.profile.segments:
            wanted = policies.get(segment.name, NONE)
            choice.append(segment.policies.index(wanted) if wanted in segment.policies else 0)
        return self.price(sizes, choice)


def largest(sizes: Sequence[int]) -> int:
    return max(size for size, _ in size_counts(sizes))


def recomputed_blocks(block_policies: Sequence[tuple[str, str]]) -> float:
    """Blocks recomputed in backward, each weighted by the share of its forward it repeats."""
    return sum(RECOMPUTE_FLOOR.get(policy, 1.0) for _, policy in block_policies if policy != NONE)


def tie_key(candidate: Candidate) -> tuple[float, int, int, tuple[tuple[str, str], ...]]:
    """The order among tied plans: fewer recomputed FLOPs, larger micro-batch, fewer steps."""
    return (
        recomputed_blocks(candidate.block_policies),
        -candidate.micro_batch_size,
        candidate.steps,
        candidate.block_policies,
    )


def tie_fraction(profile: Profile) -> float:
    """Relative difference in predicted time below which two plans are ties: 2 n, within 5-25 %."""
    return tie_for_noise(profile.time_noise)


def tie_for_noise(noise: float) -> float:
    """2 ``noise`` (two predictions each off by it), kept within [MIN_TIE_FRACTION, MAX_TIE_FRACTION]."""
    return min(max(2 * noise, MIN_TIE_FRACTION), MAX_TIE_FRACTION)


def choose(candidates: Sequence[Candidate], *, tie: float) -> Candidate | None:
    """The plan to use among ``candidates``: by ``tie_key`` among those within ``tie`` of the fastest."""
    if not candidates:
        return None
    fastest = min(candidate.seconds_per_step for candidate in candidates)
    tied = [c for c in candidates if c.seconds_per_step <= fastest * (1 + tie)]
    return min(tied, key=tie_key)


def pareto(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates not dominated in (peak_bytes, seconds_per_step), fastest first."""
    ordered = sorted(candidates, key=lambda c: (c.seconds_per_step, c.peak_bytes, -c.micro_batch_size))
    front: list[Candidate] = []
    for candidate in ordered:
        if not front or candidate.peak_bytes < front[-1].peak_bytes:
            front.append(candidate)
    return front


def search(
    profile: Profile,
    *,
    per_rank_batch: int,
    capacity_bytes: float,
    correction_bytes: int = 0,
    safety_margin: float = SAFETY_MARGIN,
    min_micro_batch_size: int = 1,
    even: bool = False,
    prefer_large: bool = False,
    bytes_per_sample: int = 0,
) -> SearchResult:
    """The fastest plan (up to ties) whose predicted peak is <= capacity_bytes, the frontier, the minimum.

    Only splits whose every micro-batch has >= ``min_micro_batch_size`` samples are searched, and with
    ``even`` only those of equal micro-batches (micro x steps == per_rank_batch). ``prefer_large``:
    the largest micro-batch that fits wins, then the fastest (BatchNorm normalises per micro-batch).
    ``bytes_per_sample``: the tensor bytes of one sample of the batch, a floor under the batch's
    share of the peak beyond the profiled sizes (see Model.batch_bytes).
    """
    if isinstance(per_rank_batch, bool) or not isinstance(per_rank_batch, int) or per_rank_batch < 1:
        raise ConfigError(f"per_rank_batch must be >= 1, got {per_rank_batch}")
    model = Model(
        profile,
        correction_bytes=correction_bytes,
        safety_margin=safety_margin,
        bytes_per_sample=bytes_per_sample,
    )

    def allowed(b: int) -> bool:
        counts = WindowSizes(per_rank_batch, b).counts
        smallest = min(size for size, _ in counts)
        return smallest >= min(min_micro_batch_size, per_rank_batch) and not (even and len(counts) > 1)

    state = _SearchState(tie_fraction(profile))
    grid = [b for b in candidate_sizes(per_rank_batch) if allowed(b)]
    for b in grid:
        state.add(_price_size(model, WindowSizes(per_rank_batch, b), capacity_bytes))
    if per_rank_batch > EXACT_SEARCH_BATCH and state.fits and not even:
        _refine(model, state, grid, per_rank_batch, capacity_bytes, allowed)
    if state.minimum is None:
        raise ConfigError(f"per_rank_batch must be >= 1, got {per_rank_batch}")
    fits = state.fits
    if prefer_large and fits:
        biggest = max(candidate.micro_batch_size for candidate in fits)
        fits = [candidate for candidate in fits if candidate.micro_batch_size == biggest]
    best = choose(fits, tie=tie_fraction(profile))
    return SearchResult(best=best, frontier=tuple(pareto(state.points)), minimum=state.minimum)


class _SearchState:
    def __init__(self, tie: float) -> None:
        self.tie = tie
        self.fits: list[Candidate] = []
        self.minimum: Candidate | None = None
        self.points: list[Candidate] = []

    @property
    def best(self) -> Candidate | None:
        return choose(self.fits, tie=self.tie)

    def add(self, priced_fitting: tuple[list[Candidate], list[Candidate]]) -> bool:
        """Record one size's candidates; True when some of them fit."""
        priced, fitting = priced_fitting
        lowest = min(priced, key=lambda c: (c.peak_bytes, c.seconds_per_step))
        if self.minimum is None or lowest.peak_bytes < self.minimum.peak_bytes:
            self.minimum = lowest
        self.points.extend(priced)
        self.fits.extend(fitting)
        return bool(fitting)


def _price_size(
    model: Model, sizes: WindowSizes, capacity_bytes: float
) -> tuple[list[Candidate], list[Candidate]]:
    """One micro-batch size: its priced candidates, and those within the capacity."""
    # The steady chain's frontier, priced in both phases; and the choice with the lowest peak
    # in both phases together (a chain that bounds both), so the minimum is never missed.
    front = solve.frontier(model.chain(sizes), max_points=FRONTIER_POINTS)
    both = model.chain(sizes, phase=BOTH)
    priced = [model.price(sizes, s.choice) for s in (*front, solve.minimum_peak(both))]
    if model.step_bytes(sizes) > capacity_bytes:
        return priced, []
    fitting = [c for c in priced if c.peak_bytes <= capacity_bytes]
    if not fitting:  # nothing on the frontier fits: the fastest choice that fits both phases
        solution = solve.solve(both, model.room(sizes, capacity_bytes))
        fitting = [model.price(sizes, solution.choice)] if solution is not None else []
    return priced, fitting


def _refine(
    model: Model,
    state: _SearchState,
    grid: Sequence[int],
    per_rank_batch: int,
    capacity_bytes: float,
    allowed: Callable[[int], bool],
) -> None:
    """Bisect N between the best grid size and the next larger one: the largest b that fits there."""
    best = state.best
    if best is None:
        return
    larger = [b for b in grid if b > best.micro_batch_size]
    if not larger:
        return
    # Fitting is monotone in b; find the smallest N in (N(larger), N(best)) whose b still fits.
    low_steps = -(-per_rank_batch // min(larger))  # too few steps: did not fit (or was not best)
    high_steps = -(-per_rank_batch // best.micro_batch_size)
    while high_steps - low_steps > 1:
        middle = (low_steps + high_steps) // 2
        b = -(-per_rank_batch // middle)
        if allowed(b) and state.add(_price_size(model, WindowSizes(per_rank_batch, b), capacity_bytes)):
            high_steps = middle
        else:
            low_steps = middle
