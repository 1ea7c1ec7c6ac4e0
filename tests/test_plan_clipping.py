"""Gradient clipping is a plan input: the profile's step and the trial clip as the plan's Accumulator will."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from equivalence import assert_grads_close, grads_of
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload, lm_varlen
from microbatch.planner import Plan, PlanOptions, plan
from microbatch.planner.proof.trial_run import run_trial
from microbatch.planner.search.sizes import Model, search
from microbatch.planner.search.splits import WindowSizes
from microbatch.profile import profile_workload


def test_the_trial_with_clipping_measures_at_least_the_plain_one() -> None:
    workload = gpt_workload(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0), max_bytes=200_000
    )
    profile = profile_workload(workload, micro_batch_sizes=(2, 4), repeats=1)
    candidate = Model(profile).evaluate(WindowSizes(12, 4), {})
    plain = run_trial(workload, candidate).peak_bytes
    clipped = run_trial(workload, candidate, max_grad_norm=1e-3).peak_bytes  # clips for sure
    assert clipped >= plain > 0


def test_max_grad_norm_is_made_saved_printed_and_held(tmp_path: Path) -> None:
    workload = lm_varlen()
    profile = profile_workload(workload, micro_batch_sizes=(1, 2, 4), repeats=1)
    made = plan(workload, batch=8, memory="1GiB", profile=profile, max_grad_norm=0.5)
    assert made.max_grad_norm == 0.5 and made.measured_peak_bytes is not None
    assert "made with: max_grad_norm=0.5" in str(made)
    made.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.max_grad_norm == 0.5 and loaded == made
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"max_grad_norm=1\.0.*made with max_grad_norm=0\.5"):
        made.apply(workload.model, optimizer, max_grad_norm=1.0)
    plain = plan(workload, batch=8, memory="1GiB", profile=profile, trial=False)
    with pytest.raises(ConfigError, match=r"made with max_grad_norm=None"):
        plain.apply(workload.model, optimizer, max_grad_norm=0.5)
    for wrong in (0, -1.0, math.inf, True):
        with pytest.raises(ConfigError, match="max_grad_norm"):
            PlanOptions(max_grad_norm=wrong)
    data = made.to_dict()
    data["max_grad_norm"] = -2.0
    with pytest.raises(ConfigError, match="max_grad_norm"):
        Plan.from_dict(data)


def test_a_clipped_window_matches_the_full_batch_clipped_once() -> None:
    workload = lm_varlen()
    workload.model.double()
    batch = workload.make_batch(10)
    # Reference: the full batch's mean-loss gradient in float64, clipped once to a norm it exceeds.
    reference = copy.deepcopy(workload.model)
    loss, _ = workload.loss(reference, batch)
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    max_norm = norm / 4
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    expected = grads_of(reference)
    profile = profile_workload(workload, micro_batch_sizes=(1, 2, 4), repeats=1)
    minimum = search(profile, per_rank_batch=10, capacity_bytes=math.inf).minimum.peak_bytes
    made = plan(workload, batch=10, memory=minimum, profile=profile, max_grad_norm=max_norm, trial=False)
    assert made.steps > 1
    model = workload.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(model)))
    accumulator = made.apply(model, optimizer)  # takes max_grad_norm from the plan
    stats = None
    for micro in accumulator.iterate(made.split(batch)):
        loss, items = workload.loss(model, micro.batch)
        accumulator.backward(loss, items=items)
        if micro.is_last:
            stats = accumulator.step()
    made.remove(model)
    assert stats is not None and stats.grad_norm == pytest.approx(norm, rel=1e-9)
    # float64: accumulation reorders the sums only, and the window is clipped once, as the reference.
    assert_grads_close(captured, expected, rtol=1e-9, atol=1e-12)
