"""A window's micro-batch sizes, and which micro-batch sizes the planner's search tries.

A plan cuts a rank's B_rank samples into N = ceil(B_rank / b) micro-batches, [b] * (N - 1) + [r],
or evenly, sizes ceil(B_rank / N) and floor(B_rank / N). ``WindowSizes`` holds either list as four
numbers, so a window of a million micro-batches costs nothing to price. ``candidate_sizes`` bounds
the search: every b = ceil(B_rank / N) up to EXACT_SEARCH_BATCH samples per rank (about
2 sqrt(B_rank) values), beyond it every b up to SMALL_SIZES and a geometric grid (ratio
GRID_RATIO) above, O(log B_rank) values, with N <= MAX_STEPS_PER_WINDOW.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import overload

from ...errors import ConfigError

EXACT_SEARCH_BATCH = 4096  # samples per rank up to which every micro-batch size is searched
SMALL_SIZES = 16  # above EXACT_SEARCH_BATCH: every b up to this, then a geometric grid
GRID_RATIO = 2 ** (1 / 4)
MAX_STEPS_PER_WINDOW = 1_000_000  # micro-batches per optimizer step a plan may have


class WindowSizes(Sequence[int]):
    """A window's micro-batch sizes, [size] * big + [small] * (steps - big), held as four numbers.

    ``WindowSizes(total, size)`` fills micro-batches of ``size`` and leaves the rest to the last:
    [size] * (steps - 1) + [last]. With ``balanced=True`` the same number of steps N = ceil(total /
    size) shares the samples evenly: sizes ceil(total / N) and floor(total / N), the larger first,
    so no micro-batch is much smaller than the rest (64 in 10 steps: 7 x 4 + 6 x 6, not 7 x 9 + 1),
    none is larger than ``size``, and the steps are as few.
    """

    __slots__ = ("big", "size", "small", "steps")

    def __init__(self, total: int, size: int, *, balanced: bool = False) -> None:
        if total < 1 or size < 1:
            raise ConfigError(f"a window needs total >= 1 and size >= 1 samples, got {total} and {size}")
        size = min(size, total)
        self.steps = -(-total // size)
        if balanced:
            even, rest = divmod(total, self.steps)
            self.size, self.big, self.small = (even + 1, rest, even) if rest else (even, self.steps, even)
        else:
            last = total - size * (self.steps - 1)
            self.size, self.big, self.small = size, self.steps - (last != size), last

    @property
    def last(self) -> int:
        return self.small if self.big < self.steps else self.size

    @property
    def counts(self) -> tuple[tuple[int, int], ...]:
        """(size, how many micro-batches have it), largest size first."""
        if self.big == self.steps:
            return ((self.size, self.steps),)
        return ((self.size, self.big), (self.small, self.steps - self.big))

    def __len__(self) -> int:
        return self.steps

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self.steps)))
        if index < 0:
            index += self.steps
        if not 0 <= index < self.steps:
            raise IndexError(index)
        return self.size if index < self.big else self.small

    def __iter__(self) -> Iterator[int]:
        for size, count in self.counts:
            for _ in range(count):
                yield size

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WindowSizes):
            return self.counts == other.counts
        return isinstance(other, (tuple, list)) and len(other) == self.steps and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self.counts)

    def __repr__(self) -> str:
        return f"WindowSizes({describe_split(self)})"


def describe_split(sizes: Sequence[int]) -> str:
    """'8 x 8', '7 x 9 + 1', '7 x 4 + 6 x 6': runs of equal sizes, in order."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    if len(runs) == 1:
        return f"{runs[0][0]} x {runs[0][1]}"
    return " + ".join(f"{size} x {count}" if count > 1 else str(size) for size, count in runs)


def size_counts(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(size, count) pairs of a window's micro-batch sizes."""
    if isinstance(sizes, WindowSizes):
        return sizes.counts
    return tuple(Counter(sizes).items())


def smallest_size_for(per_rank_batch: int, size: int) -> int:
    """The smallest b that gives the same number of micro-batches N = ceil(B_rank / size)."""
    steps = -(-per_rank_batch // size)
    return -(-per_rank_batch // steps)


def candidate_sizes(per_rank_batch: int) -> list[int]:
    """Micro-batch sizes to search, largest first; each the smallest b for its step count N.

    Up to EXACT_SEARCH_BATCH: b = ceil(B_rank / N) for every N (about 2 sqrt(B_rank) values).
    Above: every b up to SMALL_SIZES and a geometric grid over the rest, O(log B_rank) values, with
    N <= MAX_STEPS_PER_WINDOW.
    """
    if per_rank_batch <= EXACT_SEARCH_BATCH:
        return sorted({-(-per_rank_batch // steps) for steps in range(1, per_rank_batch + 1)}, reverse=True)
    least = max(1, -(-per_rank_batch // MAX_STEPS_PER_WINDOW))
    wanted = set(range(least, max(least, SMALL_SIZES) + 1))
    size = float(max(least, SMALL_SIZES))
    while size < per_rank_batch:
        wanted.add(int(size))
        size *= GRID_RATIO
    wanted.add(per_rank_batch)
    return sorted({smallest_size_for(per_rank_batch, b) for b in wanted}, reverse=True)
