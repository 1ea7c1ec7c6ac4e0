"""The per-size policy solver against brute force, and the micro-batch sizes the search considers."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microbatch.errors import ConfigError
from microbatch.planner.search import solve, solve_runs
from microbatch.planner.search.splits import candidate_sizes
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


@settings(max_examples=200, deadline=None)
@given(chain=chains, capacity=st.integers(0, 6000), max_states=st.integers(1, 4))
def test_thinning_gives_up_at_most_its_proven_bytes(
    chain: list[solve.Segment], capacity: int, max_states: int
) -> None:
    # thinning.py's bound: thinned T times with buckets of at most w bytes, the solver is no slower
    # than the exact optimum at capacity C - T (w - 1). Here every group may thin (T <= segments) and
    # a bucket is at most ceil((P range + 1) / max_states) wide, P range <= the sum of the largest kept.
    found = solve.solve(chain, capacity, max_states=max_states)
    widest = math.ceil((sum(max(o.kept_bytes for o in s.options) for s in chain) + 1) / max_states)
    exact = brute_force(chain, capacity - len(chain) * (widest - 1))
    if exact is not None:
        assert found is not None
        assert found.extra_seconds <= exact.extra_seconds
    least = solve.minimum_peak(chain)  # thinned at the default budget: exact for chains this short
    assert least.peak_bytes == min(s.peak_bytes for s in all_choices(chain))


def test_every_policy_solver_thins_by_the_one_rule() -> None:
    # The chain's solvers and the pipeline's stage solvers bound their state sets by thinning.thin.
    import inspect

    from microbatch.planner.pipeline import stage_cost
    from microbatch.planner.search import thinning

    for module in (solve, stage_cost):
        assert "thinning import thin" in inspect.getsource(module)
    assert thinning.thin([3, 1, 2], 5, kept_bytes=lambda s: s, rank=lambda s: (s,), solver="t") == [3, 1, 2]
    # Buckets of kept bytes [0, 2), [2, 4), [4, 6): the least rank of each.
    states = [(0, 9.0), (1, 1.0), (2, 5.0), (3, 2.0), (4, 0.5), (5, 7.0)]
    kept = thinning.thin(states, 3, kept_bytes=lambda s: s[0], rank=lambda s: (s[1],), solver="t")
    assert kept == [(1, 1.0), (3, 2.0), (4, 0.5)]


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


# Chains with runs of identical blocks: a run repeats one block's options n times, each copy's peaks
# `drift` bytes lower than the one before (the window's first micro-batch: one block's gradients fewer
# per step), optionally with a single-option segment (the code between blocks) before each copy.
@st.composite
def run_chains(draw: st.DrawFn) -> list[solve.Segment]:
    segments: list[solve.Segment] = []
    blocks = 0
    while blocks < 7 and (not segments or draw(st.booleans())):
        if draw(st.booleans()):
            segments.append(
                solve.Segment(f"s{len(segments)}", draw(st.lists(options, min_size=1, max_size=3).map(tuple)))
            )
            blocks += 1
            continue
        block = draw(st.lists(options, min_size=2, max_size=3).map(tuple))
        copies = draw(st.integers(2, 7 - blocks)) if blocks < 6 else 1
        drift = draw(st.sampled_from([0, 0, draw(st.integers(-300, 300))]))
        gap = draw(st.none() | options)
        for j in range(copies):
            if gap is not None:
                segments.append(solve.Segment(f"g{len(segments)}", (gap,)))
            shifted = tuple(
                solve.Option(o.policy, o.kept_bytes, o.peak_bytes - j * drift, o.extra_seconds) for o in block
            )
            segments.append(solve.Segment(f"b{len(segments)}", shifted))
        blocks += copies
    return segments


@settings(max_examples=300, deadline=None)
@given(chain=run_chains(), capacity=st.integers(-500, 8000))
def test_run_solver_equals_brute_force(chain: list[solve.Segment], capacity: int) -> None:
    expected = brute_force(chain, capacity)
    found = solve.solve(chain, capacity)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert found.peak_bytes <= capacity
    assert found == solve.evaluate(chain, found.choice)  # a choice per real segment, its own costs
    assert found.extra_seconds == expected.extra_seconds
    # The lowest peak at that time: the frontier's fastest point within the capacity.
    fastest = next(s for s in solve.frontier(chain, max_points=10_000) if s.peak_bytes <= capacity)
    assert (fastest.extra_seconds, fastest.peak_bytes) == (expected.extra_seconds, expected.peak_bytes)


@settings(max_examples=200, deadline=None)
@given(chain=run_chains())
def test_run_frontier_and_minimum_equal_brute_force(chain: list[solve.Segment]) -> None:
    found = solve.frontier(chain, max_points=10_000)
    assert {(s.peak_bytes, s.extra_seconds) for s in found} == brute_frontier(chain)
    assert all(s == solve.evaluate(chain, s.choice) for s in found)
    lowest = min(s.peak_bytes for s in all_choices(chain))
    assert solve.minimum_peak(chain).peak_bytes == lowest
    # The fallback (solving at falling capacities) finds the same points.
    fallback = solve.frontier(chain, max_points=10_000, max_states=1)
    assert [(s.peak_bytes, s.extra_seconds) for s in fallback] == [
        (s.peak_bytes, s.extra_seconds) for s in found
    ]


@settings(max_examples=300, deadline=None)
@given(
    block=st.lists(options, min_size=1, max_size=3).map(tuple),
    counts=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    drift=st.integers(-300, 300),
)
def test_sorted_order_is_the_best_order_of_a_run(
    block: tuple[solve.Option, ...], counts: list[int], drift: int
) -> None:
    # The closed-form peak of a count vector (solve_runs.mixes) is the least over every order.
    counts = counts[: len(block)]
    if sum(counts) == 0:
        counts[0] = 1
    costs = tuple((o.kept_bytes, o.peak_bytes, o.extra_seconds) for o in block)
    mix = next(m for m in solve_runs.mixes(costs, sum(counts), drift) if list(m.counts) == counts)
    multiset = [o for o, c in enumerate(counts) for _ in range(c)]

    def run_peak(order: tuple[int, ...]) -> int:
        # Unit j peaks at sum_{i<j} kept(o_i) + peak(o_j) - j * drift.
        level, top = 0, None
        for j, option in enumerate(order):
            here = level + costs[option][1] - j * drift
            top = here if top is None else max(top, here)
            level += costs[option][0]
        assert top is not None
        return top

    assert mix.peak_bytes == min(run_peak(order) for order in set(itertools.permutations(multiset)))
    assert mix.kept_bytes == sum(costs[o][0] for o in multiset)


def test_identical_blocks_are_one_group_of_count_vectors() -> None:
    # 31 identical blocks with the code between them: one group of C(31 + 2, 2) = 528 mixes after
    # the first block (which the embeddings before it make different).
    block = (solve.Option("none", 900, 1000, 0.0), solve.Option("selective", 400, 1100, 1.0))
    block += (solve.Option("full", 30, 1100, 2.0),)
    chain = [solve.Segment("embed", (solve.Option("none", 50, 2000, 0.0),))]
    for index in range(32):
        if index:
            chain.append(solve.Segment(f"gap{index}", (solve.Option("none", 0, 0, 0.0),)))
        chain.append(solve.Segment(f"block{index}", block))
    chain.append(solve.Segment("head", (solve.Option("none", 2000, 6000, 0.0),)))
    groups = solve_runs.groups(chain)
    assert [len(g.units) for g in groups] == [1, 31, 1]
    assert len(groups[1].mixes) == math.comb(33, 2)
    # Within a budget that holds 10 blocks' activations but not 11, the fastest plan keeps the
    # cheapest-to-recompute blocks first, and the choice names every real segment.
    found = solve.solve(chain, 20_000)
    assert found is not None and len(found.choice) == len(chain)
    assert found == solve.evaluate(chain, found.choice)
