"""plan_cached: the encode micro-batch size of cached_backward for a memory budget, proved by a trial."""

from __future__ import annotations

import pytest
import torch

import microbatch as mb
from dual_encoder import make_batch, make_models
from microbatch.errors import InfeasibleBudgetError

BATCH = 64


def setup() -> tuple[torch.nn.Module, object, object]:
    encoder, loss_fn = make_models(width=64, depth=3)
    model = torch.nn.ModuleDict({"encoder": encoder, "loss": loss_fn})
    return model, encoder.encode, loss_fn


def measured_peak(model, run) -> int:
    run()
    with mb.MemoryTracker("cpu", model=model) as tracker:
        run()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_plan_fits_the_budget_below_the_full_batch_and_leaves_the_model_alone() -> None:
    model, encode, loss_fn = setup()
    batch = make_batch(BATCH, seed=1)
    full = measured_peak(model, lambda: loss_fn(encode(batch)).backward())
    cached_8 = measured_peak(model, lambda: mb.cached_backward(encode, batch, loss_fn, micro_batch_size=8))
    assert cached_8 < full
    budget = (cached_8 + full) // 2  # the whole batch at once does not fit, micro-batches of 8 do
    rng = torch.get_rng_state()
    plan = mb.plan_cached(
        encode, loss_fn, lambda b: make_batch(b, seed=1), batch=BATCH, memory=budget, model=model
    )
    assert 8 <= plan.micro_batch_size < BATCH
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    # The fitted model predicts the measured peak closely (same sums of bytes, small fits).
    assert plan.predicted_peak_bytes == pytest.approx(plan.measured_peak_bytes, rel=0.15)
    assert plan.full_batch_peak_bytes == pytest.approx(full, rel=0.15)
    assert plan.representation_bytes == 2 * BATCH * 8 * 8  # two towers, 8 float64 per sample
    assert plan.extra_forward_fraction > 0  # one more forward per sample (its size is timing: not asserted)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert "micro-batches of" in str(plan) and plan.to_dict()["batch"] == BATCH


def test_budget_below_the_loss_phase_is_infeasible_and_says_the_minimum() -> None:
    model, encode, loss_fn = setup()
    with pytest.raises(InfeasibleBudgetError, match="micro-batches of 1 sample") as caught:
        mb.plan_cached(
            encode, loss_fn, lambda b: make_batch(b, seed=1), batch=BATCH, memory=10_000, model=model
        )
    assert caught.value.minimum_bytes > 10_000
    assert set(caught.value.parts) == {"weights_bytes", "loss_phase_bytes", "encode_phase_bytes"}


def test_a_batch_that_fits_whole_is_planned_without_caching() -> None:
    model, encode, loss_fn = setup()
    batch = make_batch(BATCH, seed=1)
    full = measured_peak(model, lambda: loss_fn(encode(batch)).backward())
    budget = 4 * full  # the whole batch fits with room to spare (issue 25: it recommended caching)
    plan = mb.plan_cached(
        encode, loss_fn, lambda b: make_batch(b, seed=1), batch=BATCH, memory=budget, model=model
    )
    assert not plan.caching and plan.micro_batch_size == BATCH
    assert plan.extra_forward_fraction == 0.0
    assert plan.seconds_per_step == plan.full_batch_seconds_per_step
    assert plan.predicted_peak_bytes == plan.full_batch_peak_bytes
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert plan.measured_peak_bytes == pytest.approx(full, rel=0.15)
    assert str(plan).startswith(f"no gradient caching needed: batch {BATCH} fits whole")
    assert all(p.grad is None for p in model.parameters())
