"""The planner's time model: its arithmetic, which timed run a profile keeps, and the clocks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from microbatch.checkpointing.api import find_blocks
from microbatch.errors import ConfigError
from microbatch.planner.search import Model
from microbatch.profile import NONE, Fit, PolicyCost, Profile, SegmentProfile, profile_workload
from microbatch.profile.assemble import fastest_runs
from microbatch.profile.clocks import clock_for
from microbatch.profile.runs import micro_batch_run
from microbatch.profile.timeline import Run, SegmentRun
from test_profile import mlp_workload

STEP, LOOP_FIXED, LOOP_PER_SAMPLE = 0.5, 0.01, 0.001
# Per segment: (forward a, forward k, backward a, backward k) in seconds, a + k * b.
LINES = {
    "(before blocks)": (0.1, 0.01, 0.2, 0.02),
    "block": (1.0, 0.1, 2.0, 0.2),
    "(after blocks)": (0.3, 0.0, 0.4, 0.0),
}
FULL_BACKWARD = (3.0, 0.3)  # the block's backward with its recompute under "full"


def _cost(forward: tuple[float, float], backward: tuple[float, float]) -> PolicyCost:
    zero = Fit.constant(0)
    return PolicyCost(
        kept_bytes=zero,
        peak_bytes=zero,
        forward_seconds=Fit(*forward),
        backward_seconds=Fit(*backward),
    )


def _profile() -> Profile:
    segments = []
    for name, (fa, fk, ba, bk) in LINES.items():
        costs = {NONE: _cost((fa, fk), (ba, bk))}
        if name == "block":
            costs["full"] = _cost((fa, fk), FULL_BACKWARD)
        segments.append(SegmentProfile(name=name, is_block=name == "block", costs=costs))
    return Profile(
        name="synthetic",
        device="cpu",
        micro_batch_sizes=(1, 8, 16),
        segments=tuple(segments),
        parameter_bytes=0,
        gradient_bytes=0,
        optimizer_bytes=0,
        optimizer_name="SGD",
        base_bytes=Fit.constant(0),
        step_peak_bytes=0,
        step_seconds=STEP,
        loop_seconds=Fit(LOOP_FIXED, LOOP_PER_SAMPLE),
    )


def _by_hand(sizes: list[int], *, full: bool) -> float:
    """sum over micro-batches of (loop + every segment's forward and backward) + one step."""
    total = STEP
    for m in sizes:
        total += LOOP_FIXED + LOOP_PER_SAMPLE * m
        for name, (fa, fk, ba, bk) in LINES.items():
            if full and name == "block":
                ba, bk = FULL_BACKWARD
            total += fa + fk * m + ba + bk * m
    return total


@pytest.mark.parametrize("sizes", [[64], [8] * 8, [22, 22, 20], [1] * 64])
@pytest.mark.parametrize("full", [False, True])
def test_the_step_is_counted_once_per_window(sizes: list[int], full: bool) -> None:
    candidate = Model(_profile()).evaluate(sizes, {"block": "full"} if full else {})
    assert candidate.seconds_per_step == pytest.approx(_by_hand(sizes, full=full), rel=1e-12)
    # Splitting the same samples finer adds the per-micro-batch intercepts, never another step.
    one = Model(_profile()).evaluate([sum(sizes)], {}).seconds_per_step
    fixed = LOOP_FIXED + sum(fa + ba for fa, _, ba, _ in LINES.values())
    assert Model(_profile()).evaluate(sizes, {}).seconds_per_step - one == pytest.approx(
        (len(sizes) - 1) * fixed, rel=1e-9
    )


def _run(seconds: float, segment_seconds: dict[str, float]) -> Run:
    segments = {name: SegmentRun(value, 2 * value, 0, 0) for name, value in segment_seconds.items()}
    return Run(segments, 0, 0, seconds, True, ("block",), {})


def test_the_fastest_round_is_kept_whole() -> None:
    slow_block = _run(3.0, {"block": 0.9, "rest": 0.1})
    fast = _run(2.0, {"block": 0.5, "rest": 0.4})  # its "rest" is the slowest of all rounds
    slow_rest = _run(2.5, {"block": 0.6, "rest": 0.05})
    chosen = fastest_runs({(NONE, 4): [slow_block, fast, slow_rest], ("full", 4): [slow_rest]})
    # Whole runs, not each segment's minimum (0.5 + 0.05 would be less than any run took).
    assert chosen == {(NONE, 4): fast, ("full", 4): slow_rest}


class _FakeClock:
    """A clock that advances 1 ms per reading; making a batch jumps it by 100 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_a_micro_batch_is_timed_from_its_batch_in_hand() -> None:
    clock = _FakeClock()
    workload = mlp_workload()
    make_batch = workload.make_batch

    def slow_batch(size: int) -> Any:
        clock.now += 100.0  # the data pipeline's time: not the plan's
        return make_batch(size)

    workload.make_batch = slow_batch  # type: ignore[method-assign]
    blocks = find_blocks(workload.model, "auto")
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    run = micro_batch_run(
        workload, blocks, 4, torch.device("cpu"), track=False, optimizer=optimizer, clock=clock
    )
    assert 0 < run.seconds < 1.0
    covered = sum(s.forward_seconds + s.backward_seconds for s in run.segments.values())
    assert covered <= run.seconds


def test_clocks() -> None:
    cpu = torch.device("cpu")
    assert clock_for("wall", cpu) is time.perf_counter
    with pytest.raises(ConfigError, match="clock must be one of"):
        clock_for("gpu", cpu)
    with pytest.raises(ConfigError, match="model is on meta"):
        clock_for("cpu", torch.device("meta"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ConfigError, match=r"torch\.set_num_threads"):
            clock_for("cpu", cpu)
        torch.set_num_threads(1)
        assert clock_for("cpu", cpu) is time.thread_time
        profile = profile_workload(mlp_workload(), micro_batch_sizes=[1, 4], policies=["none"], clock="cpu")
    finally:
        torch.set_num_threads(threads)
    assert profile.clock == "cpu" and profile.to_dict()["clock"] == "cpu"
    assert profile.step_seconds > 0


def test_times_run_through_the_measurements_and_beyond_along_the_line() -> None:
    sizes, values = [1, 8, 16], [9.0, 42.0, 88.0]  # a noisy 16 pulls the line's value at 1
    fit = Fit.of(sizes, values, nonnegative=True, interpolate=True, line_beyond=True)
    line = Fit.of(sizes, values, nonnegative=True)
    assert line(1) != pytest.approx(9.0, rel=0.05)
    for size, value in zip(sizes, values, strict=True):
        assert fit(size) == pytest.approx(value)
    assert fit(12) == pytest.approx(42.0 + (88.0 - 42.0) * 4 / 8)
    # Beyond the profiled sizes: from the nearest measurement along the least-squares slope.
    assert fit.slope == pytest.approx(line.slope)
    assert fit(64) == pytest.approx(88.0 + line.slope * 48)
    assert fit.to_dict()["line_beyond"] is True
