"""cached_backward(max_tokens=): mini-batches cut by padded tokens, the loss and gradient unchanged.

A small token encoder (embedding, a per-token MLP, masked mean pooling: a row's representation does
not depend on the other rows of its mini-batch), its encode trims the padding columns none of its
rows uses, and an in-batch-negatives loss whose targets depend on the row order (so putting the
rows back in order is tested). Long-tailed rows: most short, a few long, shuffled.

Exactness: float64, reference loss(encode(whole batch)).backward() in one pass, rtol 1e-9 and
atol 1e-12 (float64 rounding of sums taken in another order).

Whole run: the budget is 1.1x the measured peak of the worst batch this data can give (32 rows of
the longest length) cut by 4 x longest tokens; plan_cached(tokens=True) on that worst batch gives
max_tokens; then every step of a run over the long-tailed data, measured by a MemoryTracker opened
in the test, peaks within the budget with max_tokens, and a fixed row count making as many encode
passes does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from microbatch.accumulate.cached_tokens import cut_batch_by_tokens, row_lengths
from microbatch.errors import ConfigError

TOL = {"rtol": 1e-9, "atol": 1e-12}
VOCAB = 50


class TokenEncoder(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))
        self.head = nn.Linear(width, width)
        self.shapes: list[tuple[int, int]] = []  # (rows, columns) of every encode pass

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"]
        columns = int(mask.bool().any(dim=0).nonzero().max()) + 1  # drop the unused padding columns
        ids, mask = batch["input_ids"][:, :columns], mask[:, :columns]
        self.shapes.append((ids.shape[0], columns))
        hidden = self.mlp(self.embed(ids))
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(dim=1) / weights.sum(dim=1))


def coupled_loss(representations: torch.Tensor) -> torch.Tensor:
    """In-batch negatives; row i's positive is row i - 1: the loss depends on the row order."""
    logits = representations @ representations.T
    target = torch.roll(torch.arange(representations.shape[0]), 1)
    return F.cross_entropy(logits, target)


def long_tailed_lengths(rows: int, *, seed: int, long_share: float = 0.15, longest: int = 64) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(rows):
        if float(torch.rand((), generator=generator)) < long_share:
            lengths.append(int(torch.randint(longest * 3 // 4, longest + 1, (), generator=generator)))
        else:
            lengths.append(int(torch.randint(3, 13, (), generator=generator)))
    return lengths


def make_batch(lengths: list[int], *, width: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_row_lengths_read_the_last_attended_column() -> None:
    batch = make_batch([3, 7, 1, 5], width=9, seed=0)
    assert row_lengths(batch) == [3, 7, 1, 5]
    cut = cut_batch_by_tokens(batch, 10)
    assert all(tokens <= 10 for tokens in cut.padded_tokens())
    assert sorted(cut.order) == [0, 1, 2, 3]


@pytest.mark.parametrize("lengths_from", ["attention_mask", "lengths="])
def test_max_tokens_gives_the_unsplit_float64_loss_and_gradient(lengths_from: str) -> None:
    torch.manual_seed(0)
    model = TokenEncoder().to(torch.float64)
    lengths = long_tailed_lengths(40, seed=3)
    batch = make_batch(lengths, width=max(lengths), seed=4)
    want_loss = coupled_loss(model(batch))
    want_loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    model.shapes.clear()
    max_tokens = 2 * max(lengths)
    extra = {"lengths": lengths} if lengths_from == "lengths=" else {}
    got_loss = mb.cached_backward(model, batch, coupled_loss, max_tokens=max_tokens, **extra)
    passes = model.shapes[: len(model.shapes) // 2]  # the encode passes (then their replays)
    assert len(passes) > 2 and all(rows * columns <= max_tokens for rows, columns in passes)
    assert cut_batch_by_tokens(batch, max_tokens).order != sorted(range(40))  # rows were reordered
    torch.testing.assert_close(got_loss, want_loss.detach(), **TOL)
    got = _grads(model)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_bad_token_arguments_are_named() -> None:
    model = TokenEncoder()
    batch = make_batch([4, 9, 2], width=9, seed=0)
    with pytest.raises(ConfigError, match="exactly one of micro_batch_size"):
        mb.cached_backward(model, batch, coupled_loss)
    with pytest.raises(ConfigError, match="exactly one of micro_batch_size"):
        mb.cached_backward(model, batch, coupled_loss, micro_batch_size=2, max_tokens=20)
    with pytest.raises(ConfigError, match="more than max_tokens=8"):
        mb.cached_backward(model, batch, coupled_loss, max_tokens=8)
    with pytest.raises(ConfigError, match="lengths has 2 entries"):
        mb.cached_backward(model, batch, coupled_loss, max_tokens=20, lengths=[4, 9])
    with pytest.raises(ConfigError, match="attention_mask"):
        mb.cached_backward(lambda x: model(batch), batch["input_ids"], coupled_loss, max_tokens=20)


# ---------------------------------------------------------------------- plan_cached and the whole run

BATCH = 32
LONGEST = 96


def _peak(model: nn.Module, run: Any) -> int:
    with mb.MemoryTracker("cpu", model=model) as tracker:
        run()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_plan_cached_tokens_holds_the_budget_for_every_step_of_a_long_tailed_run() -> None:
    torch.manual_seed(0)
    model = TokenEncoder(width=16, hidden=256)
    worst = make_batch([LONGEST] * BATCH, width=LONGEST, seed=1)  # the heaviest batch of 32 rows
    model(worst).sum().backward()  # gradients allocated, as in every step after the first
    budget = int(
        1.1 * _peak(model, lambda: mb.cached_backward(model, worst, coupled_loss, max_tokens=4 * LONGEST))
    )

    plan = mb.plan_cached(
        model, coupled_loss, lambda b: make_batch([LONGEST] * b, width=LONGEST, seed=1),
        batch=BATCH, memory=budget, model=model, tokens=True,
    )  # fmt: skip
    assert plan.caching and plan.longest_tokens == LONGEST
    assert plan.max_tokens == plan.micro_batch_size * LONGEST and plan.max_tokens < BATCH * LONGEST
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert f"max_tokens={plan.max_tokens}" in str(plan)
    rows_plan = mb.plan_cached(
        model, coupled_loss, lambda b: make_batch([LONGEST] * b, width=LONGEST, seed=1),
        batch=BATCH, memory=budget, model=model, trial=False,
    )  # fmt: skip
    assert rows_plan.max_tokens is None  # unchanged without tokens=True

    run = [long_tailed_lengths(BATCH, seed=10 + step, longest=LONGEST) for step in range(6)]
    batches = [make_batch(lengths, width=LONGEST, seed=20 + i) for i, lengths in enumerate(run)]
    by_tokens = [
        _peak(model, lambda b=b: mb.cached_backward(model, b, coupled_loss, max_tokens=plan.max_tokens))
        for b in batches
    ]
    passes = sum(len(cut_batch_by_tokens(b, plan.max_tokens).groups) for b in batches)
    rows = -(-BATCH * len(batches) // passes)  # the token cut's mean rows per pass, rounded up
    by_rows = [
        _peak(model, lambda b=b: mb.cached_backward(model, b, coupled_loss, micro_batch_size=rows))
        for b in batches
    ]
    print(
        f"budget {budget} B, max_tokens {plan.max_tokens}; worst step by tokens {max(by_tokens)} B "
        f"({max(by_tokens) / budget:.2f}x), by {rows} rows {max(by_rows)} B ({max(by_rows) / budget:.2f}x)"
    )
    assert max(by_tokens) <= budget
    assert max(by_rows) > budget
