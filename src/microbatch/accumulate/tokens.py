"""Token-budget micro-batches: split a window of variable-length samples by padded tokens, not rows.

A micro-batch of rows padded to its longest sample costs ``rows x longest`` padded tokens of compute
and activation memory. ``split_by_tokens`` splits one window's samples into micro-batches that each
stay within ``max_tokens`` padded tokens. Because the Accumulator weighs every micro-batch by its
item count, the window's gradient is the same however the window is split (up to float summation
order): only the padding and the peak change.

Why contiguous groups of the length-sorted order suffice. Sort the lengths longest first,
L_0 >= L_1 >= ... >= L_{n-1}. A micro-batch whose longest sample is L_i holds at most
floor(max_tokens / L_i) rows, whichever rows they are. Exchange argument: in any valid split, swap
rows so that the micro-batch holding sample 0 holds samples 0..k-1 (the next-longest ones); every
other micro-batch only loses long rows, so its longest length does not grow and it stays valid.
Repeating on the rest gives a split into contiguous runs of the sorted order with no more
micro-batches. So the greedy "fill each micro-batch with the next-longest samples" split already
has the fewest micro-batches; a dynamic programme over the sorted order then picks, among the
fewest-micro-batch splits into runs, the one with the fewest padded tokens:

    best(i) = min over j in (i, i + floor(max_tokens / L_i)]  of  (1 + count(j), (j - i) L_i + padded(j))

compared as (count, padded) pairs, ties broken towards the longer first run, so the result is
deterministic. Cost: O(n x max rows per micro-batch), vectorised over the rows (about 0.1 s for
n = 1024 on a CPU core, 0.5 s for n = 4096).

``TokenWindows`` turns an iterable of windows (lists of samples) into collated micro-batches for
``Accumulator.iterate``, and its ``steps`` method is the matching per-window steps schedule.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from ..errors import ConfigError

logger = logging.getLogger(__name__)

# Up to this many candidate first runs the DP loops in Python; beyond, it vectorises with torch.
_SCALAR_ROWS = 16


def _validate_lengths(lengths: Sequence[int], max_tokens: int, *, truncate: bool) -> list[int]:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(
            f"max_tokens must be an integer >= 1 (padded tokens per micro-batch), got {max_tokens!r}"
        )
    values: list[int] = []
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int):
            raise ConfigError(f"lengths[{index}] must be an int (the sample's token count), got {length!r}")
        if length < 1:
            raise ConfigError(
                f"lengths[{index}] is {length}: a sample needs at least one token; drop empty samples"
            )
        if length > max_tokens:
            if not truncate:
                raise ConfigError(
                    f"sample {index} has {length} tokens, more than max_tokens={max_tokens}: raise "
                    "max_tokens, drop or cut the sample, or pass truncate=True (it then fills a "
                    "micro-batch alone, cut to max_tokens)"
                )
            length = max_tokens
        values.append(length)
    return values


def split_by_tokens(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    truncate: bool = False,
    micro_batches: int | None = None,
) -> list[list[int]]:
    """Split one window's samples into micro-batches of at most ``max_tokens`` padded tokens.

    Returns lists of indices into ``lengths``: every index exactly once, each micro-batch's
    ``rows x longest length <= max_tokens``, the fewest micro-batches any split can have, and among
    those the fewest padded tokens any split into runs of the length-sorted order has (see the
    module docstring). Micro-batches come longest first, indices ascending within each. A sample
    longer than ``max_tokens`` is an error unless ``truncate=True``: it then counts as
    ``max_tokens`` long, alone in its micro-batch, and the collate function must cut it.

    ``micro_batches`` asks for exactly that many (at least the minimum, at most ``len(lengths)``):
    the micro-batch with the most padded tokens is halved until the count is reached. Data-parallel
    ranks use it to agree on one count per window.
    """
    values = _validate_lengths(lengths, max_tokens, truncate=truncate)
    if not values:
        return []
    # Longest first; equal lengths in index order, so the result depends only on the input.
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    sorted_lengths = [values[i] for i in order]
    runs = _fewest_padded_runs(sorted_lengths, _search_limit(sorted_lengths, max_tokens))
    if micro_batches is not None:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise ConfigError(f"micro_batches must be an int or None, got {micro_batches!r}")
        if not len(runs) <= micro_batches <= len(values):
            raise ConfigError(
                f"micro_batches={micro_batches} is impossible for {len(values)} samples within "
                f"max_tokens={max_tokens}: it must be between {len(runs)} and {len(values)}"
            )
        runs = _split_to_count(runs, sorted_lengths, micro_batches)
    return [sorted(order[i] for i in range(start, end)) for start, end in runs]


def _search_limit(sorted_lengths: list[int], max_tokens: int) -> int:
    """``max_tokens`` for the DP, within int64: no run holds more than n x longest padded tokens, so a
    larger budget (max_tokens=10**17) splits alike as that; the DP's keys reach about n^2 of it."""
    n = len(sorted_lengths)
    limit = min(max_tokens, n * sorted_lengths[0])
    if (n + 1) * (n * limit + 1) >= 2**63:
        raise ConfigError(
            f"lengths: {n} samples of up to {sorted_lengths[0]:,} tokens (max_tokens={max_tokens:,}) are "
            f"beyond what split_by_tokens counts (padded tokens up to 2**63 / {n + 1}**2); check the "
            "lengths (token counts, not bytes), or split fewer samples per call"
        )
    return limit


def _fewest_padded_runs(sorted_lengths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """The DP of the module docstring: runs [start, end) of the longest-first order."""
    n = len(sorted_lengths)
    # For the suffix starting at i: its fewest micro-batches, then fewest padded tokens, and the end
    # of its first run. Pairs are compared as one integer count x scale + padded (padded < scale).
    count = torch.zeros(n + 1, dtype=torch.int64)
    padded = torch.zeros(n + 1, dtype=torch.int64)
    scale = n * max_tokens + 1
    first_end = [n] * (n + 1)
    count_list, padded_list = [0] * (n + 1), [0] * (n + 1)  # the same numbers, for the scalar path
    for i in range(n - 1, -1, -1):
        longest = sorted_lengths[i]
        most_rows = min(n - i, max_tokens // longest)  # >= 1: lengths are clamped to max_tokens
        if most_rows <= _SCALAR_ROWS:
            ends = list(range(i + most_rows, i, -1))  # longer first runs first: they win ties
            keys = [count_list[j] * scale + padded_list[j] + (j - i) * longest for j in ends]
            end = ends[keys.index(min(keys))]
        else:  # the same, vectorised; argmin returns the first minimum
            ends_tensor = torch.arange(i + most_rows, i, -1)
            keys_tensor = count[ends_tensor] * scale + padded[ends_tensor] + (ends_tensor - i) * longest
            end = int(ends_tensor[int(torch.argmin(keys_tensor))])
        count_list[i] = count_list[end] + 1
        padded_list[i] = padded_list[end] + (end - i) * longest
        count[i], padded[i], first_end[i] = count_list[i], padded_list[i], end
    runs = []
    start = 0
    while start < n:
        end = first_end[start]
        runs.append((start, end))
        start = end
    return runs


def _split_to_count(
    runs: list[tuple[int, int]], sorted_lengths: list[int], count: int
) -> list[tuple[int, int]]:
    """Halve the run with the most padded tokens (first on ties) until there are ``count`` runs."""
    runs = list(runs)
    while len(runs) < count:
        splittable = [k for k, (start, end) in enumerate(runs) if end - start > 1]
        k = max(splittable, key=lambda k: ((runs[k][1] - runs[k][0]) * sorted_lengths[runs[k][0]], -k))
        start, end = runs[k]
        middle = start + (end - start + 1) // 2
        runs[k : k + 1] = [(start, middle), (middle, end)]
    return runs


def padded_tokens(lengths: Sequence[int], groups: Iterable[Sequence[int]]) -> int:
    """Total padded tokens (rows x longest length, summed over micro-batches) of a split."""
    return sum(len(group) * max(lengths[i] for i in group) for group in groups if group)


def fewest_micro_batches_bound(lengths: Sequence[int], max_tokens: int) -> int:
    """A lower bound on any split's micro-batch count: the real tokens need ceil(sum / max_tokens)."""
    return math.ceil(sum(lengths) / max_tokens) if lengths else 0


@dataclass(frozen=True)
class TokenStats:
    """What ``TokenWindows`` produced so far: samples, micro-batches, real and padded tokens."""

    windows: int
    samples: int
    micro_batches: int
    real_tokens: int
    padded_tokens: int

    @property
    def padding_fraction(self) -> float:
        """Share of the padded tokens that are padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class TokenWindows:
    """Windows of samples as token-budget micro-batches, for ``Accumulator.iterate``.

    ``windows`` yields one window (a list of samples: the recipe's batch) at a time; each is split
    with ``split_by_tokens([length(s) for s in window], max_tokens)`` and every micro-batch is passed
    to ``collate(samples)`` when it is handed out. Use it with its ``steps`` as the schedule::

        token_windows = mb.TokenWindows(windows, max_tokens=4096, collate=pad_batch)
        acc = mb.Accumulator(model, optimizer, steps=token_windows.steps)
        for micro in acc.iterate(token_windows):
            loss, items = loss_fn(model, micro.batch)   # items: tokens (or samples) averaged over
            acc.backward(loss, items=items)
            if micro.is_last:
                acc.step()

    Each window is then one optimizer step whose gradient equals the whole window's (the
    Accumulator weighs micro-batches by items). ``steps(w)`` is the micro-batch count of
    Accumulator window ``w``; the first window asked for is the first window of ``windows``, or
    pass ``start_window`` (e.g. ``acc.window`` after a resume). With ``truncate=True`` a sample
    longer than ``max_tokens`` is cut to ``sample[:max_tokens]`` before collate. Like a generator,
    it is iterated once (it consumes ``windows``); ``stats`` counts what it has split so far.

    Data-parallel ranks (``agree``, by default when torch.distributed runs more than one rank)
    agree on each window's count with one small all_reduce when the window is split: the largest
    count any rank needs, reached on the others by halving their micro-batches with the most
    padded tokens, so every rank runs the same number and none waits on a collective that never
    comes. Every rank must yield the same number of windows, each with at least that many samples.
    """

    def __init__(
        self,
        windows: Iterable[Sequence[Any]],
        *,
        max_tokens: int,
        collate: Callable[[list[Any]], Any],
        length: Callable[[Any], int] = len,
        truncate: bool = False,
        start_window: int | None = None,
        agree: bool | None = None,
    ) -> None:
        _validate_lengths([], max_tokens, truncate=truncate)
        if not callable(collate):
            raise ConfigError(
                f"collate must be a callable taking a list of samples, got {type(collate).__name__}"
            )
        self.max_tokens = max_tokens
        self.collate = collate
        self.length = length
        self.truncate = truncate
        self._source = iter(windows)
        self._offset = start_window
        self._agree = agree
        self._pending: deque[list[Any]] = deque()
        self._counts: list[int] = []
        self._exhausted = False
        self._samples = self._micro_batches = self._real = self._padded = 0

    @property
    def stats(self) -> TokenStats:
        return TokenStats(len(self._counts), self._samples, self._micro_batches, self._real, self._padded)

    def steps(self, window: int) -> int:
        """Micro-batches in Accumulator window ``window`` (a steps schedule for the Accumulator)."""
        if self._offset is None:
            self._offset = window
        local = window - self._offset
        if local < 0:
            raise ConfigError(
                f"steps({window}) is before start_window={self._offset}: pass start_window=acc.window"
            )
        while len(self._counts) <= local and not self._exhausted:
            self._pull()
        # Past the data's end the Accumulator asks for no more windows; 1 keeps a schedule defined.
        return self._counts[local] if local < len(self._counts) else 1

    def __iter__(self) -> Iterator[Any]:
        while True:
            if not self._pending:
                if self._exhausted:
                    return
                self._pull()
                continue
            yield self.collate(self._pending.popleft())

    def _pull(self) -> None:
        """Split the next window (agreeing on its count across ranks) and queue its micro-batches."""
        window = next(self._source, None)
        lengths: list[int] = []
        if window is not None:
            window = list(window)
            lengths = [self._length_of(sample, i) for i, sample in enumerate(window)]
        groups = split_by_tokens(lengths, self.max_tokens, truncate=self.truncate)
        count = self._agreed_count(len(groups), len(lengths), has_window=window is not None)
        if window is None:
            self._exhausted = True
            return
        if count != len(groups):
            groups = split_by_tokens(lengths, self.max_tokens, truncate=self.truncate, micro_batches=count)
        clamped = [min(n, self.max_tokens) for n in lengths]
        self._counts.append(count)
        self._samples += len(window)
        self._micro_batches += count
        self._real += sum(clamped)
        self._padded += padded_tokens(clamped, groups)
        for group in groups:
            self._pending.append([self._cut(window[i], lengths[i]) for i in group])

    def _length_of(self, sample: Any, index: int) -> int:
        length = self.length(sample)
        if isinstance(length, bool) or not isinstance(length, int):
            raise ConfigError(f"length(sample {index}) must return an int token count, got {length!r}")
        return length

    def _cut(self, sample: Any, length: int) -> Any:
        return sample[: self.max_tokens] if self.truncate and length > self.max_tokens else sample

    def _agreed_count(self, count: int, samples: int, *, has_window: bool) -> int:
        agree = self._agree
        if agree is None:
            agree = distributed.is_initialized() and distributed.world_size() > 1
        if not agree:
            if has_window and count == 0:
                raise ConfigError("a window given to TokenWindows is empty: every window needs samples")
            return count
        # One max-all_reduce: the largest count, the smallest window, whether any rank has / lacks one.
        largest, minus_fewest, any_has, any_lacks = distributed.all_reduce_values(
            [
                float(count),
                -float(samples if has_window else 2**52),
                float(has_window),
                float(not has_window),
            ],
            op="max",
        )
        if any_has and any_lacks:  # raised on every rank, so none waits for the others
            raise ConfigError(
                f"the windows ran out on some ranks but not on others (after {len(self._counts)} windows): "
                "give every rank the same number of windows"
            )
        if any_has and (largest > -minus_fewest or minus_fewest > -1):
            raise ConfigError(
                f"window {len(self._counts)} needs {round(largest)} micro-batches on some rank but another "
                f"rank has only {round(-minus_fewest)} samples in it: give every rank windows of equal size"
            )
        return round(largest)
