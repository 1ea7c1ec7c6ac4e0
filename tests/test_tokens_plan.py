"""The planner's token budget: Plan.max_tokens for variable-length workloads, and that it holds."""

from __future__ import annotations

import math

import torch

import microbatch as mb
from microbatch.models.corpus import IGNORE_INDEX, PAD_TOKEN
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload
from microbatch.planner import plan
from microbatch.planner.search import search
from microbatch.planner.tokens import token_budget
from microbatch.profile import profile_workload
from microbatch.workload import seed_linear

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
    token_windows = mb.TokenWindows(
        [window], max_tokens=result.max_tokens, collate=pad, length=lambda s: len(s[0])
    )
    model = workload.model
    handle = result.checkpoint(model)
    optimizer = workload.make_optimizer()
    for p in model.parameters():  # the optimizer's state exists from the window's start, as in the trial
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    acc = mb.Accumulator(model, optimizer, steps=token_windows.steps)
    with mb.MemoryTracker("cpu", model=model, optimizer=optimizer) as tracker:
        for micro in acc.iterate(token_windows):
            assert micro.batch["input_ids"].numel() <= result.max_tokens
            loss, items = workload.loss(model, micro.batch)
            acc.backward(loss, items=items)
            if micro.is_last:
                acc.step()
    if handle is not None:
        handle.remove()
    assert tracker.peak_bytes <= result.measured_peak_bytes <= result.budget_bytes


def test_fixed_length_workloads_get_no_token_budget() -> None:
    workload = seed_linear()
    assert workload.max_length is None and token_budget(workload, 4) is None
