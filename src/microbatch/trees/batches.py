"""Batches as nested tensors: how big one is, and how to cut one into micro-batches.

A batch is a tensor, or a tuple / list / dict (nested freely) whose tensors share their first
dimension: the sample dimension. Anything that is not a tensor is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor found in a (nested) batch, depth first; None when there is none."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        children: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        children = batch
    else:
        return None
    for child in children:
        found = first_tensor(child)
        if found is not None:
            return found
    return None


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise ConfigError(
            "cannot tell the batch size of a batch without a tensor of at least one dimension; "
            "pass items= to Accumulator.backward() explicitly"
        )
    return int(tensor.shape[0])


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({key: slice_batch(value, start, stop) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(slice_batch(value, start, stop) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(value, start, stop) for value in batch)
    return batch


def micro_batch_sizes(total: int, micro_batch_size: int) -> list[int]:
    """Cut ``total`` samples into micro-batches of ``micro_batch_size``; the last may be shorter."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    full, rest = divmod(total, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a batch into consecutive micro-batches with the given sample counts."""
    total = batch_size_of(batch)
    if sum(sizes) != total or any(size < 1 for size in sizes):
        raise ConfigError(
            f"micro-batch sizes {list(sizes)} must be positive and add up to the batch size {total}"
        )
    pieces, start = [], 0
    for size in sizes:
        pieces.append(slice_batch(batch, start, start + size))
        start += size
    return pieces


def move_batch(batch: Any, device: torch.device | str) -> Any:
    """The batch with every tensor moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({key: move_batch(value, device) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_batch(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(value, device) for value in batch)
    return batch
