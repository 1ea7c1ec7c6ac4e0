"""plan.apply holds to the options that change memory, which the plan was made with."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.errors import ConfigError


def _plan(**fields: object) -> mb.Plan:
    """A manual plan stated as the planner's (source "planner"), with the given option fields."""
    manual = mb.Plan.manual(batch_size=8, micro_batch_size=4)
    return dataclasses.replace(manual, source="planner", **fields)  # type: ignore[arg-type]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 1).to(torch.bfloat16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_different_accumulate_dtype_is_refused_by_name() -> None:
    model, optimizer = _model()
    with pytest.raises(ConfigError, match=r"accumulate_dtype=float64.*made with accumulate_dtype=float32"):
        _plan(accumulate_dtype="float32").apply(model, optimizer, accumulate_dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"accumulate_dtype=float32.*made with accumulate_dtype=None"):
        _plan().apply(model, optimizer, accumulate_dtype=torch.float32)


def test_the_plans_accumulate_dtype_is_used_when_not_given() -> None:
    model, optimizer = _model()
    accumulator = _plan(accumulate_dtype="float32").apply(model, optimizer)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    accumulator.backward(model(x).float().mean(), items=2)
    # Summed wide: the hook moved the bfloat16 gradient into a float32 sum, .grad is empty again.
    assert all(p.grad is None for p in model.parameters())


def test_a_scaler_the_plan_did_not_measure_is_refused() -> None:
    model, optimizer = _model()
    with pytest.raises(ConfigError, match=r"scaler=True"):
        _plan().apply(model, optimizer, scaler=torch.amp.GradScaler("cpu"))
    assert _plan(scaler=True).apply(model, optimizer, scaler=torch.amp.GradScaler("cpu")).scaler is not None


def test_the_sync_mode_is_the_plans() -> None:
    model, optimizer = _model()
    assert _plan(gradient_sync="micro-batch").apply(model, optimizer).sync_every_micro_batch
    mb.Plan.remove(_plan(), model)
    with pytest.raises(ConfigError, match=r"gradient_sync='window'"):
        _plan().apply(nn.Linear(2, 1), optimizer, sync_every_micro_batch=True)


def test_a_manual_plan_takes_any_option() -> None:
    model, optimizer = _model()
    plan = mb.Plan.manual(batch_size=8, micro_batch_size=4)
    accumulator = plan.apply(
        model, optimizer, scaler=torch.amp.GradScaler("cpu"), accumulate_dtype=torch.float32
    )
    assert accumulator.scaler is not None


def test_the_options_are_saved_and_loaded() -> None:
    plan = _plan(accumulate_dtype="float32", scaler=True, gradient_sync="micro-batch")
    loaded = mb.Plan.from_dict(plan.to_dict())
    assert (loaded.accumulate_dtype, loaded.scaler, loaded.gradient_sync) == ("float32", True, "micro-batch")
