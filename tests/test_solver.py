"""The per-size policy solver against brute force, and the micro-batch sizes the search considers."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import ConfigError
from microbatch.planner import solve
from microbatch.planner.search import candidate_sizes
from microbatch.trees.batches import micro_batch_sizes

# Whole-number seconds keep every sum exact, so "equal time" means equal.
options = st.builds(
    solve.Option,
    policy=st.sampled_from(["none", "full", "selective", "offload"]),
    kept_bytes=st.integers(0, 1000),
    peak_bytes=st.integers(0, 2000),
    extra_seconds=st.integers(0, 50).map(float),
)
chains = st.lists(
    st.lists(options, min_size=1, max_size=4).map(tuple),
    min_size=1,
    max_size=6,
).map(lambda opts: [solve.Segment(name=f"s{i}", options=o) for i, o in enumerate(opts)])


def all_choices(chain: list[solve.Segment]) -> list[solve.Solution]:
    ranges = [range(len(segment.options)) for segment in chain]
    return [solve.evaluate(chain, choice) for choice in itertools.product(*ranges)]


def brute_force(chain: list[solve.Segment], capacity: float) -> solve.Solution | None:
    feasible = [s for s in all_choices(chain) if s.peak_bytes <= capacity]
    return min(feasible, key=lambda s: (s.extra_seconds, s.peak_bytes)) if feasible else None


def brute_frontier(chain: list[solve.Segment]) -> set[tuple[int, float]]:
    points = {(s.peak_bytes, s.extra_seconds) for s in all_choices(chain)}
    return {p for p in points if not any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in points)}


def test_evaluate_follows_the_chain() -> None:
    # P_0 = 0: segment 1 peaks at 5; P_1 = 3: segment 2 peaks at 3 + 4 = 7; P_2 = 3 + 2 = 5.
    chain = [
        solve.Segment("a", (solve.Option("none", 3, 5, 0.0),)),
        solve.Segment("b", (solve.Option("none", 2, 4, 1.5),)),
    ]
    found = solve.evaluate(chain, (0, 0))
    assert (found.peak_bytes, found.kept_bytes, found.extra_seconds) == (7, 5, 1.5)


@settings(max_examples=300, deadline=None)
@given(chain=chains, capacity=st.integers(0, 6000))
def test_solver_equals_brute_force(chain: list[solve.Segment], capacity: int) -> None:
    expected = brute_force(chain, capacity)
    found = solve.solve(chain, capacity)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert found.peak_bytes <= capacity
    assert found == solve.evaluate(chain, found.choice)  # its reported costs are its choice's
    assert found.extra_seconds == expected.extra_seconds
    # The frontier's fastest point within the capacity is also the lowest peak at that time.
    fastest = next(s for s in solve.frontier(chain) if s.peak_bytes <= capacity)
    assert (fastest.extra_seconds, fastest.peak_bytes) == (expected.extra_seconds, expected.peak_bytes)


@settings(max_examples=200, deadline=None)
@given(chain=chains)
def test_frontier_equals_brute_force_pareto_set(chain: list[solve.Segment]) -> None:
    found = solve.frontier(chain)
    assert {(s.peak_bytes, s.extra_seconds) for s in found} == brute_frontier(chain)
    times = [s.extra_seconds for s in found]
    assert times == sorted(times)  # fastest first


@settings(max_examples=200, deadline=None)
@given(chain=chains)
def test_minimum_peak_equals_brute_force(chain: list[solve.Segment]) -> None:
    lowest = min(s.peak_bytes for s in all_choices(chain))
    assert solve.minimum_peak(chain).peak_bytes == lowest
    assert solve.solve(chain, lowest - 1) is None


@settings(max_examples=100, deadline=None)
@given(chain=chains, capacity=st.integers(0, 6000))
def test_thinned_solver_stays_within_capacity(chain: list[solve.Segment], capacity: int) -> None:
    # With a tiny state budget the answer may be slower than optimal, never over capacity.
    found = solve.solve(chain, capacity, max_states=2)
    if found is not None:
        assert found.peak_bytes <= capacity
        assert found == solve.evaluate(chain, found.choice)


def test_checkpointing_the_last_block_never_helps() -> None:
    # Four equal blocks: none keeps 10 and peaks at 10; full keeps 1, recomputes (peak 10) for 1 s.
    # Block k's backward runs on top of what blocks 1..k-1 keep, so the peak is P_3 + 10: only the
    # first three blocks' choices move it. All none: 30 + 10 = 40.
    block = (solve.Option("none", 10, 10, 0.0), solve.Option("full", 1, 10, 1.0))
    chain = [solve.Segment(f"b{i}", block) for i in range(4)]
    # Capacity 31 needs P_3 <= 21: one of the first three checkpointed (P_3 = 21).
    one = solve.solve(chain, 31)
    assert one is not None
    assert (one.peak_bytes, one.extra_seconds) == (31, 1.0)
    assert one.policies(chain)["b3"] == "none"
    # Capacity 22 needs P_3 <= 12: two of the first three (P_3 = 12), still not the last block.
    two = solve.solve(chain, 22)
    assert two is not None
    assert (two.peak_bytes, two.extra_seconds) == (22, 2.0)
    assert two.policies(chain)["b3"] == "none"
    # Below P_3 = 3 (all of the first three checkpointed) + 10 nothing fits.
    assert solve.solve(chain, 12) is None
    assert solve.minimum_peak(chain).peak_bytes == 13


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 600))
def test_candidate_sizes_keep_the_batch_exact(batch: int) -> None:
    sizes = candidate_sizes(batch)
    assert sizes == sorted(set(sizes), reverse=True)
    assert sizes[0] == batch and sizes[-1] == 1
    assert len(sizes) <= 2 * math.isqrt(batch) + 1
    for b in sizes:
        micro = micro_batch_sizes(batch, b)
        assert sum(micro) == batch
        assert len(micro) == -(-batch // b)
        assert max(micro) == b and min(micro) >= 1
    # Every step count N = 1..batch is reached by the smallest b that gives it.
    for steps in range(1, batch + 1):
        smallest = -(-batch // steps)
        assert smallest in sizes


def test_empty_option_list_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no options"):
        solve.minimum_peak([solve.Segment("x", ())])
