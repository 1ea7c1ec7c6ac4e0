"""``microbatch train``'s token-budget micro-batches (``--max-tokens N|auto|off``, default auto).

A window is drawn exactly as with rows (the same sequences, so the gradient is the same), cut to
each chunk's real tokens, split with ``split_by_tokens`` and padded per micro-batch. ``auto`` is the
plan's micro-batch size x block_size: the plan was measured on rows of full block_size, and any
micro-batch of at most that many padded tokens peaks no higher
(see microbatch/planner/result/token_budget.py).
Each step's metrics record the padded tokens and the padding saved against the plan's fixed rows
(every row padded to block_size, as ByteBatches draws them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import distributed
from ..accumulate.tokens import split_by_tokens
from ..errors import ConfigError
from ..models.corpus import IGNORE_INDEX

MAX_TOKENS_CHOICES = ("auto", "off")


def parse_max_tokens(value: str | int | None) -> str | int | None:
    """``--max-tokens``: a positive int, "auto" or "off" (None means off)."""
    if value is None or value in MAX_TOKENS_CHOICES:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"--max-tokens must be a positive number of padded tokens, auto or off, got {value!r}"
        )
    return value


def resolve_max_tokens(value: str | int | None, *, micro_batch_size: int, block_size: int) -> int | None:
    """Padded tokens per micro-batch, or None for fixed rows."""
    value = parse_max_tokens(value)
    if value is None or value == "off":
        return None
    if value == "auto":
        return micro_batch_size * block_size
    if not isinstance(value, int):  # parse_max_tokens returns an int, "auto", "off" or None
        raise ConfigError(f"--max-tokens must be a number of tokens, auto or off, got {value!r}")
    if value < block_size:
        raise ConfigError(
            f"--max-tokens {value} is less than the model's block_size {block_size}: a full-length "
            f"chunk would not fit; use at least {block_size}, or auto"
        )
    return value


class TokenSteps:
    """The Accumulator's steps schedule: the rows schedule until a window is split by tokens."""

    def __init__(self, rows: int | Callable[[int], int], max_tokens: int) -> None:
        self.rows = rows
        self.max_tokens = max_tokens
        self.counts: dict[int, int] = {}
        self.last_record: dict[str, Any] = {}

    def row_steps(self, window: int) -> int:
        return self.rows if isinstance(self.rows, int) else self.rows(window)

    def __call__(self, window: int) -> int:
        return self.counts.get(window, self.row_steps(window))


def split_window(
    batch: dict[str, torch.Tensor], steps: TokenSteps, window: int
) -> list[dict[str, torch.Tensor]]:
    """A drawn window (rows padded to block_size) as token-budget micro-batches; ranks agree on the count."""
    counts = (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
    lengths = [max(1, n) for n in counts]
    max_tokens = steps.max_tokens
    groups = split_by_tokens(lengths, max_tokens)
    if distributed.is_initialized() and distributed.world_size() > 1:
        (agreed,) = distributed.all_reduce_values([float(len(groups))], op="max")
        if round(agreed) != len(groups):
            groups = split_by_tokens(lengths, max_tokens, micro_batches=min(round(agreed), len(lengths)))
    micro_batches = []
    padded = 0
    for group in groups:
        width = max(lengths[i] for i in group)
        index = torch.tensor(group)
        micro_batches.append(
            {"input_ids": batch["input_ids"][index, :width], "labels": batch["labels"][index, :width]}
        )
        padded += len(group) * width
    steps.counts = {window: len(groups)}
    rows_padded = batch["labels"].numel()
    steps.last_record = {
        "padded_tokens": padded,
        "padding_saved_tokens": rows_padded - padded,
        "padding_fraction": 1.0 - sum(counts) / padded,
        "padding_fraction_rows": 1.0 - sum(counts) / rows_padded,
    }
    return micro_batches
