"""Selective at any depth: a named architecture planned with none, full and selective by default."""

from __future__ import annotations

import math

import pytest

from microbatch.memory.device_specs import devices
from microbatch.planner import plan
from microbatch.planner.search.sizes import search, tie_fraction

pytest.importorskip("transformers")

from microbatch.hf.configs import ModelSetup, simulate_config_profile


def test_selective_is_planned_where_it_is_the_fastest_that_fits() -> None:
    # GPT-2 (12 layers) simulated on an L4: the profile measures selective by default.
    spec = devices()["l4"]
    workload, profile = simulate_config_profile("gpt2", ModelSetup(seq_len=128), spec, max_micro_batch_size=8)
    assert all("selective" in block.policies for block in profile.blocks)
    # The budget: the peak of the fastest plan that uses selective, from the unbounded frontier.
    frontier = search(profile, per_rank_batch=8, capacity_bytes=math.inf).frontier
    with_selective = [c for c in frontier if "selective" in dict(c.block_policies).values()]
    assert with_selective, "selective never on the frontier"
    budget = with_selective[0].peak_bytes
    chosen = plan(workload, batch=8, memory=budget, profile=profile, device=spec)
    assert "selective" in dict(chosen.block_policies).values()
    assert chosen.predicted_peak_bytes <= budget
    # The fastest that fits, up to the planner's ties (search.choose) ...
    fitting = [c.seconds_per_step for c in frontier if c.peak_bytes <= budget]
    assert chosen.predicted_seconds_per_step <= min(fitting) * (1 + tie_fraction(profile))
    # ... and faster than any plan of none and full alone within the same budget.
    narrow = plan(workload, batch=8, memory=budget, profile=profile, device=spec, policies=["none", "full"])
    assert chosen.predicted_seconds_per_step < narrow.predicted_seconds_per_step
    assert "selective" not in dict(narrow.block_policies).values()
