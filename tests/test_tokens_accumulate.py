"""TokenWindows under the Accumulator: a window split by tokens has the full window's gradient.

Tolerance: float64, rtol 1e-10 / atol 1e-13. Splitting a window differently changes only the
summation order (per micro-batch, then the weighted sum in .grad) and the padded width of the rows;
with causal attention and right padding a row's real positions never see its padding, so the
difference is a few ulps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from equivalence import assert_grads_close, full_batch_grads, grads_of
from microbatch.errors import ConfigError
from microbatch.models.corpus import IGNORE_INDEX, PAD_TOKEN
from microbatch.models.workloads import gpt_loss, lm_varlen

TOL = {"rtol": 1e-10, "atol": 1e-13}
Sample = tuple[torch.Tensor, torch.Tensor]


def samples_of(batch: dict[str, torch.Tensor]) -> list[Sample]:
    """The rows of a padded {"input_ids", "labels"} batch, each cut to its real tokens."""
    counts = (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
    return [(batch["input_ids"][r, :n], batch["labels"][r, :n]) for r, n in enumerate(counts)]


def pad(samples: list[Sample]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, targets) in enumerate(samples):
        input_ids[row, : len(ids)], labels[row, : len(ids)] = ids, targets
    return {"input_ids": input_ids, "labels": labels}


def window_grads(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]],
    micro_batches: Any,
    steps: Any,
) -> tuple[list[dict[str, torch.Tensor]], list[mb.Micro]]:
    """Each window's gradient as the Accumulator leaves it before stepping (lr=0: the model stays)."""
    clone = copy.deepcopy(model)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer = torch.optim.SGD(clone.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(lambda *_: captured.append(grads_of(clone)))
    acc = mb.Accumulator(clone, optimizer, steps=steps)
    seen = []
    for micro in acc.iterate(micro_batches):
        seen.append(micro)
        loss, items = loss_fn(clone, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            acc.step()
    return captured, seen


def test_lm_window_split_by_tokens_equals_split_by_rows_and_full_window() -> None:
    workload = lm_varlen()
    model = workload.model.double()
    windows = [samples_of(workload.make_batch(size)) for size in (12, 4, 8)]
    by_rows = [pad(window[i : i + 4]) for window in windows for i in range(0, len(window), 4)]
    rows_grads, _ = window_grads(model, gpt_loss, by_rows, [3, 1, 2])
    token_windows = mb.TokenWindows(windows, max_tokens=64, collate=pad, length=lambda s: len(s[0]))
    token_grads, seen = window_grads(model, gpt_loss, token_windows, token_windows.steps)
    assert len(token_grads) == len(rows_grads) == 3
    for w, window in enumerate(windows):
        expected, _ = full_batch_grads(model, gpt_loss, pad(window))
        assert_grads_close(rows_grads[w], expected, **TOL)
        assert_grads_close(token_grads[w], expected, **TOL)
        micros = [m for m in seen if m.window == w]
        lengths = [len(ids) for ids, _ in window]
        assert len(micros) == len(mb.split_by_tokens(lengths, 64)) == micros[0].steps
        assert [m.is_last for m in micros] == [False] * (len(micros) - 1) + [True]
        assert all(m.batch["input_ids"].numel() <= 64 for m in micros)
    # The budget bounds every micro-batch, and the windows need different counts.
    assert len({m.steps for m in seen}) > 1
    stats = token_windows.stats
    assert stats.windows == 3 and stats.samples == 24 and stats.micro_batches == len(seen)
    assert stats.real_tokens == sum(len(ids) for window in windows for ids, _ in window)
    assert stats.padded_tokens == sum(m.batch["input_ids"].numel() for m in seen)


def float64_causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int = -100, **_: Any
) -> torch.Tensor:
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return F.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index
    )


def test_hf_tiny_model_split_by_tokens_equals_the_full_window() -> None:
    pytest.importorskip("transformers")
    from microbatch.hf import causal_lm_loss, pad_causal_lm_batch, tiny_gpt2

    model = tiny_gpt2(max_length=32, dtype=torch.float64)
    # transformers' own loss casts the logits to float32 (see test_hf.py); the same formula in float64.
    model.loss_function = float64_causal_lm_loss
    generator = torch.Generator().manual_seed(3)
    lengths = [2, 30, 5, 17, 3, 28, 9, 4, 22, 6]
    window = [torch.randint(0, 256, (n,), generator=generator) for n in lengths]
    token_windows = mb.TokenWindows([window], max_tokens=60, collate=pad_causal_lm_batch)
    grads, seen = window_grads(model, causal_lm_loss, token_windows, token_windows.steps)
    expected, _ = full_batch_grads(model, causal_lm_loss, pad_causal_lm_batch(window))
    assert len(seen) == len(mb.split_by_tokens(lengths, 60)) > 2
    assert_grads_close(grads[0], expected, **TOL)


def test_truncate_cuts_long_samples_and_without_it_the_error_names_the_sample() -> None:
    windows = [[list(range(5)), list(range(12)), list(range(3))]]
    cut = mb.TokenWindows(windows, max_tokens=8, collate=list, truncate=True)
    assert [len(sample) for batch in cut for sample in batch] == [8, 5, 3]
    strict = mb.TokenWindows(windows, max_tokens=8, collate=list)
    with pytest.raises(ConfigError, match="sample 1 has 12 tokens"):
        list(strict)


def test_steps_follow_each_window_from_a_resumed_window_index() -> None:
    windows: Sequence[list[list[int]]] = [[[1] * 4] * 4, [[1] * 2], [[1] * 8, [1] * 8]]
    token_windows = mb.TokenWindows(windows, max_tokens=8, collate=len, start_window=10)
    assert [token_windows.steps(w) for w in (10, 11, 12)] == [2, 1, 2]
    assert list(token_windows) == [2, 2, 1, 1, 1]
    with pytest.raises(ConfigError, match="start_window=10"):
        token_windows.steps(3)
