"""The trial's race (planner/proof/race.py): plans the prediction cannot tell apart are timed on the
real model and the fastest measured is kept, ties within the race's own noise broken by tie_key.

The rule is tested with scripted clocks (no timing in a test decides an assertion); one real plan
checks that the race runs whole windows of the real model, keeps the model as it was, and returns a
plan whose measured peak fits and whose windows train like the full batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import cast

import pytest
import torch

import microbatch as mb
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload
from microbatch.planner.proof import race as race_module
from microbatch.planner.proof.choices import hands_within_margin
from microbatch.planner.proof.race import RACE_MIN_TIE, RaceResult, contenders_besides, race, race_tie
from microbatch.planner.proof.trial_run import TimedWindows, TrialResult
from microbatch.planner.search.rules import SplitRules
from microbatch.planner.search.sizes import Candidate, Model, search
from microbatch.profile import Profile, profile_workload

BLOCKS = ("b0", "b1", "b2")


def candidate(sizes: tuple[int, ...], full: int, seconds: float) -> Candidate:
    policies = tuple((name, "full" if i < full else "none") for i, name in enumerate(BLOCKS))
    return Candidate(
        micro_batch_sizes=sizes, block_policies=policies, peak_bytes=100, seconds_per_step=seconds
    )


SLOW_NONE = candidate((3, 3, 2), 0, 1.05)  # no recomputation: first in the tie order
FAST_ONE = candidate((4, 4), 1, 1.00)  # predicted fastest
FAST_TWO = candidate((8,), 2, 1.01)


def profile(seconds: float = 100.0) -> Profile:
    # race() reads only how long profiling took and which clock it used.
    return cast(Profile, SimpleNamespace(profile_seconds=seconds, clock="wall"))


def scripted(
    seconds: dict[tuple[int, ...], list[float]],
    calls: list[tuple[int, ...]],
    peaks: dict[tuple[int, ...], int] | None = None,
) -> Callable[..., TimedWindows]:
    """time_windows that returns each candidate's next scripted times (the warm window's is 99 s) and,
    when the first window is tracked, its scripted whole-window peak (50 bytes unless given)."""
    queues = {sizes: list(times) for sizes, times in seconds.items()}

    def time_windows(c: Candidate, clock: Callable[[], float], windows: int, track: bool) -> TimedWindows:
        sizes = tuple(c.micro_batch_sizes)
        calls.append(sizes)
        queue = queues[sizes]
        peak = (peaks or {}).get(sizes, 50) if track else None
        return TimedWindows([99.0] + [queue.pop(0) for _ in range(windows - 1)], peak)

    return time_windows


PROVED = TrialResult(peak_bytes=90, cuda_max_allocated_bytes=None)
BUDGET = 100


def fits_all(c: Candidate) -> TrialResult:
    return TrialResult(peak_bytes=80 + c.steps, cuda_max_allocated_bytes=None)


def run_race(
    times: dict[tuple[int, ...], list[float]],
    chosen: Candidate,
    rivals: list[Candidate],
    *,
    fits: Callable[[Candidate], TrialResult | None] = fits_all,
    seconds: float = 100.0,
    near_margin: Sequence[Candidate] = (),
    peaks: dict[tuple[int, ...], int] | None = None,
) -> tuple[RaceResult | None, list[tuple[int, ...]]]:
    calls: list[tuple[int, ...]] = []
    workload = cast(mb.Workload, SimpleNamespace(device=torch.device("cpu")))  # the clock's device
    timed = scripted(times, calls, peaks)
    result = race(
        workload,
        profile(seconds),
        chosen,
        PROVED,
        rivals,
        near_margin=near_margin,
        budget_bytes=BUDGET,
        fits=fits,
        time_windows=timed,
    )
    return result, calls


def test_the_fastest_measured_wins_beyond_the_race_noise() -> None:
    # Windows spread 1 % (tie 2 %); the plan the search put last measures 10 % ahead: it is kept.
    times = {(3, 3, 2): [1.00, 1.01, 1.005], (4, 4): [1.10, 1.11, 1.105], (8,): [1.20, 1.21, 1.2]}
    result, calls = run_race(times, FAST_ONE, [FAST_ONE, FAST_TWO, SLOW_NONE])
    assert result is not None and result.winner is SLOW_NONE
    assert result.measured.peak_bytes == 83  # the winner's own memory trial, not the choice's
    assert result.seconds[((3, 3, 2), SLOW_NONE.block_policies)] == pytest.approx(1.00)
    # Each contender once: an untimed window and three timed ones (settled: no more rounds).
    assert calls == [(4, 4), (8,), (3, 3, 2)]
    assert "kept micro-batch 3 x 3" in result.note


def test_within_the_race_noise_the_tie_order_decides() -> None:
    # The predicted fastest measures 1.5 % ahead, inside the 4 % floor: least recomputation wins.
    times = {(3, 3, 2): [1.015, 1.02, 1.03], (4, 4): [1.00, 1.004, 1.008]}
    result, _ = run_race(times, FAST_ONE, [FAST_ONE, SLOW_NONE])
    assert result is not None and result.winner is SLOW_NONE
    # Noisy windows widen the tie: 4 % apart within one plan's windows makes 8 % (the cap) a tie.
    assert race_tie({("a",): [1.0, 1.04, 1.05]}) == pytest.approx(0.08)
    assert race_tie({("a",): [1.0, 1.001, 1.05]}) == RACE_MIN_TIE


def test_a_noisy_race_runs_more_rounds() -> None:
    # 5 % between one plan's two fastest windows: rounds go on (up to 6) while the tie is wider than
    # 4 %, each in a rotated order (nobody always runs right after the same plan).
    times = {(3, 3, 2): [1.0, 1.05, 1.06, 1.04, 1.001, 1.03], (4, 4): [1.2] * 6}
    result, calls = run_race(times, FAST_ONE, [FAST_ONE, SLOW_NONE])
    assert result is not None and result.winner is SLOW_NONE
    # The fifth round settled it (gap 0.1 %); rounds 4 and 5 ran in rotated orders.
    assert calls == [(4, 4), (3, 3, 2), (3, 3, 2), (4, 4), (4, 4), (3, 3, 2)]


def test_a_rival_over_the_budget_is_out_of_the_race() -> None:
    times = {(3, 3, 2): [0.5] * 3, (4, 4): [1.0] * 3}

    def over_for_none(c: Candidate) -> TrialResult | None:
        return None if c is SLOW_NONE else fits_all(c)

    result, calls = run_race(times, FAST_ONE, [FAST_ONE, SLOW_NONE], fits=over_for_none)
    assert result is None and calls == []  # one contender left: nothing to race


def test_a_contender_whose_whole_window_overruns_the_budget_is_out() -> None:
    # The memory trial runs a window's first two micro-batches; the race's first window of each
    # contender runs whole under the tracker. 3 + 3 + 2 measures fastest but its window peaks over.
    times = {(3, 3, 2): [0.5] * 3, (4, 4): [1.0] * 3, (8,): [1.1] * 3}
    result, _ = run_race(
        times, FAST_ONE, [FAST_ONE, FAST_TWO, SLOW_NONE], peaks={(3, 3, 2): BUDGET + 1, (4, 4): 95}
    )
    assert result is not None and result.winner is FAST_ONE
    assert result.measured.peak_bytes == 95  # the whole window's, above its trial's 90
    assert "3 x 3 with none x3 out: its whole window peaked at" in result.note
    # When no contender's whole window fits, the race changes nothing.
    over = {(4, 4): BUDGET + 1, (8,): BUDGET + 1}
    assert run_race(times, FAST_ONE, [FAST_ONE, FAST_TWO], peaks=over)[0] is None


def test_no_race_without_rivals_or_when_it_costs_too_much() -> None:
    assert run_race({}, FAST_ONE, [FAST_ONE])[0] is None
    # Four windows each of two plans predicted 1 s and 2 s: 12 s, over a 5 s profile's allowance
    # (its time, RACE_COST_SHARE = 1) and the free 10 s.
    slow = candidate((3, 3, 2), 0, 2.0)
    result, calls = run_race({}, FAST_ONE, [FAST_ONE, slow], seconds=5.0)
    assert result is None and calls == []
    # After a 12 s profile (12 s allowed) the same two race.
    times = {(3, 3, 2): [2.0] * 3, (4, 4): [1.0] * 3}
    result, calls = run_race(times, FAST_ONE, [FAST_ONE, slow], seconds=12.0)
    assert result is not None and result.winner is FAST_ONE and len(calls) == 2
    assert race_module.RACE_FREE_SECONDS == 10.0


def test_the_rivals_are_the_fastest_and_the_first_in_the_tie_order() -> None:
    slower = candidate((2, 2, 2, 2), 0, 1.04)
    others = contenders_besides(FAST_TWO, [FAST_ONE, FAST_TWO, slower, SLOW_NONE])
    # The fastest predicted besides the choice, then least recomputation with the larger micro-batch.
    assert others == [FAST_ONE, SLOW_NONE]


@pytest.mark.slow
def test_a_real_race_keeps_the_model_and_the_budget() -> None:
    # gpt-mini at batch 8 within 20 MiB: 3 + 3 + 2 without checkpointing, 4 x 2 with one block full
    # and 8 x 1 with more are predicted within a few per cent of each other (search/sizes.py).
    torch.set_num_threads(1)
    workload = gpt_workload("gpt-mini")
    before = {name: p.detach().clone() for name, p in workload.model.named_parameters()}
    plan = mb.plan(workload, batch=8, memory="20MiB", max_profile_micro_batch_size=4)
    raced = [note for note in plan.notes if note.startswith("raced")]
    assert raced, plan.notes
    kept = f"kept micro-batch {plan.micro_batch_size} x {plan.steps}"
    assert kept in raced[0]
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= 20 * 2**20
    for name, parameter in workload.model.named_parameters():
        assert torch.equal(parameter, before[name]), name


def test_a_hand_strategy_near_the_margin_is_raced_and_its_trial_decides() -> None:
    near = candidate((4, 4), 3, 1.2)  # predicted slower, over the budget with the margin only
    times = {(4, 4): [0.8] * 3, (3, 3, 2): [1.0] * 3}
    result, calls = run_race(times, SLOW_NONE, [SLOW_NONE], near_margin=[near])
    assert result is not None and result.winner is near  # measured 20 % ahead: kept, its trial fit
    result, calls = run_race(
        times, SLOW_NONE, [SLOW_NONE], near_margin=[near], fits=lambda c: None if c is near else fits_all(c)
    )
    assert result is None and calls == []  # its trial measured over the budget: nothing left to race


def test_hands_within_the_margin_fit_only_without_it() -> None:
    torch.set_num_threads(1)
    workload = gpt_workload(
        GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32, dropout=0.0), max_bytes=200_000
    )
    profile = profile_workload(workload, micro_batch_sizes=(1, 2, 4), repeats=1)
    lowest = search(profile, per_rank_batch=8, capacity_bytes=math.inf).minimum.peak_bytes
    highest = Model(profile).evaluate([8], {}).peak_bytes
    found = 0
    for step in range(41):
        capacity = lowest + (highest - lowest) * step / 40
        result = search(profile, per_rank_batch=8, capacity_bytes=capacity)
        for hand in hands_within_margin(profile, 8, capacity, 0, result, SplitRules()):
            found += 1
            policies = dict(hand.block_policies)
            assert (
                Model(profile, safety_margin=0.0).evaluate(hand.micro_batch_sizes, policies).peak_bytes
                <= capacity
            )
            assert Model(profile).evaluate(hand.micro_batch_sizes, policies).peak_bytes > capacity
            assert all(
                hand.micro_batch_sizes != safe.micro_batch_sizes or hand.block_policies != safe.block_policies
                for safe in result.hands
            )
    assert found > 0  # the budgets crossed at least one hand strategy's margin
