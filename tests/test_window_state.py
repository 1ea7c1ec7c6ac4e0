"""The window's state has one owner and one discard path; misuse is caught at the call (issue 22).

Numerical checks compare against the full batch computed here: float64 with rtol 1e-10 and
atol 1e-12 (summation order and the one normalising multiply are the only differences), and for
the bfloat16 model against the same window run alone (bitwise) and the float64 full batch (bf16's
rounding of the final gradient, rtol 1e-2).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

import microbatch as mb
from equivalence import assert_grads_close, full_batch_grads, grads_of
from microbatch.errors import ConfigError, UsageError
from microbatch.trees.batches import split_batch
from test_host_sync import ScalarReads

F64 = {"rtol": 1e-10, "atol": 1e-12}


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return nn.functional.mse_loss(model(x), y), x.shape[0]


def data(num: int = 12, width: int = 5, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, width, generator=g).to(dtype), torch.randn(num, 1, generator=g).to(dtype)


def run_window(acc: mb.Accumulator, model: nn.Module, micro_batches: list[Any]) -> None:
    for micro in micro_batches:
        loss, items = mse(model, micro)
        acc.backward(loss, items=items)


def capture(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients just before each optimizer step (the latest one)."""
    captured: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: captured.update(grads_of(model)))
    return captured


# ------------------------------------------------------------------ accumulate_dtype: one discard path
def test_a_window_discarded_by_the_item_check_leaves_no_wide_sums_behind() -> None:
    base = nn.Linear(5, 1).to(torch.bfloat16)
    good = data(seed=1, dtype=torch.bfloat16)

    def good_window(model: nn.Module, acc: mb.Accumulator) -> None:
        run_window(acc, model, split_batch(good, [4, 4, 4]))
        acc.step()

    # The good window alone, on its own copy.
    alone = copy.deepcopy(base)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=0.0)
    expected = capture(alone_optimizer, alone)
    good_window(alone, mb.Accumulator(alone, alone_optimizer, steps=3, accumulate_dtype=torch.float32))

    # A window whose device item count is negative: step() discards it; then the same good window.
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    acc = mb.Accumulator(model, optimizer, steps=3, accumulate_dtype=torch.float32)
    bad = data(seed=2, dtype=torch.bfloat16)
    for i, micro in enumerate(split_batch(bad, [4, 4, 4])):
        loss, _ = mse(model, micro)
        acc.backward(loss, items=torch.tensor(-4 if i == 2 else 4))
    with pytest.raises(ConfigError, match="negative"):
        acc.step()
    good_window(model, acc)
    for name in expected:  # bitwise: nothing of the discarded window remains
        assert torch.equal(captured[name], expected[name]), name
    reference, _ = full_batch_grads(copy.deepcopy(base).double(), mse, (good[0].double(), good[1].double()))
    for name, grad in captured.items():
        torch.testing.assert_close(grad.double(), reference[name], rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ two Accumulators on one model
def test_a_second_accumulator_beside_one_with_wide_hooks_is_refused_until_close() -> None:
    model = nn.Linear(5, 1).to(torch.bfloat16)
    first = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.float32)
    for options in ({"accumulate_dtype": torch.float32}, {}):
        with pytest.raises(UsageError, match=r"close\(\)"):
            mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
    first.close()
    with pytest.raises(UsageError, match="closed"):
        first.backward(model(torch.ones(2, 5, dtype=torch.bfloat16)).mean(), items=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    second = mb.Accumulator(model, optimizer, steps=2, accumulate_dtype=torch.float32)
    batch = data(num=4, dtype=torch.bfloat16)
    run_window(second, model, split_batch(batch, [2, 2]))
    second.step()  # the gradients went to the second one's sums, not the closed first's
    reference, _ = full_batch_grads(
        copy.deepcopy(model).double(), mse, (batch[0].double(), batch[1].double())
    )
    assert captured.keys() == reference.keys()
    for name, grad in captured.items():
        torch.testing.assert_close(grad.double(), reference[name], rtol=1e-2, atol=1e-2)
    plain = nn.Linear(5, 1).to(torch.bfloat16)
    plain_acc = mb.Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    with pytest.raises(UsageError, match="still open"):  # a wide one beside a plain one: refused too
        mb.Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1), accumulate_dtype=torch.float32)
    plain_acc.close()


def test_plain_accumulators_on_one_model_are_independent_and_exact() -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    first = mb.Accumulator(model, optimizer, steps=2)
    second = mb.Accumulator(model, optimizer, steps=3)
    run_window(first, model, split_batch(batch, [6, 6]))
    first.step()
    assert_grads_close(captured, reference, **F64)
    run_window(second, model, split_batch(batch, [4, 4, 4]))
    second.step()
    assert_grads_close(captured, reference, **F64)


def test_plan_remove_closes_the_accumulator_plan_apply_built() -> None:
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 1)).to(torch.bfloat16)
    plan = mb.Plan.manual(batch_size=8, micro_batch_size=4)
    acc = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.float32)
    with pytest.raises(UsageError, match="still open"):
        mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.float32)
    plan.remove(model)
    with pytest.raises(UsageError, match="closed"):
        acc.step()
    x = torch.ones(2, 5, dtype=torch.bfloat16)
    model(x).sum().backward()  # no hook takes the gradient any more
    assert all(p.grad is not None for p in model.parameters())
    mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.float32)


# ------------------------------------------------------------------ double loss scaling
@pytest.mark.parametrize("extra", ["none", "divided", "mean"])
def test_a_loss_already_scaled_by_the_accumulators_scaler_is_refused(extra: str) -> None:
    model = nn.Linear(5, 1).double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, scaler=scaler)
    x, y = data()
    loss = nn.functional.mse_loss(model(x), y)
    scaled = scaler.scale(loss)  # PyTorch's AMP recipe, which the Accumulator already follows
    scaled = {"none": scaled, "divided": scaled / 2, "mean": scaled.reshape(1).mean()}[extra]
    with ScalarReads() as reads, pytest.raises(ConfigError, match="scaled twice"):
        acc.backward(scaled, items=12)
    assert reads.count == 0  # told apart without reading the scale from the device
    assert model.weight.grad is None and acc._state.micro_batches == 0


def test_an_unscaled_loss_with_a_scaler_is_exact_and_reads_nothing_per_micro_batch() -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    acc = mb.Accumulator(model, optimizer, steps=3, scaler=scaler)
    scaler.scale(torch.ones(())).detach()  # the scale exists before the first backward (a second window)
    per_micro = []
    with ScalarReads() as reads:
        for micro in split_batch(batch, [4, 4, 4]):
            before = reads.count
            loss, items = mse(model, micro)
            acc.backward(loss * 1.0, items=items)  # a multiply by a number is no scaling
            per_micro.append(reads.count - before)
    acc.step()
    assert per_micro == [0, 0, 0]
    assert_grads_close(captured, reference, **F64)


# ------------------------------------------------------------------ a failing scheduler
class FailingScheduler:
    """A scheduler whose first step raises (a user's schedule with a bug, a full log disk)."""

    def __init__(self) -> None:
        self.steps = 0
        self.failures = 1

    def step(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("scheduler failed")
        self.steps += 1


def test_a_failing_scheduler_leaves_step_retryable_with_one_optimizer_step() -> None:
    model = nn.Linear(5, 1).double()
    batch = data()
    reference, _ = full_batch_grads(model, mse, batch)
    expected = {name: p.detach() - 0.5 * reference[name] for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    scheduler = FailingScheduler()
    acc = mb.Accumulator(model, optimizer, steps=3, scheduler=scheduler)
    run_window(acc, model, split_batch(batch, [4, 4, 4]))
    with pytest.raises(RuntimeError, match="scheduler failed"):
        acc.step()
    assert acc.step_began and len(optimizer_steps) == 1
    with pytest.raises(UsageError, match="unfinished"):
        acc.backward(mse(model, batch)[0], items=12)
    with pytest.raises(UsageError, match="call step"):
        acc.discard_window()
    with pytest.raises(UsageError, match="middle of window 0"):
        acc.state_dict()
    stats = acc.step()  # the retry: only the scheduler step is left
    assert len(optimizer_steps) == 1 and scheduler.steps == 1
    assert stats.window == 0 and stats.items == 12 and acc.window == 1 and not acc.step_began
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], **F64)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ an optimizer that raised half-way
class HalfStep(torch.optim.SGD):
    """SGD that updates its first parameter and then raises, as an OOM in the middle of a step."""

    failures = 1

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.failures:
            self.failures -= 1
            first = self.param_groups[0]["params"][0]
            first.sub_(self.param_groups[0]["lr"] * first.grad)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().step(closure)


def test_an_optimizer_that_changed_parameters_before_raising_is_not_retried() -> None:
    model = nn.Linear(5, 1).double()
    optimizer = HalfStep(model.parameters(), lr=0.5)
    acc = mb.Accumulator(model, optimizer, steps=2)
    run_window(acc, model, split_batch(data(), [6, 6]))
    with pytest.raises(torch.OutOfMemoryError):
        acc.step()
    assert acc.step_began
    with pytest.raises(UsageError, match="apply part of the step twice"):
        acc.step()
    with pytest.raises(UsageError, match="unfinished"):
        acc.backward(mse(model, data())[0], items=12)
    acc.discard_window()  # after restoring from a checkpoint, as the message says
    assert not acc.step_began and acc.window == 0
    # The next window is exact from zero gradients.
    batch = data(seed=3)
    reference, _ = full_batch_grads(model, mse, batch)
    captured = capture(optimizer, model)
    run_window(acc, model, split_batch(batch, [6, 6]))
    acc.step()
    assert_grads_close(captured, reference, **F64)


class StateThenFail(torch.optim.AdamW):
    """AdamW running out of memory while allocating its state at the first step (state half made)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        first = self.param_groups[0]["params"][0]
        self.state[first]["exp_avg"] = torch.zeros_like(first)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_optimizer_state_created_before_the_failure_counts_as_a_begun_step() -> None:
    model = nn.Linear(5, 1).double()
    acc = mb.Accumulator(model, StateThenFail(model.parameters(), lr=0.1), steps=2)
    run_window(acc, model, split_batch(data(), [6, 6]))
    with pytest.raises(torch.OutOfMemoryError):
        acc.step()
    with pytest.raises(UsageError, match="twice"):
        acc.step()


# ------------------------------------------------------------------ iterate() misuse
def test_partial_step_inside_iterate_and_a_nested_iterate_are_refused() -> None:
    model = nn.Linear(5, 1).double()
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    micro_batches = split_batch(data(), [4, 4, 4])
    for micro in acc.iterate(micro_batches):
        loss, items = mse(model, micro.batch)
        acc.backward(loss, items=items)
        if micro.index == 0:
            with pytest.raises(UsageError, match="middle of iterate"):
                acc.step(partial=True)
            with pytest.raises(UsageError, match="another iterate"):
                next(iter(acc.iterate(micro_batches)))
        if micro.is_last:
            stats = acc.step()
    assert stats.micro_batches == 3 and stats.items == 12
    for micro in acc.iterate(micro_batches):  # the first loop ended: a new one runs
        acc.backward(mse(model, micro.batch)[0], items=4)
        if micro.is_last:
            acc.step()
    assert acc.window == 2


def test_partial_step_outside_iterate_still_ends_a_window_exactly() -> None:
    model = nn.Linear(5, 1).double()
    batch = data(num=8)
    reference, _ = full_batch_grads(model, mse, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    acc = mb.Accumulator(model, optimizer, steps=3)
    run_window(acc, model, split_batch(batch, [4, 4]))
    acc.step(partial=True)
    assert_grads_close(captured, reference, **F64)


# ------------------------------------------------------------------ load_state_dict
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window", -5),
        ("window", math.nan),
        ("window", "3"),
        ("window", True),
        ("window", 2.5),
        ("items_per_micro", math.nan),
        ("items_per_micro", "12"),
        ("items_per_micro", -1.0),
        ("items_per_micro", math.inf),
    ],
)
def test_load_state_dict_refuses_bad_fields_naming_them(field: str, value: object) -> None:
    model = nn.Linear(5, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = acc.state_dict()
    state[field] = value
    with pytest.raises(ConfigError, match=f"'{field}'"):
        acc.load_state_dict(state)
    assert acc.window == 0 and acc.state_dict() == {"version": 1, "window": 0, "items_per_micro": None}
    good = {"version": 1, "window": 7, "items_per_micro": 12.0}
    acc.load_state_dict(good)
    assert acc.state_dict() == good


# ------------------------------------------------------------------ the plan's batch
def test_plan_apply_warns_once_when_windows_are_not_the_plans_batch(caplog: pytest.LogCaptureFixture) -> None:
    plan = mb.Plan.manual(batch_size=128, micro_batch_size=19)
    assert plan.micro_batch_sizes == (19,) * 6 + (14,) and plan.steps == 7
    model = nn.Linear(5, 1).double()
    acc = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = data(num=3 * 133)
    # The README loop fed from DataLoader(batch_size=plan.micro_batch_size): 7 x 19 = 133 per window.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=19)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        windows = []
        for micro in acc.iterate(loader):
            acc.backward(mse(model, micro.batch)[0], items=micro.batch[0].shape[0])
            if micro.is_last:
                windows.append(acc.step().items)
    assert windows == [133, 133, 133]
    warnings = [r for r in caplog.records if "plan's batch is 128" in r.getMessage()]
    assert len(warnings) == 1 and "held 133 samples" in warnings[0].getMessage()
    assert "plan.micro_batch_sizes" in warnings[0].getMessage()
    plan.remove(model)


def test_the_plans_split_feeds_its_batch_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    plan = mb.Plan.manual(batch_size=128, micro_batch_size=19)
    model = nn.Linear(5, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    acc = plan.apply(model, optimizer)
    batches = [data(num=128, seed=seed) for seed in (1, 2)]
    micro_batches = [micro for batch in batches for micro in plan.split(batch)]
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for micro in acc.iterate(micro_batches):
            acc.backward(mse(model, micro.batch)[0], items=micro.batch[0].shape[0])
            if micro.is_last:
                assert acc.step().items == 128
    assert "plan's batch" not in caplog.text
    reference, _ = full_batch_grads(model, mse, batches[1])
    assert_grads_close(captured, reference, **F64)
    plan.remove(model)


def test_a_dropped_accumulator_is_freed_at_once_with_its_hooks() -> None:
    import gc
    import weakref

    model = nn.Linear(5, 1).to(torch.bfloat16)
    gc.disable()  # freed by reference counting alone: no cycle keeps its hooks taking gradients
    try:
        acc = mb.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.float32
        )
        for micro in acc.iterate([torch.ones(2, 5, dtype=torch.bfloat16)]):
            acc.backward(model(micro.batch).mean(), items=2)
            acc.step()
        gone = weakref.ref(acc)
        del acc, micro
        assert gone() is None
        model(torch.ones(2, 5, dtype=torch.bfloat16)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        gc.enable()


@pytest.mark.parametrize(("sizes", "warns"), [([19] * 7, True), ([19] * 6 + [10], False)])
def test_one_window_per_iterate_is_checked_against_the_plans_batch(
    sizes: list[int], warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """More samples than the plan's batch always warn; fewer only when more data follows (a short
    last batch at the data's end is no misfeed)."""
    plan = mb.Plan.manual(batch_size=128, micro_batch_size=19)
    model = nn.Linear(5, 1).double()
    acc = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for micro in acc.iterate(split_batch(data(num=sum(sizes)), sizes)):
            acc.backward(mse(model, micro.batch)[0], items=micro.batch[0].shape[0])
            if micro.is_last:
                assert acc.step().items == sum(sizes)
    assert ("plan's batch is 128" in caplog.text) == warns
    plan.remove(model)


def test_a_failure_while_normalising_refuses_the_retry_and_the_next_window_is_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from microbatch.accumulate import window as window_module

    model = nn.Linear(5, 1).double()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture(optimizer, model)
    acc = mb.Accumulator(model, optimizer, steps=2, scaler=scaler, max_grad_norm=0.05)
    real_norm = window_module.total_norm

    def out_of_memory(grads: list[torch.Tensor]) -> float:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    run_window(acc, model, split_batch(data(seed=4), [6, 6]))
    monkeypatch.setattr(window_module, "total_norm", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        acc.step()  # after unscale_, before the optimizer: the gradients are partly scaled
    monkeypatch.setattr(window_module, "total_norm", real_norm)
    assert not acc.step_began  # nothing was stepped: a training loop may run the window again
    with pytest.raises(UsageError, match="partly scaled"):
        acc.step()
    acc.discard_window()
    batch = data(seed=5)
    reference, _ = full_batch_grads(model, mse, batch)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference.values()]))
    clip = min(1.0, 0.05 / (float(norm) + 1e-6))  # clip_grad_norm_'s coefficient
    run_window(acc, model, split_batch(batch, [6, 6]))
    acc.step()  # the scaler unscales again: it forgot the failed window's unscale_
    assert_grads_close(captured, {name: g * clip for name, g in reference.items()}, **F64)


def test_cached_backward_on_an_empty_batch_is_a_clear_error() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="empty batch"):
        mb.cached_backward(model, torch.zeros(0, 3), lambda r: r.sum(), micro_batch_size=2)
    assert all(p.grad is None for p in model.parameters())
