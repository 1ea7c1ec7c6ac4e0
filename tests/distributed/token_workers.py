"""Rank functions for the token-budget distributed test (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import microbatch as mb
from microbatch.errors import ConfigError
from microbatch.models.corpus import IGNORE_INDEX, PAD_TOKEN
from microbatch.models.workloads import gpt_loss, lm_varlen

MAX_TOKENS = 64
WINDOW_SIZE = 8
# Rank 0 gets long sequences (several micro-batches per window), rank 1 short ones (one would do).
LENGTH_RANGES = [(18, 32), (2, 6)]

Sample = tuple[torch.Tensor, torch.Tensor]


def rank_windows(rank: int, windows: int) -> list[list[Sample]]:
    """Deterministic windows of (input_ids, labels) samples for ``rank``."""
    generator = torch.Generator().manual_seed(100 + rank)
    low, high = LENGTH_RANGES[rank]
    result = []
    for _ in range(windows):
        window = []
        for _ in range(WINDOW_SIZE):
            n = int(torch.randint(low, high + 1, (), generator=generator))
            tokens = torch.randint(0, 256, (n + 1,), generator=generator)
            window.append((tokens[:-1], tokens[1:]))
        result.append(window)
    return result


def pad(samples: list[Sample]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, targets) in enumerate(samples):
        input_ids[row, : len(ids)], labels[row, : len(ids)] = ids, targets
    return {"input_ids": input_ids, "labels": labels}


def make_model() -> nn.Module:
    return lm_varlen().model.double()


def _train(windows: list[list[Sample]]) -> dict[str, Any]:
    model = make_model()
    ddp = mb.distributed.wrap_data_parallel(model, torch.device("cpu"))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.0)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: captured.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    )
    token_windows = mb.TokenWindows(windows, max_tokens=MAX_TOKENS, collate=pad, length=lambda s: len(s[0]))
    acc = mb.Accumulator(ddp, optimizer, steps=token_windows.steps)
    steps, widths = [], []
    for micro in acc.iterate(token_windows):
        steps.append(micro.steps)
        widths.append(micro.batch["input_ids"].numel())
        loss, items = gpt_loss(ddp, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            acc.step()
    return {"grads": captured, "steps": steps, "padded_tokens": widths}


def tokens_all(windows: int) -> dict[str, Any]:
    """The exact run, then one where rank 1 has a window fewer (an error on both ranks, no hang)."""
    rank = dist.get_rank()
    result = _train(rank_windows(rank, windows))
    result["fewest"] = [
        len(mb.split_by_tokens([len(ids) for ids, _ in window], MAX_TOKENS))
        for window in rank_windows(rank, windows)
    ]
    try:
        _train(rank_windows(rank, windows - rank))
        result["uneven_error"] = None
    except ConfigError as error:
        result["uneven_error"] = str(error)
    return result
