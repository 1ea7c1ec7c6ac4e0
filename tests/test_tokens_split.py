"""split_by_tokens: partition, bound, determinism, optimal count, never worse than the greedy split."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import microbatch as mb
from microbatch.accumulate import tokens
from microbatch.accumulate.tokens import fewest_micro_batches_bound, padded_tokens
from microbatch.errors import ConfigError


@st.composite
def windows(draw: st.DrawFn, max_samples: int = 40) -> tuple[list[int], int]:
    max_tokens = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, max_tokens), min_size=0, max_size=max_samples))
    return lengths, max_tokens


def greedy(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The plain length-sorted greedy split: fill each micro-batch with the next-longest samples."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def fewest_by_brute_force(lengths: list[int], max_tokens: int) -> int:
    """The smallest micro-batch count over every assignment of samples to micro-batches."""
    n = len(lengths)
    for count in range(1, n + 1):
        for assignment in itertools.product(range(count), repeat=n):
            groups = [[i for i in range(n) if assignment[i] == g] for g in range(count)]
            if all(g and len(g) * max(lengths[i] for i in g) <= max_tokens for g in groups):
                return count
    return n


@settings(max_examples=300, deadline=None)
@given(windows())
def test_partition_bound_and_determinism(window: tuple[list[int], int]) -> None:
    lengths, max_tokens = window
    groups = mb.split_by_tokens(lengths, max_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g and len(g) * max(lengths[i] for i in g) <= max_tokens for g in groups)
    assert mb.split_by_tokens(list(lengths), max_tokens) == groups
    assert len(groups) >= fewest_micro_batches_bound(lengths, max_tokens)
    assert len(groups) >= math.ceil(len(lengths) / max_tokens)


@settings(max_examples=300, deadline=None)
@given(windows())
def test_never_worse_than_the_greedy_split(window: tuple[list[int], int]) -> None:
    lengths, max_tokens = window
    ours, theirs = mb.split_by_tokens(lengths, max_tokens), greedy(lengths, max_tokens)
    assert len(ours) <= len(theirs)
    assert padded_tokens(lengths, ours) <= padded_tokens(lengths, theirs)


@settings(max_examples=150, deadline=None)
@given(windows(max_samples=6))
def test_fewest_micro_batches_of_any_split(window: tuple[list[int], int]) -> None:
    lengths, max_tokens = window
    assert len(mb.split_by_tokens(lengths, max_tokens)) == (
        fewest_by_brute_force(lengths, max_tokens) if lengths else 0
    )


@settings(max_examples=200, deadline=None)
@given(windows(), st.integers(0, 40))
def test_exact_count_keeps_partition_and_bound(window: tuple[list[int], int], extra: int) -> None:
    lengths, max_tokens = window
    fewest = len(mb.split_by_tokens(lengths, max_tokens))
    count = min(fewest + extra, len(lengths))
    groups = mb.split_by_tokens(lengths, max_tokens, micro_batches=count)
    assert len(groups) == count
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g and len(g) * max(lengths[i] for i in g) <= max_tokens for g in groups)


def test_padding_is_smaller_than_fixed_rows_on_a_spread_window() -> None:
    lengths = [100, 12, 95, 10, 11, 90, 9, 13]
    groups = mb.split_by_tokens(lengths, 200)
    assert groups == [[0, 2], [5], [1, 3, 4, 6, 7]]  # 200, 90, 5 x 13: derived by hand
    assert padded_tokens(lengths, groups) == 200 + 90 + 65
    # Two rows per micro-batch in the window's order: 4 micro-batches, 200 + 190 + 180 + 26 tokens.
    assert padded_tokens(lengths, [[0, 1], [2, 3], [4, 5], [6, 7]]) == 596


def test_too_long_sample_names_its_index_and_length() -> None:
    with pytest.raises(ConfigError, match=r"sample 2 has 50 tokens, more than max_tokens=40"):
        mb.split_by_tokens([3, 4, 50], 40)
    assert mb.split_by_tokens([3, 4, 50], 40, truncate=True) == [[2], [0, 1]]


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "message"),
    [([1, 0], 4, r"lengths\[1\] is 0"), ([1], 0, "max_tokens must be"), ([1.5], 4, r"lengths\[0\] must")],
)
def test_bad_arguments_say_which(lengths: list, max_tokens: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        mb.split_by_tokens(lengths, max_tokens)


def test_impossible_count_is_refused() -> None:
    with pytest.raises(ConfigError, match="micro_batches=4 is impossible"):
        mb.split_by_tokens([5, 5, 5], 10, micro_batches=4)


@settings(max_examples=150, deadline=None)
@given(windows())
def test_vectorised_and_scalar_dp_agree(window: tuple[list[int], int]) -> None:
    lengths, max_tokens = window
    original = tokens._SCALAR_ROWS
    try:
        tokens._SCALAR_ROWS = 0  # every step vectorised
        vectorised = mb.split_by_tokens(lengths, max_tokens)
        tokens._SCALAR_ROWS = 10**9  # every step in Python
        scalar = mb.split_by_tokens(lengths, max_tokens)
    finally:
        tokens._SCALAR_ROWS = original
    assert vectorised == scalar


@pytest.mark.parametrize("max_tokens", [10**17, 2**62, 10**30])
def test_a_huge_max_tokens_splits_like_an_unbounded_one(max_tokens: int) -> None:
    # Issue 35: 10**17 overflowed the DP's int64 keys (a raw OverflowError, or a wrong count
    # silently, 2 micro-batches for 100 samples of 5 tokens). No run holds more than all samples.
    lengths = [int(n) for n in torch.randint(1, 50, (300,), generator=torch.Generator().manual_seed(0))]
    groups = mb.split_by_tokens(lengths, max_tokens)
    assert groups == [list(range(len(lengths)))]
    assert mb.split_by_tokens([5] * 100, max_tokens) == [list(range(100))]
    tight = mb.split_by_tokens(lengths, 200)  # a binding budget is unchanged by the clamp
    assert all(len(g) * max(lengths[i] for i in g) <= 200 for g in tight)
    assert sorted(i for g in tight for i in g) == list(range(len(lengths)))


def test_lengths_beyond_int64_counting_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"lengths: 100 samples of up to .* check the lengths"):
        mb.split_by_tokens([2**60] * 100, 2**62)
