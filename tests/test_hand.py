"""The hand strategies (planner/search/hand.py): always candidates of the search, each at the largest
micro-batch that fits, and bounds on its choice (never predicted slower than any of them)."""

from __future__ import annotations

import math

import pytest
import torch

from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload
from microbatch.planner.search.hand import HAND_EVERY_SIZE, hand_sizes, hand_strategies
from microbatch.planner.search.sizes import Model, search
from microbatch.planner.search.splits import WindowSizes, candidate_sizes
from microbatch.profile import NONE, Profile, profile_workload

BATCH = 24


@pytest.fixture(scope="module")
def profile() -> Profile:
    torch.set_num_threads(1)
    # Wide and short (n_embd 128, 8 tokens): gradients outweigh a micro-batch's activations, so a
    # window (b, B - b) fits where the balanced one of its step count does not.
    config = GPTConfig(n_layer=4, n_head=2, n_embd=128, block_size=8, dropout=0.0)
    return profile_workload(gpt_workload(config, max_bytes=200_000), micro_batch_sizes=(1, 2, 4), repeats=1)


def both_splits(b: int) -> list[WindowSizes]:
    return [WindowSizes(BATCH, b), WindowSizes(BATCH, b, balanced=True)]


def test_every_size_up_to_the_limit_the_grid_above() -> None:
    assert hand_sizes(BATCH, candidate_sizes(BATCH), both_splits) == list(range(BATCH, 0, -1))
    big = HAND_EVERY_SIZE + 36
    grid = candidate_sizes(big)
    assert hand_sizes(big, grid, lambda b: [WindowSizes(big, b)]) == grid
    # Sizes the rules refuse (no split) are not priced.
    assert hand_sizes(BATCH, candidate_sizes(BATCH), lambda b: both_splits(b) if b % 2 == 0 else []) == list(
        range(BATCH, 0, -2)
    )


def test_each_hand_strategy_sits_at_its_largest_fitting_size_and_bounds_the_choice(profile: Profile) -> None:
    model = Model(profile)
    lowest = search(profile, per_rank_batch=BATCH, capacity_bytes=math.inf).minimum.peak_bytes
    highest = model.evaluate([BATCH], {}).peak_bytes
    checked = 0
    for step in range(13):
        capacity = lowest + (highest - lowest) * step / 12
        result = search(profile, per_rank_batch=BATCH, capacity_bytes=capacity)
        assert result.best is not None
        for name, policies in hand_strategies(profile):
            every = {segment.name: policies.get(segment.name, NONE) for segment in profile.blocks}
            # Brute force: the largest b at which one of its windows fits.
            fitting = [
                b
                for b in range(BATCH, 0, -1)
                if any(model.evaluate(sizes, every).peak_bytes <= capacity for sizes in both_splits(b))
            ]
            found = [h for h in result.hands if dict(h.block_policies) == every]
            if not fitting:
                assert not found, name
                continue
            # One of that b's windows (filled b, b, ..., r or balanced: the same steps).
            windows = [tuple(sizes) for sizes in both_splits(fitting[0])]
            assert len(found) == 1 and tuple(found[0].micro_batch_sizes) in windows, (name, capacity)
            # The choice is never predicted slower than a hand strategy.
            assert result.best.seconds_per_step <= found[0].seconds_per_step * (1 + 1e-9), (name, capacity)
            checked += 1
    assert checked >= 13  # at least one hand strategy fits at every budget
