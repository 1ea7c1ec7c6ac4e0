"""The search over micro-batch sizes and policies, on the peak and time model of pricing.py.

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

Ties: predicted times are fits of measured ones, and the profile's times are each run's fastest
timed round, repeated until the two fastest agree (profile/measure.py); what is left, n =
Profile.time_noise, is how far a time could move within one profile. Between separate profiles
predictions move further: gpt-mini at batch 8 within 20 MiB, profiled 8 times on 2 loaded cores
(load 2.5-4.5, one thread's CPU clock), had n = 1.1-4.6 % while the same three plans (3 + 3 + 2
without checkpointing, 4 x 2 with one block full, 8 x 1 with three) took turns as the fastest,
each up to 4.5 % behind in some profile. So plans whose predicted times differ by at most
``tie_for_noise(n)``, 2 n but never less than MIN_TIE_FRACTION (that spread and a margin) nor more than
MAX_TIE_FRACTION, are not told apart: every fitting plan within that fraction of the fastest is
a tie, broken by a fixed rule (``tie_key``): fewer recomputed FLOPs (each checkpointed block weighs
by the share of its forward it recomputes, RECOMPUTE_FLOOR), then the larger micro-batch, then
fewer steps. So the same command on the same machine gives the same plan. What a tie may give
away is bounded twice: by MAX_TIE_FRACTION, and by the hand strategies (hand.py), which are
candidates and bounds: the choice is never predicted slower than any of them. And with a trial
the tie is not the last word: the choice's rivals (fitting plans within RIVAL_REACH ties of the
fastest) are raced on the real model and the fastest measured kept (proof/race.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...profile import NONE, Profile
from . import solve
from .hand import hand_candidates, hand_sizes
from .pricing import BOTH, RECOMPUTE_FLOOR, SAFETY_MARGIN, Candidate, Model, largest
from .splits import EXACT_SEARCH_BATCH, WindowSizes, candidate_sizes

__all__ = [
    "SAFETY_MARGIN",
    "Candidate",
    "Model",
    "SearchResult",
    "choose",
    "config_key",
    "largest",
    "pareto",
    "search",
    "tie_fraction",
    "tie_key",
]

FRONTIER_POINTS = 256  # per micro-batch size
SPLIT_TOLERANCE = 1e-9  # relative: predicted times this close are the same time (see _split)
# Ties are at least this wide: the spread of predicted times between separate profiles (up to
# 4.5 % on 2 loaded cores, above), which one profile's noise underestimates, and a margin: at 5 %
# gpt-mini's 3 + 3 + 2 without checkpointing, 4.5-4.9 % behind the fastest in most profiles, fell
# out of the tie once in 30 plans under pytest at load 2-3 (tests/test_planner.py's noisy-machine test).
MIN_TIE_FRACTION = 0.06
# ... and never wider than this, whatever the noise. A tie gives away up to its width in predicted
# time to buy determinism (at 25 %, up to 22 % measured; issue 32); the hand strategies bound it
# too (a tie never picks a plan predicted slower than one of them).
MAX_TIE_FRACTION = 0.08
# Plans up to this many ties behind the fastest predicted are the choice's rivals in the trial's race
# (proof/race.py): a plan at the tie's edge in one profile is beyond it in the next (gpt-mini's
# 3 + 3 + 2, predicted 4.5-6.5 % behind, measured level with the fastest), so the race looks wider.
RIVAL_REACH = 2


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None  # the chosen candidate within the capacity (see choose); None when nothing fits
    frontier: tuple[Candidate, ...]  # Pareto-optimal in (peak, seconds), fastest first
    minimum: Candidate  # the lowest peak any candidate reaches
    # The fitting plans within RIVAL_REACH ties of the fastest predicted, fastest first, one per
    # configuration: what the trial may race (proof/race.py).
    rivals: tuple[Candidate, ...] = ()
    hands: tuple[Candidate, ...] = ()  # the hand strategies, each at its largest fitting micro-batch


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
    """Relative difference in predicted time up to which two plans are ties (``tie_for_noise``)."""
    return tie_for_noise(profile.time_noise)


def tie_for_noise(noise: float) -> float:
    """2 ``noise`` (two predictions, each off by up to it), within [MIN_TIE_FRACTION, MAX_TIE_FRACTION]."""
    return min(max(2 * noise, MIN_TIE_FRACTION), MAX_TIE_FRACTION)


def choose(
    candidates: Sequence[Candidate], *, tie: float, bounds: Sequence[Candidate] = ()
) -> Candidate | None:
    """The plan to use among ``candidates``: by ``tie_key`` among those within ``tie`` of the fastest
    and no slower than any of ``bounds`` (the hand strategies: never traded for a tie)."""
    if not candidates:
        return None
    limit = _tie_limit(candidates, tie, bounds)
    return min((c for c in candidates if c.seconds_per_step <= limit), key=tie_key)


def ties(candidates: Sequence[Candidate], *, tie: float, bounds: Sequence[Candidate] = ()) -> list[Candidate]:
    """The candidates ``choose`` chooses among, fastest first, one per configuration (config_key)."""
    if not candidates:
        return []
    limit = _tie_limit(candidates, tie, bounds)
    within: dict[tuple[object, ...], Candidate] = {}
    for candidate in sorted(candidates, key=lambda c: (c.seconds_per_step, tie_key(c))):
        if candidate.seconds_per_step <= limit:
            within.setdefault(config_key(candidate), candidate)
    return list(within.values())


def _tie_limit(candidates: Sequence[Candidate], tie: float, bounds: Sequence[Candidate]) -> float:
    """The slowest predicted time still tied with the fastest: within ``tie`` of it, and no slower than
    any of ``bounds`` (but never below the fastest itself)."""
    fastest = min(candidate.seconds_per_step for candidate in candidates)
    ceiling = min((c.seconds_per_step for c in bounds), default=math.inf)
    return max(fastest, min(fastest * (1 + tie), ceiling))


def config_key(candidate: Candidate) -> tuple[object, ...]:
    """What makes two candidates the same configuration: the window's sizes and every block's policy."""
    return (tuple(candidate.micro_batch_sizes), candidate.block_policies)


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

    def splits(b: int) -> list[WindowSizes]:
        """The window cut by b: filled ([b] * (N - 1) + [r]) and balanced, those the rules allow."""
        found = []
        for sizes in (WindowSizes(per_rank_batch, b), WindowSizes(per_rank_batch, b, balanced=True)):
            counts = sizes.counts
            smallest = min(size for size, _ in counts)
            allowed = smallest >= min(min_micro_batch_size, per_rank_batch) and not (even and len(counts) > 1)
            if allowed and sizes not in found:
                found.append(sizes)
        return found

    state = _SearchState(tie_fraction(profile))  # its tie: the choice's, and the rivals' reach
    grid = [b for b in candidate_sizes(per_rank_batch) if splits(b)]
    for b in grid:
        state.add(_price_size(model, splits(b), capacity_bytes))
    # The hand strategies, each at its largest fitting size: always candidates, and bounds (hand.py).
    state.hands = hand_candidates(model, hand_sizes(per_rank_batch, grid, splits), splits, capacity_bytes)
    state.fits.extend(state.hands)
    state.points.extend(state.hands)
    if per_rank_batch > EXACT_SEARCH_BATCH and state.fits and not even:
        _refine(model, state, grid, per_rank_batch, capacity_bytes, splits)
    if state.minimum is None:
        raise ConfigError(f"per_rank_batch must be >= 1, got {per_rank_batch}")
    fits, hands = state.fits, state.hands
    if prefer_large and fits:
        biggest = max(candidate.micro_batch_size for candidate in fits)
        fits = [candidate for candidate in fits if candidate.micro_batch_size == biggest]
        hands = [candidate for candidate in hands if candidate.micro_batch_size == biggest]
    best, rivals = choose(fits, tie=state.tie, bounds=hands), ties(fits, tie=RIVAL_REACH * state.tie)
    frontier = tuple(pareto(state.points))
    return SearchResult(best, frontier, state.minimum, rivals=tuple(rivals), hands=tuple(hands))


class _SearchState:
    def __init__(self, tie: float) -> None:
        self.tie = tie
        self.fits: list[Candidate] = []
        self.minimum: Candidate | None = None
        self.points: list[Candidate] = []
        self.hands: list[Candidate] = []  # the hand strategies (hand.py), also among fits

    @property
    def best(self) -> Candidate | None:
        return choose(self.fits, tie=self.tie, bounds=self.hands)

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
    model: Model, splits: Sequence[WindowSizes], capacity_bytes: float
) -> tuple[list[Candidate], list[Candidate]]:
    """One micro-batch size: its priced candidates, and those within the capacity.

    Each choice is priced on each of the size's splits; the balanced one (the last) is kept
    unless the time model makes it slower (see ``_split``).
    """
    sizes = splits[0]
    # The steady chain's frontier, priced in both phases; and the choice with the lowest peak
    # in both phases together (a chain that bounds both), so the minimum is never missed.
    front = solve.frontier(model.chain(sizes), max_points=FRONTIER_POINTS)
    both = model.chain(sizes, phase=BOTH)
    priced = [_split(model, splits, s.choice) for s in (*front, solve.minimum_peak(both))]
    if model.step_bytes(sizes) > capacity_bytes:
        return priced, []
    fitting = [c for c in priced if c.peak_bytes <= capacity_bytes]
    if not fitting:  # nothing on the frontier fits: the fastest choice that fits both phases
        solution = solve.solve(both, model.room(sizes, capacity_bytes))
        fitting = [_split(model, splits, solution.choice)] if solution is not None else []
    return priced, fitting


def _split(model: Model, splits: Sequence[WindowSizes], choice: Sequence[int]) -> Candidate:
    """``choice`` on the first split, or on a later one that is no slower and peaks no higher.

    The splits of one b have the same steps and largest micro-batch; with time linear in the
    micro-batch size they cost the same, so the balanced split wins unless the fits say otherwise
    (SPLIT_TOLERANCE absorbs the rounding of sums taken in a different order).
    """
    best = model.price(splits[0], choice)
    for sizes in splits[1:]:
        other = model.price(sizes, choice)
        no_slower = other.seconds_per_step <= best.seconds_per_step * (1 + SPLIT_TOLERANCE)
        if no_slower and other.peak_bytes <= best.peak_bytes:
            best = other
    return best


def _refine(
    model: Model,
    state: _SearchState,
    grid: Sequence[int],
    per_rank_batch: int,
    capacity_bytes: float,
    splits: Callable[[int], list[WindowSizes]],
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
        if splits(b) and state.add(_price_size(model, splits(b), capacity_bytes)):
            high_steps = middle
        else:
            low_steps = middle
