"""Faults a user can cause in the Accumulator: each gets a clear answer and loses nothing (issue #11).

Numerical checks run in float64 against the full-batch reference computed here, with rtol 1e-10 and
atol 1e-12: summation order, the one normalising multiply and (after a failed step) its undoing
are the only differences from the full batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import microbatch as mb
from equivalence import assert_grads_close, full_batch_grads, grads_of
from microbatch.accumulate import corrected_momentum
from microbatch.errors import UsageError
from microbatch.trees.batches import split_batch

F64 = {"rtol": 1e-10, "atol": 1e-12}


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return nn.functional.mse_loss(model(x), y), x.shape[0]


def data(num: int = 12, width: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num, width, generator=g, dtype=torch.float64),
        torch.randn(num, 1, generator=g, dtype=torch.float64),
    )


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """torch.nn.utils.clip_grad_norm_'s rule, written out: g * min(1, max_norm / (|g| + 1e-6))."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
    return {name: g * coefficient for name, g in grads.items()}


class FailOnce(torch.optim.SGD):
    """SGD whose first step raises, as an optimizer running out of memory for its state would."""

    failures = 1

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.failures:
            self.failures -= 1
            raise RuntimeError("optimizer failed")
        return super().step(closure)


def run_window(acc: mb.Accumulator, model: nn.Module, micro_batches: list[Any]) -> None:
    """Forward and backward of every micro-batch of one window; no step()."""
    for micro in micro_batches:
        loss, items = mse(model, micro)
        acc.backward(loss, items=items)


# ----------------------------------------------------------------------------- step() is transactional
@pytest.mark.parametrize("use_scaler", [False, True])
def test_step_that_raises_restores_the_gradients_and_a_retry_is_exact(use_scaler: bool) -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    max_norm = 0.05  # well below the gradient's norm: clipping acts
    optimizer = FailOnce(model.parameters(), lr=0.0)
    captured: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(model)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if use_scaler else None
    acc = mb.Accumulator(model, optimizer, steps=3, max_grad_norm=max_norm, scaler=scaler)
    run_window(acc, model, split_batch(batch, [4, 4, 4]))
    before = grads_of(model)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        acc.step()
    assert_grads_close(grads_of(model), before, **F64)
    stats = acc.step()  # the retry
    assert_grads_close(captured, clipped(reference, max_norm), **F64)
    assert stats.window == 0 and stats.items == 12 and not stats.skipped
    assert all(p.grad is None for p in model.parameters())


class NoLearningRate(torch.optim.Optimizer):
    """A valid optimizer whose groups have no 'lr' (transformers' Adafactor with lr=None is one)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, defaults={"scale": 0.5})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["scale"] * p.grad)


def test_optimizer_without_lr_steps_and_reports_lr_none() -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    expected = {name: p.detach() - 0.5 * reference[name] for name, p in model.named_parameters()}
    acc = mb.Accumulator(model, NoLearningRate(model.parameters()), steps=2)
    run_window(acc, model, split_batch(batch, [6, 6]))
    stats = acc.step()
    assert stats.lr is None
    assert "lr none" in str(stats)
    assert_grads_close({n: p.detach() for n, p in model.named_parameters()}, expected, **F64)


# ------------------------------------------------------------------- GradScaler, unstepped parameters
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trained = nn.Linear(5, 1)
        self.other = nn.Linear(5, 1)  # requires grad, but the optimizer does not hold it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(x) + self.other(x)


def test_scaler_with_parameters_outside_the_optimizer_clips_only_the_optimizers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TwoHeads().double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    trained = {name: g for name, g in reference.items() if name.startswith("trained.")}
    optimizer = torch.optim.SGD(model.trained.parameters(), lr=0.0)
    captured: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(
        lambda *_: captured.update({n: g for n, g in grads_of(model).items() if n.startswith("trained.")})
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        acc = mb.Accumulator(model, optimizer, steps=2, max_grad_norm=0.05, scaler=scaler)
        run_window(acc, model, split_batch(batch, [6, 6]))
        stats = acc.step()
    assert_grads_close(captured, clipped(trained, 0.05), **F64)
    expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in trained.values()]))
    assert stats.grad_norm == pytest.approx(float(expected_norm), rel=1e-9)
    warnings = [r for r in caplog.records if "not in the optimizer" in r.getMessage()]
    assert len(warnings) == 1


# ------------------------------------------------------------------- BatchNorm momentum, manual loop
def test_batchnorm_momentum_correction_applies_in_a_manual_loop() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=0.1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = 4
    acc = mb.Accumulator(model, optimizer, steps=steps, correct_batchnorm_momentum=True)
    norm = model[1]
    x = torch.randn(8, 4, dtype=torch.float64)
    start = norm.running_mean.clone()
    with torch.no_grad():
        batch_mean = model[0](x).mean(0)
    for _ in range(steps):  # the same micro-batch N times: the window's batch mean is batch_mean
        acc.backward(model(x).pow(2).mean(), items=8)
    acc.step()
    # One update with momentum 0.1 over the window: (1 - 0.1) * start + 0.1 * batch_mean.
    torch.testing.assert_close(norm.running_mean, 0.9 * start + 0.1 * batch_mean, rtol=1e-12, atol=1e-12)
    assert norm.momentum == pytest.approx(corrected_momentum(0.1, steps))


# ----------------------------------------------------------------------------- a loader that raises
def test_discard_window_after_a_loader_raised_leaves_the_accumulator_usable() -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    micro_batches = split_batch(batch, [4, 4, 4])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(model)))
    acc = mb.Accumulator(model, optimizer, steps=3)

    def broken() -> Iterator[Any]:
        yield from split_batch(data(seed=5), [4, 4, 4])[:2]  # other data, whose gradient must not leak
        raise OSError("the file system went away")

    with pytest.raises(OSError, match="went away"):
        for micro in acc.iterate(broken()):
            loss, items = mse(model, micro.batch)
            acc.backward(loss, items=items)
    with pytest.raises(UsageError, match="middle of window 0"):
        acc.state_dict()
    acc.discard_window()
    assert acc.state_dict()["window"] == 0
    stats = None
    for micro in acc.iterate(micro_batches):
        loss, items = mse(model, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            stats = acc.step()
    reference, _ = full_batch_grads(model, mse, batch)
    assert_grads_close(captured, reference, **F64)
    assert stats is not None and stats.window == 0 and stats.items == 12


# ----------------------------------------------------------------------------- no look-ahead
class RefillingLoader:
    """Refills one buffer in place for each item, as pinned-memory and streaming loaders do."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.fetched = 0
        self.buffer = torch.zeros(1, 1)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.count):
            self.fetched += 1
            self.buffer.fill_(float(i))
            yield self.buffer


def test_iterate_yields_each_micro_batch_before_fetching_the_next() -> None:
    model = nn.Linear(1, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=3)
    loader = RefillingLoader(6)
    seen, fetched_at_step = [], []
    for micro in acc.iterate(loader):
        seen.append(float(micro.batch))
        acc.backward(model(micro.batch).sum(), items=1)
        if micro.is_last:
            acc.step()
            fetched_at_step.append(loader.fetched)  # where a saved loader state would resume
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert fetched_at_step == [3, 6]


def test_iterate_without_a_length_does_not_fetch_past_a_window_end() -> None:
    model = nn.Linear(1, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2)
    loader = RefillingLoader(5)
    fetched_at_step = []
    for micro in acc.iterate(iter(loader)):  # a plain iterator: no len()
        acc.backward(model(micro.batch).sum(), items=1)
        if micro.is_last:
            acc.step()
            fetched_at_step.append(loader.fetched)
    assert fetched_at_step == [2, 4, 5]


class WrongLength(RefillingLoader):
    def __init__(self, count: int, claimed: int) -> None:
        super().__init__(count)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed


def test_a_loader_longer_than_its_len_is_read_to_the_end(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(1, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2)
    items = []
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for micro in acc.iterate(WrongLength(5, claimed=3)):
            acc.backward(model(micro.batch).sum(), items=1)
            if micro.is_last:
                items.append(acc.step().items)
    assert sum(items) == 5
    assert any("len() said" in r.getMessage() for r in caplog.records)


def test_a_loader_shorter_than_its_len_raises_a_clear_error() -> None:
    model = nn.Linear(1, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=4)
    with pytest.raises(UsageError, match="promised 6"):
        for micro in acc.iterate(WrongLength(3, claimed=6)):
            acc.backward(model(micro.batch).sum(), items=1)
            if micro.is_last:
                acc.step()
    acc.step(partial=True)  # the message's way out: the three micro-batches are applied
    assert acc.window == 1


def test_errors_a_user_catches_are_exported() -> None:
    errors = (
        "CheckpointError",
        "ConfigError",
        "InfeasibleBudgetError",
        "ResumeError",
        "UsageError",
        "WorkloadError",
    )
    for name in ("MicrobatchError", *errors):
        error = getattr(mb, name)
        assert issubclass(error, mb.MicrobatchError)
        assert name in mb.__all__
