"""A budget refusal names one minimum, stated like the budget the user gave, and that minimum fits
when given back (issue 35, item 10)."""

from __future__ import annotations

import re

import pytest
import torch

import microbatch as mb
from microbatch.errors import InfeasibleBudgetError
from microbatch.memory import format_bytes, format_bytes_at_least, parse_bytes
from microbatch.workload import seed_linear

SIZE = r"[\d.,e+]+ (?:B|KiB|MiB|GiB)"


def _workload() -> mb.Workload:
    workload = seed_linear()
    workload.optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # two moments per parameter
    return workload


def _refused(budget: int, **options: object) -> InfeasibleBudgetError:
    with pytest.raises(InfeasibleBudgetError) as caught:
        mb.plan(_workload(), batch=8, memory=budget, **options)
    return caught.value


def _weights_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in seed_linear().model.parameters())


def test_with_ddp_buckets_the_refusal_names_the_given_budget_and_one_minimum_that_fits() -> None:
    # Two ranks: DDP's buckets (a copy of the gradients) live outside the profiled model. The refusal
    # once named the model's share of the budget and two minimums (the share's and the whole's).
    weights = _weights_bytes()
    budget = 5 * weights + 1  # above parameters + gradients + AdamW state + buckets, below any plan
    error = _refused(budget, world_size=2)
    message = str(error)
    assert f"memory={format_bytes(budget)} (DDP gradient buckets" in message
    assert "memory=" + format_bytes(budget - weights) not in message  # never the model's share alone
    named = set(re.findall(rf"at least ({SIZE})", message))
    assert named == {format_bytes_at_least(error.minimum_bytes)}, message  # rounded up, never down
    assert not error.minimum_is_lower_bound
    assert error.parts["DDP gradient buckets"] == weights
    assert sum(error.parts.values()) == error.minimum_bytes
    (as_read,) = named
    given_back = mb.plan(_workload(), batch=8, memory=as_read, world_size=2)  # the words, given back
    measured = given_back.measured_peak_bytes
    assert given_back.predicted_peak_bytes <= parse_bytes(as_read)
    assert measured is not None and measured <= parse_bytes(as_read)


def test_below_the_weights_with_buckets_one_lower_bound_stated_like_the_budget() -> None:
    weights = _weights_bytes()
    budget = 5 * weights - 1  # parameters + gradients + AdamW's two moments = 4x; the buckets 1x more
    error = _refused(budget, world_size=2)
    message = str(error)
    assert error.minimum_is_lower_bound and error.minimum_bytes == 5 * weights
    assert f"memory={format_bytes(budget)}" in message
    assert set(re.findall(rf"at least ({SIZE})", message)) == {format_bytes_at_least(5 * weights)}
    assert "not measured" in message and "refused before profiling" in message
    # Above that bound, planning measures the activations and names the exact minimum, which fits.
    exact = _refused(5 * weights + 1, world_size=2)
    assert not exact.minimum_is_lower_bound and exact.minimum_bytes > 5 * weights
    assert mb.plan(_workload(), batch=8, memory=exact.minimum_bytes, world_size=2).steps >= 1
