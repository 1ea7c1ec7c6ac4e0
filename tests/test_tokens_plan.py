"""The planner's token budget: Plan.max_tokens for variable-length workloads, and that it holds."""

from __future__ import annotations

import math

import torch
from torch import nn

import microbatch as mb
from microbatch.accumulate.tokens import TokenStats
from microbatch.models.corpus import IGNORE_INDEX, PAD_TOKEN
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_loss, gpt_workload
from microbatch.planner import plan
from microbatch.planner.result.token_budget import token_budget
from microbatch.planner.search.sizes import search
from microbatch.profile import profile_workload
from microbatch.workload import Workload, seed_linear

Sample = tuple[torch.Tensor, torch.Tensor]


def pad(samples: list[Sample]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, targets) in enumerate(samples):
        input_ids[row, : len(ids)], labels[row, : len(ids)] = ids, targets
    return {"input_ids": input_ids, "labels": labels}


def test_token_plan_bounds_every_token_micro_batch_by_the_trial_peak() -> None:
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, dropout=0.0)
    workload = gpt_workload(config, max_bytes=200_000)
    assert workload.max_length == 64
    profile = profile_workload(workload, max_micro_batch_size=4, repeats=1)
    minimum = search(profile, per_rank_batch=8, capacity_bytes=math.inf).minimum.peak_bytes
    result = plan(workload, batch=8, memory=int(minimum * 1.6), profile=profile)
    assert result.max_tokens == result.micro_batch_size * 64
    assert result.to_dict()["max_tokens"] == result.max_tokens and "max_tokens=" in str(result)
    assert result.measured_peak_bytes is not None

    # A window of the corpus's variable-length chunks (ByteBatches' rows cut to their real tokens).
    batch = workload.make_batch(8)
    counts = (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
    window = [(batch["input_ids"][r, :n], batch["labels"][r, :n]) for r, n in enumerate(counts)]
    handle = result.checkpoint(workload.model)
    try:
        peak, stats = token_window_peak(workload, window, result.max_tokens)
    finally:
        if handle is not None:
            handle.remove()
    assert stats.micro_batches >= 2
    assert peak <= result.measured_peak_bytes <= result.budget_bytes


def test_fixed_length_workloads_get_no_token_budget() -> None:
    workload = seed_linear()
    assert workload.max_length is None and token_budget(workload, 4) is None


class QuadraticAttentionLM(nn.Module):
    """One explicit (not SDPA) causal attention layer: it saves a rows x T x T score matrix."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(tokens)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.head(weights @ v)  # type: ignore[no-any-return]


def test_token_budget_holds_for_attention_quadratic_in_length() -> None:
    # A micro-batch of r rows of length T saves ~r T^2 scores; r T <= R L and T <= L bound it by R L^2.
    max_length = 96
    generator = torch.Generator().manual_seed(5)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, 256, (size, max_length + 1), generator=generator)
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    torch.manual_seed(0)
    workload = Workload(
        model=QuadraticAttentionLM(), make_batch=make_batch, loss=gpt_loss, max_length=max_length
    )
    profile = profile_workload(workload, max_micro_batch_size=4, repeats=1, policies=["none"])
    top = search(profile, per_rank_batch=8, capacity_bytes=math.inf).best
    assert top is not None
    result = plan(workload, batch=8, memory=int(top.peak_bytes * 0.6), profile=profile)
    assert result.max_tokens == result.micro_batch_size * max_length
    assert result.measured_peak_bytes is not None
    # At each length, twice the rows the budget allows plus a partial micro-batch: its micro-batches
    # are filled to max_tokens. Full-length rows are the trial's worst case; shorter rows may hold
    # more of them but must not peak higher.
    rows, budget_tokens = result.micro_batch_size, result.max_tokens
    peaks = {}
    for length in (max_length, 40, 8):
        count = 2 * (budget_tokens // length) + 1
        tokens = torch.randint(0, 256, (count, length + 1), generator=generator)
        window = [(row[:-1], row[1:]) for row in tokens]
        peaks[length], stats = token_window_peak(workload, window, budget_tokens)
        assert stats.micro_batches == 3
    assert peaks[40] <= peaks[max_length] and peaks[8] <= peaks[max_length]
    # The worst case here is the trial's micro-batch: the same peak up to the inputs' layout (the
    # trial's input_ids and labels share one storage; pad() makes two), a few KiB.
    assert abs(peaks[max_length] - result.measured_peak_bytes) <= 0.02 * result.measured_peak_bytes
    assert result.measured_peak_bytes <= result.budget_bytes
    assert rows * max_length == budget_tokens


def token_window_peak(
    workload: Workload, window: list[torch.Tensor], max_tokens: int
) -> tuple[int, TokenStats]:
    """MemoryTracker's peak over one optimizer step on ``window`` split by tokens (optimizer state made)."""
    token_windows = mb.TokenWindows([window], max_tokens=max_tokens, collate=pad, length=lambda s: len(s[0]))
    model = workload.model
    optimizer = workload.make_optimizer()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # Collated before tracking, as the trial makes its batches: the tracker then counts an input only
    # once it is used, not while iterate() holds it as the look-ahead.
    micro_batches = list(token_windows)
    acc = mb.Accumulator(model, optimizer, steps=token_windows.steps)
    with mb.MemoryTracker("cpu", model=model, optimizer=optimizer) as tracker:
        for micro in acc.iterate(micro_batches):
            assert micro.batch["input_ids"].numel() <= max_tokens
            loss, items = workload.loss(model, micro.batch)
            acc.backward(loss, items=items)
            del loss  # as the trial does: nothing of this micro-batch outlives its backward
            if micro.is_last:
                acc.step()
    return tracker.peak_bytes, token_windows.stats
