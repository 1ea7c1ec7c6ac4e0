"""The race: plans the search cannot tell apart, each timed on the real model, the fastest kept.

The search's predicted times are fits of a profile, and two profiles of one model on a busy machine
disagree by a few per cent (search/sizes.py): plans within its tie (6-8 %) are chosen by a fixed
order (tie_key), which gives away what separates them. Issue 32 measured the cost (the tie's
choice up to 1.22x slower than the search's fastest) and asked for the remedy used here: when the
choice has rivals within the tie, time each in whole windows of the real model and keep the
fastest measured.

Who races: the choice, its rivals (fitting plans predicted within search.RIVAL_REACH ties of the
fastest: the fastest predicted, the first in the tie order) and the hand strategies that fit only
without the safety margin (choices.hands_within_margin: issue 32's cause 3, a hand strategy
predicted a hair over the budget that measures within it and was never tried). Each besides the
proved choice first gets the planner's memory trial: one over the budget, or out of memory, is out.
The trial runs a window's first two micro-batches; each contender's first race window runs whole
under the tracker, and one whose whole window peaks over the budget is out too (efficientnet_b0's
8 x 4 measured 39.00 MB in its trial and 39.30 MB over its window, budget 39.03 MB).
After an out-of-memory trial there is no race (the device holds less than the model predicts;
every further try risks another).

A race is decided by measurements of the plans themselves, not by a model of them, so its noise is
what one plan's windows spread. Each contender runs an untimed window, then RACE_ROUNDS timed ones
(a window right after another plan's measured 8.7-10.5 % slower on gpt-mini and the tiny Llama:
benchmarks/planner_real.py); while the race is noisy, more rounds in rotated order, each timed
window after an untimed one. A contender's time is its fastest timed window (the least disturbed),
its noise the gap to its second fastest. Measured times within ``2 x the largest noise`` (at least
RACE_MIN_TIE, at most the search's MAX_TIE_FRACTION) of the fastest are still ties, broken by the
same tie_key: the same command on the same machine picks the same plan as long as the plans' real
difference is not near that narrow edge.

The clock is the profile's (one thread's CPU time on a CPU device, so other jobs' load does not
enter it; the wall clock with the device synchronized elsewhere). The race's windows take at most
RACE_COST_SHARE x the profile's time or RACE_FREE_SECONDS, whichever is longer (predicted):
contenders past that are left out, most wanted first in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...memory import format_bytes
from ...profile import Profile
from ...profile.clocks import AUTO, CPU, profiling_clock
from ...workload import Workload
from ..options import PlanOptions
from ..result.plans import summarize_policies
from ..search.sizes import MAX_TIE_FRACTION, Candidate, config_key, tie_key
from .trial_run import TimedWindows, TrialResult, attempt_trial, time_windows

# time_windows(candidate, clock, windows, track_first): trial_run.time_windows on the plan's options.
WindowTimer = Callable[[Candidate, Callable[[], float], int, bool], TimedWindows]

RACE_CONTENDERS = 3  # the choice and two rivals (contenders_besides)
RACE_NEAR_MARGIN = 2  # ... and up to two hand strategies that fit only without the safety margin
RACE_ROUNDS = 3  # timed windows per contender, after an untimed one
RACE_MAX_ROUNDS = 6  # ... and more, up to this, while the race's tie is wider than RACE_SETTLED_TIE
RACE_SETTLED_TIE = 0.04
RACE_MIN_TIE = 0.04  # measured times closer than this are ties: gpt-mini windows 60 ms long spread 2-4 %,
# and at a 2 % floor 2 x 4 once beat 3 + 3 + 2 by one quiet round (the noisy-machine test)
RACE_COST_SHARE = 1.0  # a race takes at most this share of the profile's time (predicted)
RACE_FREE_SECONDS = 10.0  # ... or this, whichever is longer: contenders past it are left out


@dataclass(frozen=True)
class RaceResult:
    winner: Candidate
    measured: TrialResult  # the winner's memory trial
    seconds: dict[tuple[object, ...], float]  # each raced contender's fastest window
    note: str


def race(
    workload: Workload,
    profile: Profile,
    chosen: Candidate,
    measured: TrialResult,
    rivals: Sequence[Candidate],
    *,
    near_margin: Sequence[Candidate] = (),
    budget_bytes: float = float("inf"),
    fits: Callable[[Candidate], TrialResult | None],
    time_windows: WindowTimer,
) -> RaceResult | None:
    """The fastest measured of ``chosen`` (proved: ``measured``) and some of ``rivals`` (fitting plans
    predicted within search.RIVAL_REACH ties of the fastest; contenders_besides), or None when there
    is nothing to race or the race would cost too much.

    ``near_margin``: hand strategies that fit only without the safety margin (choices.hands_within_margin),
    up to RACE_NEAR_MARGIN of them raced too: their memory trial decides whether they fit.
    ``fits(candidate)``: its memory trial, None when it ran out of memory or measured over the budget.
    ``time_windows(candidate, clock, n, track_first)``: n whole windows of it, each timed on
    ``clock``, the first under MemoryTracker when ``track_first``: a contender whose whole window
    peaks above ``budget_bytes`` is out (the memory trial runs the window's first two micro-batches
    only, and the rest of a window measured up to 0.75 % above it: efficientnet_b0 8 x 4).
    """
    allowance = max(RACE_COST_SHARE * profile.profile_seconds, RACE_FREE_SECONDS)
    proved = _entrants(chosen, measured, _by_priority(chosen, rivals, near_margin), fits, allowance)
    contenders = [candidate for candidate, _ in proved.values()]
    if len(contenders) < 2:
        return None
    times, rounds, peaks = _timed_rounds(workload, profile, contenders, time_windows, allowance)
    over = [c for c in contenders if (peaks.get(config_key(c)) or 0) > budget_bytes]
    contenders = [c for c in contenders if c not in over]
    if not contenders:
        return None
    best = {config_key(c): min(times[config_key(c)]) for c in contenders}
    tie = race_tie(times)
    fastest = min(best.values())
    within = [c for c in contenders if best[config_key(c)] <= fastest * (1 + tie)]
    winner = min(within, key=tie_key)
    listed = "; ".join(
        f"{_named(c)} {best[config_key(c)]:.3g} s"
        for c in sorted(contenders, key=lambda c: best[config_key(c)])
    )
    dropped = "".join(
        f"; {_named(c)} out: its whole window peaked at {format_bytes(peaks[config_key(c)] or 0)}"
        for c in over
    )
    note = (
        f"raced {len(contenders) + len(over)} plans the prediction could not tell apart, {rounds} timed "
        f"windows each (fastest window; ties within {tie:.1%}): {listed}{dropped}; kept micro-batch "
        f"{_named(winner)}"
    )
    _, trial = proved[config_key(winner)]
    whole = max(trial.peak_bytes, peaks.get(config_key(winner)) or 0)  # the window's peak, beyond its trial's
    return RaceResult(winner, dataclasses.replace(trial, peak_bytes=whole), best, note)


def _entrants(
    chosen: Candidate,
    measured: TrialResult,
    wanted: Sequence[Candidate],
    fits: Callable[[Candidate], TrialResult | None],
    allowance: float,
) -> dict[tuple[object, ...], tuple[Candidate, TrialResult]]:
    """Each contender and its memory trial, in racing order: ``chosen`` (``measured``), then those of
    ``wanted``, most wanted first, while the race's predicted windows stay within ``allowance``
    seconds; a rival whose trial fails (None) is left out."""
    window = 1 + RACE_ROUNDS  # windows a contender runs: an untimed warm one, then the timed ones
    proved = {config_key(chosen): (chosen, measured)}
    entered = [chosen]
    for candidate in wanted:
        if window * sum(c.seconds_per_step for c in (*entered, candidate)) > allowance:  # predicted
            continue
        entered.append(candidate)
        result = fits(candidate)
        if result is not None:
            proved[config_key(candidate)] = (candidate, result)
    return proved


def _timed_rounds(
    workload: Workload,
    profile: Profile,
    contenders: Sequence[Candidate],
    time_windows: WindowTimer,
    allowance: float,
) -> tuple[dict[tuple[object, ...], list[float]], int, dict[tuple[object, ...], int | None]]:
    """Each contender's timed windows: RACE_ROUNDS after an untimed one (tracked: its whole-window
    peak), contender after contender; then, while the race's tie is wider than RACE_SETTLED_TIE (up
    to RACE_MAX_ROUNDS, within ``allowance`` seconds predicted), one more each, in rotated order,
    each after an untimed one. Returns the windows' seconds, the rounds run and the peaks."""
    times: dict[tuple[object, ...], list[float]] = {}
    peaks: dict[tuple[object, ...], int | None] = {}
    order = list(contenders)
    per_round = 2 * sum(c.seconds_per_step for c in order)
    spent = (1 + RACE_ROUNDS) * per_round / 2
    clock_name = AUTO if profile.clock == CPU else profile.clock
    with profiling_clock(clock_name, workload.device) as (_, clock):
        for candidate in order:
            timed = time_windows(candidate, clock, 1 + RACE_ROUNDS, True)
            times[config_key(candidate)], peaks[config_key(candidate)] = timed.seconds[1:], timed.peak_bytes
        rounds = RACE_ROUNDS
        while (
            rounds < RACE_MAX_ROUNDS and race_tie(times) > RACE_SETTLED_TIE and spent + per_round <= allowance
        ):
            shift = rounds % len(order)
            for candidate in order[shift:] + order[:shift]:
                times[config_key(candidate)].append(time_windows(candidate, clock, 2, False).seconds[1])
            rounds, spent = rounds + 1, spent + per_round
    return times, rounds, peaks


def _by_priority(
    chosen: Candidate, rivals: Sequence[Candidate], near_margin: Sequence[Candidate]
) -> list[Candidate]:
    """Who races ``chosen``, most wanted first: the fastest predicted rival, the first hand strategy
    within the margin, the first rival in the tie order, the next hand within the margin."""
    besides = contenders_besides(chosen, rivals)
    near = [hand for hand in near_margin[:RACE_NEAR_MARGIN] if config_key(hand) != config_key(chosen)]
    wanted = [*besides[:1], *near[:1], *besides[1:], *near[1:]]
    picked: list[Candidate] = []
    for candidate in wanted:
        if all(config_key(candidate) != config_key(other) for other in picked):
            picked.append(candidate)
    return picked


def race_rivals(
    workload: Workload,
    profile: Profile,
    options: PlanOptions,
    budget_bytes: int,
    chosen: Candidate,
    measured: TrialResult,
    rivals: Sequence[Candidate],
    near_margin: Sequence[Candidate],
) -> RaceResult | None:
    """``race`` on the real model with the plan's options: each rival's memory trial against
    ``budget_bytes``, whole windows timed."""

    def fits(candidate: Candidate) -> TrialResult | None:
        result = attempt_trial(workload, candidate, options)
        return result if result is not None and result.peak_bytes <= budget_bytes else None

    def timed(candidate: Candidate, clock: Callable[[], float], windows: int, track: bool) -> TimedWindows:
        return time_windows(
            workload,
            candidate,
            clock,
            windows=windows,
            track_first=track,
            accumulate_dtype=options.accumulate_dtype,
            scaler=options.scaler,
            max_grad_norm=options.max_grad_norm,
        )

    if options.progress is not None:
        options.progress("racing the plans the prediction cannot tell apart", 0, 1)
    return race(
        workload,
        profile,
        chosen,
        measured,
        rivals,
        near_margin=near_margin,
        budget_bytes=budget_bytes,
        fits=fits,
        time_windows=timed,
    )


def contenders_besides(chosen: Candidate, rivals: Sequence[Candidate]) -> list[Candidate]:
    """Up to RACE_CONTENDERS - 1 of ``rivals`` (fastest first) to race ``chosen``: the fastest predicted,
    then the first in the tie order (least recomputation), then the next fastest."""
    others = [c for c in rivals if config_key(c) != config_key(chosen)]
    picked: list[Candidate] = []
    for candidate in (*others[:1], *sorted(others, key=tie_key)[:1], *others):
        if len(picked) < RACE_CONTENDERS - 1 and all(config_key(candidate) != config_key(p) for p in picked):
            picked.append(candidate)
    return picked


def race_tie(times: dict[tuple[object, ...], list[float]]) -> float:
    """2 x the largest gap between a contender's two fastest windows, within [RACE_MIN_TIE,
    MAX_TIE_FRACTION]."""
    gaps = []
    for seconds in times.values():
        ordered = sorted(seconds)
        if len(ordered) > 1 and ordered[0] > 0:
            gaps.append((ordered[1] - ordered[0]) / ordered[0])
    return min(max(2 * max(gaps, default=0.0), RACE_MIN_TIE), MAX_TIE_FRACTION)


def _named(candidate: Candidate) -> str:
    policies = summarize_policies(candidate.block_policies)
    return f"{candidate.micro_batch_size} x {candidate.steps} with {policies}"
