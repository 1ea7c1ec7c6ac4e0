"""Schedules against references written out in the test: Ultralytics' loop and formulas, Goyal et al."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.accumulate.schedules import (
    accumulation_schedule,
    lr_multiplier,
    lr_scale_factor,
    nominal_accumulation,
    scale_lr,
    scaled_weight_decay,
    warmup_accumulation,
    warmup_iterations_for,
    warmup_lr,
)
from microbatch.errors import ConfigError


def ultralytics_accumulate(ni: int, *, batch: int, nw: int, nbs: int = 64) -> int:
    """What Ultralytics' trainer holds in self.accumulate at micro-batch ni (numpy, as it does)."""
    accumulate = max(round(nbs / batch), 1)
    if ni <= nw:
        accumulate = max(1, int(np.interp(ni, [0, nw], [1, nbs / batch]).round()))
    return accumulate


def ultralytics_window_lengths(*, batch: int, nw: int, num_micro: int, nbs: int = 64) -> list[int]:
    """Micro-batches per optimizer step in Ultralytics' loop: step once ni - last_opt_step >= accumulate."""
    lengths, last_opt_step = [], -1
    for ni in range(num_micro):
        if ni - last_opt_step >= ultralytics_accumulate(ni, batch=batch, nw=nw, nbs=nbs):
            lengths.append(ni - last_opt_step)
            last_opt_step = ni
    return lengths


@pytest.mark.parametrize(
    ("batch", "expected"), [(16, 4), (8, 8), (64, 1), (128, 1), (24, 3), (40, 2), (1, 64), (256, 1)]
)
def test_nominal_accumulation(batch: int, expected: int) -> None:
    assert nominal_accumulation(batch) == expected == max(round(64 / batch), 1)


def test_nominal_accumulation_rounds_half_to_even_like_ultralytics() -> None:
    # 64 / 128 = 0.5 -> 0 -> clamped to 1; 10 / 4 = 2.5 -> 2; 14 / 4 = 3.5 -> 4
    assert nominal_accumulation(128) == 1
    assert nominal_accumulation(4, nominal_batch=10) == 2
    assert nominal_accumulation(4, nominal_batch=14) == 4


@pytest.mark.parametrize("batch", [1, 3, 8, 16, 24, 48, 100])
@pytest.mark.parametrize("nw", [0, 1, 7, 100])
def test_warmup_accumulation_matches_numpy_interp(batch: int, nw: int) -> None:
    for ni in range(0, nw + 20):
        assert warmup_accumulation(ni, batch=batch, warmup_iterations=nw) == ultralytics_accumulate(
            ni, batch=batch, nw=nw
        ), (ni, batch, nw)


def test_warmup_values_batch_16() -> None:
    # interp(i, [0, 100], [1, 4]) = 1 + 3 i / 100, rounded half to even.
    values = [
        warmup_accumulation(i, batch=16, warmup_iterations=100) for i in (0, 16, 17, 49, 50, 51, 84, 100, 500)
    ]
    assert values == [1, 1, 2, 2, 2, 3, 4, 4, 4]  # 1.48 -> 1, 1.51 -> 2, 2.5 -> 2, 2.53 -> 3, 3.52 -> 4


def test_warmup_iterations_for() -> None:
    assert warmup_iterations_for(3, batches_per_epoch=10) == 100  # max(round(3 * 10), 100)
    assert warmup_iterations_for(3, batches_per_epoch=1000) == 3000
    assert warmup_iterations_for(0.5, batches_per_epoch=301, minimum=0) == round(0.5 * 301)


@pytest.mark.parametrize(("batch", "nw"), [(16, 100), (8, 37), (5, 250), (64, 10), (16, 0)])
def test_accumulation_schedule_reproduces_ultralytics_loop(batch: int, nw: int) -> None:
    expected = ultralytics_window_lengths(batch=batch, nw=nw, num_micro=nw + 200)
    schedule = accumulation_schedule(batch=batch, warmup_iterations=nw)
    assert [schedule(w) for w in range(len(expected))] == expected
    # Pure in the window index: a fresh schedule asked out of order gives the same answers.
    fresh = accumulation_schedule(batch=batch, warmup_iterations=nw)
    for window in reversed(range(len(expected))):
        assert fresh(window) == expected[window]


def test_accumulation_schedule_drives_the_accumulator() -> None:
    model = nn.Linear(2, 1)
    acc = mb.Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        steps=accumulation_schedule(batch=16, warmup_iterations=30),
    )
    data = [(torch.randn(16, 2), torch.randn(16, 1))] * 60
    lengths = []
    for m in acc.iterate(data):
        acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
        if m.is_last:
            lengths.append(acc.step().micro_batches)
    expected = ultralytics_window_lengths(batch=16, nw=30, num_micro=60)
    assert lengths[: len(expected)] == expected
    assert sum(lengths) == 60


@pytest.mark.parametrize(
    ("batch", "wd_factor"), [(16, 1.0), (8, 1.0), (24, 24 * 3 / 64), (128, 2.0), (1, 1.0)]
)
def test_scaled_weight_decay(batch: int, wd_factor: float) -> None:
    accumulate = max(round(64 / batch), 1)
    value = scaled_weight_decay(5e-4, batch=batch, accumulation=accumulate)
    assert value == pytest.approx(5e-4 * batch * accumulate / 64, rel=1e-15)
    assert value == pytest.approx(5e-4 * wd_factor, rel=1e-15)


def test_lr_scaling_rules() -> None:
    # Goyal et al.: 256 -> 8192 multiplies the rate by 32 (linear); the square-root rule by sqrt(32).
    assert scale_lr(0.1, base_batch=256, batch=8192) == pytest.approx(3.2, rel=1e-15)
    assert scale_lr(1e-3, base_batch=256, batch=8192, rule="sqrt") == pytest.approx(1e-3 * math.sqrt(32))
    assert lr_scale_factor(base_batch=64, batch=16) == 0.25
    assert lr_scale_factor(base_batch=64, batch=16, rule="sqrt") == 0.5


def test_warmup_lr_is_linear_from_start_to_target() -> None:
    values = [warmup_lr(step, lr=3.2, warmup_steps=5, start_lr=0.1) for step in range(8)]
    expected = [0.1 + (3.2 - 0.1) * min(step, 5) / 5 for step in range(8)]
    assert values == pytest.approx(expected, rel=1e-14)
    assert warmup_lr(0, lr=1.0, warmup_steps=0) == 1.0


def test_lr_multiplier_with_lambda_lr_and_accumulator_steps_once_per_window() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(base_batch=256, batch=8192, warmup_steps=4)
    )
    acc = mb.Accumulator(model, optimizer, steps=2, scheduler=scheduler)
    data = [(torch.randn(4, 3), torch.randn(4, 1))] * 14
    lrs = []
    for m in acc.iterate(data):
        acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
        if m.is_last:
            lrs.append(acc.step().lr)
    expected = [0.1 + (3.2 - 0.1) * min(window, 4) / 4 for window in range(7)]
    assert lrs == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: nominal_accumulation(0), "batch"),
        (lambda: nominal_accumulation(16, nominal_batch=0), "nominal_batch"),
        (lambda: nominal_accumulation(2.5), "batch"),  # type: ignore[arg-type]
        (lambda: warmup_accumulation(-1, batch=16, warmup_iterations=10), "iteration"),
        (lambda: accumulation_schedule(batch=16, warmup_iterations=-5), "warmup_iterations"),
        (lambda: accumulation_schedule(batch=16)(-1), "window"),
        (lambda: scaled_weight_decay(-1.0, batch=16, accumulation=4), "weight_decay"),
        (lambda: scaled_weight_decay(5e-4, batch=16, accumulation=0), "accumulation"),
        (lambda: scale_lr(0.1, base_batch=256, batch=512, rule="cubic"), "rule"),  # type: ignore[arg-type]
        (lambda: scale_lr(float("nan"), base_batch=256, batch=512), "base_lr"),
        (lambda: warmup_lr(0, lr=1.0, warmup_steps=-1), "warmup_steps"),
        (lambda: warmup_iterations_for(-1, batches_per_epoch=10), "warmup_epochs"),
    ],
)
def test_bad_arguments(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        call()
