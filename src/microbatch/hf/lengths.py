"""A dataset's per-sample lengths, read cheaply, and the worst micro-batch they allow.

The Trainer shuffles, and its collator pads each micro-batch to its longest row: the micro-batch of
``b`` samples that needs the most memory holds the ``b`` longest samples of the dataset (padded to
the longest; a padding-free collator packs the most tokens). So a plan profiled and proved on the
``b`` longest samples for every ``b`` it considers holds for every window of the run, whatever order
the sampler draws. Lengths come from the samples themselves (``len`` of their token lists), never
from a forward pass; a dataset longer than ``max_scan`` samples is read at ``max_scan`` evenly
spaced indices, and the plan's note says so (the longest unread sample may be longer). Samples of
text (sentence-transformers' datasets) are measured by a tokenizer: ``read_lengths(dataset,
length=text_length(tokenizer))``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InfeasibleBudgetError

logger = logging.getLogger(__name__)

__all__ = ["DatasetLengths", "read_lengths", "sample_length", "text_length"]

MAX_SCAN = 20_000  # samples read for their lengths; above it, evenly spaced ones
# The keys whose length is the sample's length in tokens, in order of preference.
LENGTH_KEYS = ("input_ids", "input_values", "pixel_values", "labels")


def sample_length(sample: Any) -> int | None:
    """The length of one dataset sample in tokens: its ``input_ids`` (or the longest sequence it
    holds); None when it holds no sequence (fixed-size samples: nothing to plan for)."""
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[0]) if sample.dim() > 0 else None
    if isinstance(sample, Mapping):
        for key in LENGTH_KEYS:
            found = _length_of(sample.get(key))
            if found is not None:
                return found
        lengths = [_length_of(value) for value in sample.values()]
        known = [n for n in lengths if n is not None]
        return max(known) if known else None
    return None


def text_length(tokenizer: Any, *, columns: Sequence[str] | None = None) -> Callable[[Any], int | None]:
    """A ``length`` for ``read_lengths`` over samples of text (sentence-transformers' (anchor, positive,
    ...) columns, raw SFT text): the most tokens ``tokenizer`` gives any of the sample's ``columns``
    (default: every string value). Tokenizing, not a forward pass: the longest column sets the padded
    width of a mini-batch it joins (each column is encoded apart, as CachedSentenceLoss does)."""

    def length(sample: Any) -> int | None:
        if not isinstance(sample, Mapping):
            return None
        names = list(columns) if columns is not None else [k for k, v in sample.items() if isinstance(v, str)]
        texts = [sample[name] for name in names if isinstance(sample.get(name), str)]
        if not texts:
            return None
        return max(len(ids) for ids in tokenizer(texts)["input_ids"])

    return length


def _length_of(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[-1]) if value.dim() > 0 else None
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (list, tuple, dict)):
        return len(value)
    return None


@dataclass(frozen=True)
class DatasetLengths:
    """Lengths of the samples read (``indices[i]`` has ``lengths[i]`` tokens), longest first."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    dataset_size: int
    sampled: bool  # True when only part of the dataset was read

    def longest(self, count: int) -> tuple[int, ...]:
        """The indices of the ``count`` longest samples read (cycling when count exceeds them)."""
        return tuple(self.indices[i % len(self.indices)] for i in range(count))

    def longest_lengths(self, count: int) -> tuple[int, ...]:
        return tuple(self.lengths[i % len(self.lengths)] for i in range(count))

    def describe(self) -> str:
        """One line for the plan's notes: the distribution read and how."""
        read = (
            f"{len(self.indices):,} of {self.dataset_size:,} samples read, evenly spaced (sampled: a longer "
            "unread sample is not planned for)"
            if self.sampled
            else f"all {self.dataset_size:,} samples read"
        )
        shortest, median = self.lengths[-1], self.lengths[len(self.lengths) // 2]
        return f"sample lengths {shortest}-{self.lengths[0]} tokens (median {median}; {read})"


def read_lengths(
    dataset: Any, *, max_scan: int = MAX_SCAN, length: Callable[[Any], int | None] = sample_length
) -> DatasetLengths | None:
    """The per-sample lengths of a map-style dataset, or None when its samples have no length (or
    all have the same: no worst case to find beyond the first samples)."""
    size = len(dataset)
    if max_scan < 1:
        raise ValueError(f"read_lengths: max_scan must be >= 1, got {max_scan}")
    indices: Sequence[int] = range(size)
    sampled = size > max_scan
    if sampled:
        indices = sorted({(i * size) // max_scan for i in range(max_scan)})
    found: list[tuple[int, int]] = []
    for index in indices:
        n = length(dataset[index])
        if n is None:
            return None
        found.append((n, index))
    if len({n for n, _ in found}) <= 1:
        return None
    found.sort(key=lambda pair: (-pair[0], pair[1]))
    if sampled:
        logger.info("fit_trainer: lengths read from %d of %d samples (evenly spaced)", len(found), size)
    return DatasetLengths(
        indices=tuple(i for _, i in found),
        lengths=tuple(n for n, _ in found),
        dataset_size=size,
        sampled=sampled,
    )


def trainer_lengths(trainer: Any) -> DatasetLengths | None:
    """The Trainer's train dataset's lengths (None without a map-style dataset of varying lengths)."""
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None  # fit_trainer's own check names what is missing
    if len(dataset) == 0:
        return None
    return read_lengths(dataset)


def longest_notes(lengths: DatasetLengths | None, micro_batch_size: int) -> tuple[str, ...]:
    """The plan's note: what it was profiled and proved on, and why that covers the run."""
    if lengths is None:
        return ()
    counted = lengths.longest_lengths(micro_batch_size)
    shown = ", ".join(str(n) for n in counted[:8]) + (", ..." if len(counted) > 8 else "")
    return (
        f"trial on the {micro_batch_size} longest samples: {shown} tokens (profiled on the longest too; "
        f"every micro-batch of {micro_batch_size} the sampler draws is no longer); {lengths.describe()}",
    )


@contextlib.contextmanager
def lengths_in_refusals(lengths: DatasetLengths | None) -> Iterator[None]:
    """An InfeasibleBudgetError raised inside names the sample lengths it planned for."""
    try:
        yield
    except InfeasibleBudgetError as error:
        if lengths is None:
            raise
        raise _refusal_for_lengths(error, lengths) from error


def _refusal_for_lengths(error: InfeasibleBudgetError, lengths: DatasetLengths) -> InfeasibleBudgetError:
    longest = ", ".join(str(n) for n in lengths.longest_lengths(min(4, len(lengths.lengths))))
    return InfeasibleBudgetError(
        f"{error} (planned for the longest samples of the dataset, {longest}, ... tokens: every "
        f"micro-batch holds the longest it could draw; {lengths.describe()}; shorten or drop the "
        "longest samples to plan for less)",
        minimum_bytes=error.minimum_bytes,
        parts=error.parts,
        minimum_is_lower_bound=error.minimum_is_lower_bound,
    )
