"""The Accumulator against the full-batch reference.

Tolerances: float32 comparisons use atol 1e-6 (the seed documents' example reports 1.6e-7);
float64 comparisons use rtol 1e-10, atol 1e-12: summation order and the one normalising
multiply at step() are the only differences from the full batch.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import microbatch as mb
from equivalence import accumulated_grads, assert_grads_close, full_batch_grads, grads_of, max_relative_error
from microbatch.errors import ConfigError, UsageError
from microbatch.trees.batches import split_batch

F64 = {"rtol": 1e-10, "atol": 1e-12}


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return nn.functional.mse_loss(model(x), y), x.shape[0]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def token_mean(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = batch
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, (labels != -100).sum()


def padded_lm_batch(
    num: int, length: int = 12, vocab: int = 11, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of very different lengths, padded with label -100."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num, length), generator=g)
    labels = torch.randint(0, vocab, (num, length), generator=g)
    lengths = torch.randint(1, length + 1, (num,), generator=g)
    lengths[: num // 4] = 1  # some nearly empty sequences make per-micro-batch means clearly wrong
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
    return tokens, labels


def test_seed_example_matches_full_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    expected, _ = full_batch_grads(model, mse, (x, y))
    actual, _ = accumulated_grads(model, mse, split_batch((x, y), [8, 8, 8, 8]))
    assert_grads_close(actual, expected, rtol=0, atol=1e-6)


def test_variable_length_tokens_exact_and_dividing_by_steps_is_not() -> None:
    model = TinyLM().double()
    batch = padded_lm_batch(16)
    micro = split_batch(batch, [4, 4, 4, 4])
    expected, full_loss = full_batch_grads(model, token_mean, batch)
    actual, stats = accumulated_grads(model, token_mean, micro)
    assert_grads_close(actual, expected, **F64)
    assert stats.items == int((batch[1] != -100).sum())
    assert stats.loss == pytest.approx(full_loss, rel=1e-12)

    # The common recipe: each micro-batch's token mean divided by the number of steps.
    naive = copy.deepcopy(model)
    for piece in micro:
        (token_mean(naive, piece)[0] / len(micro)).backward()
    gap = max_relative_error(grads_of(naive), expected)
    assert gap > 1e-2, f"dividing by steps should be visibly wrong on these lengths, gap {gap:.2e}"


def test_uneven_micro_batches_and_partial_last_window_exact() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    x, y = torch.randn(23, 5, dtype=torch.float64), torch.randn(23, 2, dtype=torch.float64)
    expected, _ = full_batch_grads(model, mse, (x, y))
    # 23 samples as 8, 8, 7 with steps=4 planned: the data ends after three, a partial window.
    actual, stats = accumulated_grads(model, mse, split_batch((x, y), [8, 8, 7]), steps=4)
    assert_grads_close(actual, expected, **F64)
    assert stats.micro_batches == 3 and stats.items == 23
    # Irregular sizes within a full window.
    actual, _ = accumulated_grads(model, mse, split_batch((x, y), [1, 15, 2, 5]))
    assert_grads_close(actual, expected, **F64)


def _clip_reference(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], max_norm: float) -> dict:
    reference = copy.deepcopy(model)
    mse(reference, batch)[0].backward()
    nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    return grads_of(reference)


def test_clipping_once_equals_full_batch_clipping() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1)).double()
    x, y = torch.randn(24, 6, dtype=torch.float64), 10 * torch.randn(24, 1, dtype=torch.float64)
    max_norm = 0.5
    expected = _clip_reference(model, (x, y), max_norm)
    micro = split_batch((x, y), [6, 6, 6, 6])
    actual, stats = accumulated_grads(model, mse, micro, max_grad_norm=max_norm)
    assert_grads_close(actual, expected, **F64)
    assert stats.grad_norm > max_norm  # the reported norm is the one before clipping

    # Clipping each micro-batch's gradient on its own gives another answer.
    per_micro = copy.deepcopy(model)
    total = {n: torch.zeros_like(p) for n, p in per_micro.named_parameters()}
    for piece in micro:
        per_micro.zero_grad()
        (mse(per_micro, piece)[0] / 4).backward()
        nn.utils.clip_grad_norm_(per_micro.parameters(), max_norm)
        for n, p in per_micro.named_parameters():
            total[n] += p.grad
    assert max_relative_error(total, expected) > 1e-2


def test_window_loss_is_full_batch_loss_and_scheduler_steps_once_per_window() -> None:
    torch.manual_seed(3)
    model = nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = mb.Accumulator(model, optimizer, steps=3, scheduler=scheduler)
    x, y = torch.randn(33, 4, dtype=torch.float64), torch.randn(33, 1, dtype=torch.float64)
    micro = split_batch((x, y), [4, 3, 3] * 3 + [2, 1])  # three full windows and a partial one
    windows = []
    for m in acc.iterate(micro):
        full_window_before = copy.deepcopy(model)
        loss, items = mse(model, m.batch)
        acc.backward(loss, items=items)
        if m.is_last:
            window_samples = [p for p in micro][m.window * 3 : m.window * 3 + m.index + 1]
            wx = torch.cat([p[0] for p in window_samples])
            wy = torch.cat([p[1] for p in window_samples])
            expected_loss = float(mse(full_window_before, (wx, wy))[0].detach())
            stats = acc.step()
            assert stats.loss == pytest.approx(expected_loss, rel=1e-12)
            windows.append(stats)
    assert [s.micro_batches for s in windows] == [3, 3, 3, 2]
    assert [s.lr for s in windows] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert scheduler.last_epoch == 4 and acc.window == 4


def test_steps_schedule_varies_per_window() -> None:
    model = nn.Linear(3, 1)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=[1, 2, 3])
    lengths = []
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(12)]
    for m in acc.iterate(data):
        acc.backward(mse(model, m.batch)[0])
        if m.is_last:
            lengths.append(acc.step().micro_batches)
    assert lengths == [1, 2, 3, 3, 3]
    callable_acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=lambda w: w + 1)
    assert [callable_acc.steps_for(w) for w in range(4)] == [1, 2, 3, 4]


def test_grad_scaler_unscales_once_and_matches() -> None:
    torch.manual_seed(4)
    model = nn.Linear(8, 2)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    expected, _ = full_batch_grads(model, mse, (x, y))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    actual, stats = accumulated_grads(model, mse, split_batch((x, y), [4, 4, 8]), scaler=scaler)
    assert_grads_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert not stats.skipped
    assert scaler.get_scale() == 2.0**12  # growth_interval not reached, no inf found


def test_non_finite_gradient_skips_step_and_clears_window() -> None:
    torch.manual_seed(5)
    model = nn.Linear(4, 1)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = mb.Accumulator(model, optimizer, steps=2, scheduler=scheduler, scaler=scaler)
    x = torch.randn(8, 4)
    x[5, 0] = float("inf")  # poisons the second micro-batch's gradient
    data = split_batch((x, torch.randn(8, 1)), [4, 4])
    for m in acc.iterate(data):
        acc.backward(mse(model, m.batch)[0])
        if m.is_last:
            stats = acc.step()
    assert stats.skipped
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0**9  # backed off once
    # The next window trains normally.
    clean = split_batch((torch.randn(8, 4), torch.randn(8, 1)), [4, 4])
    for m in acc.iterate(clean):
        acc.backward(mse(model, m.batch)[0])
        if m.is_last:
            assert not acc.step().skipped
    assert scheduler.last_epoch == 1


def _train(model: nn.Module, acc: mb.Accumulator, data: list, windows: int) -> None:
    done = 0
    for m in acc.iterate(data):
        acc.backward(mse(model, m.batch)[0])
        if m.is_last:
            acc.step()
            done += 1
            if done == windows:
                return


def _objects(seed: int = 6) -> tuple[nn.Module, torch.optim.Optimizer, object, mb.Accumulator]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    acc = mb.Accumulator(model, optimizer, steps=3, scheduler=scheduler, max_grad_norm=1.0)
    return model, optimizer, scheduler, acc


def test_resume_at_window_boundary_is_bitwise_exact() -> None:
    data_gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(5, 4, generator=data_gen), torch.randn(5, 1, generator=data_gen)) for _ in range(12)]

    model, optimizer, scheduler, acc = _objects()
    _train(model, acc, data, 4)
    uninterrupted = copy.deepcopy(model.state_dict())

    model, optimizer, scheduler, acc = _objects()
    _train(model, acc, data[:6], 2)
    saved = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),  # type: ignore[attr-defined]
            "acc": acc.state_dict(),
        }
    )
    model, optimizer, scheduler, acc = _objects(seed=99)  # fresh objects, different initial weights
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])  # type: ignore[attr-defined]
    acc.load_state_dict(saved["acc"])
    assert acc.window == 2
    _train(model, acc, data[6:], 2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name


def test_batchnorm_warns_once_and_momentum_correction_decays_like_one_update(caplog) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.1))
    acc = mb.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), steps=4, correct_batchnorm_momentum=True
    )
    bn = model[1]
    data = [torch.randn(8, 3) for _ in range(8)]
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for m in acc.iterate(data):
            acc.backward(model(m.batch).pow(2).mean())
            if m.is_last:
                acc.step()
    assert sum("BatchNorm" in r.message for r in caplog.records) == 1
    # Old statistics decay by (1 - m) per window: feed constant zero-mean-shift batches to isolate it.
    assert (1 - bn.momentum) ** 4 == pytest.approx(0.9, rel=1e-12)
    start = bn.running_mean.clone()
    model.eval()
    model.train()
    with torch.no_grad():
        for _ in range(4):  # four micro-batches whose batch mean is exactly zero
            z = torch.randn(8, 4)
            bn(z - z.mean(0))
    torch.testing.assert_close(bn.running_mean, start * 0.9, rtol=1e-6, atol=1e-7)


def test_convert_batchnorm_to_groupnorm_makes_accumulation_exact() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))
    model(torch.randn(2, 3, 6, 6))
    mb.convert_batchnorm_to_groupnorm(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 8
    model = model.double()
    x, y = torch.randn(12, 3, 6, 6, dtype=torch.float64), torch.randn(12, 1, dtype=torch.float64)
    expected, _ = full_batch_grads(model, mse, (x, y))
    actual, _ = accumulated_grads(model, mse, split_batch((x, y), [3, 3, 3, 3]))
    assert_grads_close(actual, expected, **F64)


# ------------------------------------------------------------------ bad input


def _acc(steps: object = 2) -> tuple[nn.Module, mb.Accumulator]:
    model = nn.Linear(2, 1)
    return model, mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [0, -1, 2.5, True, "4", [], [2, 0]])
def test_bad_steps(steps: object) -> None:
    with pytest.raises(ConfigError, match="steps"):
        _acc(steps)


def test_bad_items_leave_state_intact() -> None:
    model, acc = _acc()
    x = torch.randn(4, 2)
    acc.backward(model(x).mean(), items=4)
    grad_before = model.weight.grad.clone()
    for bad in [0, -3, 2.5, float("nan"), float("inf"), True, torch.tensor([1, 2])]:
        with pytest.raises(ConfigError, match="items"):
            acc.backward(model(x).mean(), items=bad)
    assert torch.equal(model.weight.grad, grad_before)
    assert acc._state.items == 4 and acc._state.micro_batches == 1


def test_bad_loss() -> None:
    model, acc = _acc()
    x = torch.randn(4, 2)
    with pytest.raises(ConfigError, match="scalar"):
        acc.backward(model(x), items=4)
    with pytest.raises(ConfigError, match="require grad"):
        acc.backward(model(x).mean().detach(), items=4)
    with pytest.raises(ConfigError, match="items="):
        acc.backward(model(x).mean())  # outside iterate(): the batch size is unknown


def test_call_order_errors() -> None:
    model, acc = _acc(steps=2)
    x = torch.randn(4, 2)
    with pytest.raises(UsageError, match="no backward"):
        acc.step()
    acc.backward(model(x).mean(), items=4)
    with pytest.raises(UsageError, match="before the window's last"):
        acc.step()
    acc.backward(model(x).mean(), items=4)
    with pytest.raises(UsageError, match="call step"):
        acc.backward(model(x).mean(), items=4)
    with pytest.raises(UsageError, match="middle"):
        list(acc.iterate([x]))
    assert acc.step().micro_batches == 2


def test_forgetting_step_is_reported() -> None:
    model, acc = _acc(steps=1)
    with pytest.raises(UsageError, match="step\\(\\) was not called"):
        for m in acc.iterate([torch.randn(2, 2)] * 3):
            acc.backward(model(m.batch).mean())


def test_empty_loader_and_foreign_parameters(caplog) -> None:
    model, acc = _acc()
    with pytest.raises(ConfigError, match="empty"):
        next(acc.iterate([]))
    other = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        mb.Accumulator(model, torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))
    assert any("not in the model" in r.message for r in caplog.records)
