"""A pipeline window's micro-batches made the schedule's: padded to one shape, cut into pipeline steps.

torch's schedules take m micro-batches of one shape per step (pytorch #126600). A micro-batch with
fewer rows than the example is padded with rows whose labels are all ``ignore_index`` (no items);
a last pipeline step with fewer than m micro-batches is filled with micro-batches of padding alone.
Neither adds an item, and the pipeline's loss adds an exact zero for a micro-batch without items
(it never calls the user's loss on one: a masked mean would be 0/0 there).

Every check on the shapes runs before any collective of the window, and its verdict is agreed by
every rank (``collectives.agree_on_status``): a collator that pads each batch to its longest row
fails on one replica as a clear error on every rank, not as the other replicas waiting forever.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


def pad_batch(batch: Batch, index: int, example: torch.Tensor, ignore_index: int) -> Batch:
    """``batch`` with rows of padding (labels ``ignore_index``) up to the example's row count."""
    inputs, labels = batch
    rows, full_rows = inputs.shape[0], example.shape[0]
    if inputs.shape[1:] != example.shape[1:] or labels.shape[0] != rows:
        raise ConfigError(
            f"micro-batch {index}: inputs {tuple(inputs.shape)} / labels {tuple(labels.shape)} do not "
            f"fit the example's shape {tuple(example.shape)}: every micro-batch needs the "
            "example's trailing shape (pad sequences to it) and one label row per input row"
        )
    if rows > full_rows:
        raise ConfigError(
            f"micro-batch {index} has {rows} rows, more than the example's {full_rows}; "
            f"give an example of {rows} rows or cut the micro-batch"
        )
    if rows == full_rows:
        return inputs, labels
    extra = full_rows - rows
    pad_inputs = torch.zeros((extra, *inputs.shape[1:]), dtype=inputs.dtype, device=inputs.device)
    pad_labels = torch.full(
        (extra, *labels.shape[1:]), ignore_index, dtype=labels.dtype, device=labels.device
    )
    return torch.cat([inputs, pad_inputs]), torch.cat([labels, pad_labels])


def padded_window(
    batches: Sequence[Batch], example: torch.Tensor, ignore_index: int
) -> tuple[list[Batch], str | None]:
    """(every micro-batch padded, None), or ([], the error) when one does not fit: raised only once
    every rank has said how its window went (the caller's agreement), so no rank is left waiting."""
    try:
        return [pad_batch(batch, index, example, ignore_index) for index, batch in enumerate(batches)], None
    except ConfigError as error:
        return [], str(error)


def count_items(labels: torch.Tensor, ignore_index: int) -> int:
    """The items of a micro-batch: its labels that are not ``ignore_index`` (read on the host)."""
    return int((labels != ignore_index).sum())


def pipeline_steps(padded: list[Batch], micro_batches: int, ignore_index: int) -> list[list[Batch]]:
    """The window cut into steps of ``micro_batches``, the last filled with micro-batches of padding."""
    steps = math.ceil(len(padded) / micro_batches)
    if padded:
        empty = (torch.zeros_like(padded[0][0]), torch.full_like(padded[0][1], ignore_index))
        padded = padded + [empty] * (steps * micro_batches - len(padded))
    return [padded[step * micro_batches : (step + 1) * micro_batches] for step in range(steps)]
