"""A model of PyTorch's CUDA caching allocator, so that a peak can be stated in *reserved* bytes.

A CUDA out-of-memory error happens when the caching allocator cannot reserve another segment, not
when the live tensors (``max_memory_allocated``) reach the device's size. The rules modelled here
are those of c10/cuda/CUDACachingAllocator.cpp (the native allocator, one stream, default
``PYTORCH_CUDA_ALLOC_CONF`` apart from ``expandable_segments``):

- every request is rounded up to a multiple of 512 B (kMinBlockSize), at least 512 B;
- requests of at most 1 MiB (kSmallSize) are served from the small pool, whose segments are
  2 MiB (kSmallBuffer); larger requests from the large pool, whose segments are 20 MiB
  (kLargeBuffer) for requests below 10 MiB (kMinLargeAlloc) and the request rounded up to
  2 MiB (kRoundLarge) otherwise;
- a request takes the smallest cached free block of its pool that holds it (best fit, lowest
  address among equals); the rest of the block is split off when it is at least 512 B (small
  pool) or more than 1 MiB (large pool), else the request keeps the whole block;
- a freed block merges with free neighbours of its segment; segments are never given back to
  the driver, except when a new segment does not fit: then every wholly free segment is released
  and the request is retried (release_cached_blocks), and if it still does not fit that is an OOM;
- with ``expandable_segments:True`` each pool is one growing address range, mapped in pages of
  2 MiB (small pool) or 20 MiB (large pool): a request that no free block holds extends the
  range past its end (reusing a free block that ends it), so fragmentation between segments goes.

Memory the allocator never sees (the CUDA context, cuBLAS/cuDNN handles, NCCL's buffers, other
processes) is measured, not modelled: ``outside_allocator_bytes``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..errors import ConfigError, InfeasibleBudgetError

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is a multiple of this
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer: a small pool segment (and its expandable page)
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: the segment for 1-10 MiB requests (expandable page)
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here a request gets its own rounded segment
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: the rounding of such segments


def round_size(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` occupies: a multiple of 512, at least 512."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def is_small(nbytes: int) -> bool:
    """True when a request of ``nbytes`` (rounded) comes from the small pool."""
    return round_size(nbytes) <= SMALL_REQUEST_BYTES


def segment_size(nbytes: int) -> int:
    """The segment the allocator reserves when no cached block holds a request of ``nbytes``."""
    size = round_size(nbytes)
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _should_split(small: bool, remaining: int) -> bool:
    return remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES


@dataclass
class _Block:
    address: int
    size: int
    segment: int
    free: bool


class AllocatorOutOfMemoryError(Exception):
    """The modelled allocator could not reserve a segment within its capacity."""


class _Pool:
    """One pool (small or large) of segments split into blocks; free blocks kept in best-fit order."""

    def __init__(self, *, small: bool, expandable: bool, addresses: itertools.count[int]) -> None:
        self.small = small
        self.expandable = expandable
        self.page_bytes = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        self._addresses = addresses
        self.blocks: dict[int, _Block] = {}  # by address
        self.order: list[int] = []  # addresses of all blocks, sorted
        self.free_keys: list[tuple[int, int]] = []  # (size, address) of free blocks, sorted
        self.segments: dict[int, int] = {}  # segment id -> its reserved bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self.segments.values())

    def _add(self, block: _Block) -> None:
        self.blocks[block.address] = block
        bisect.insort(self.order, block.address)
        if block.free:
            bisect.insort(self.free_keys, (block.size, block.address))

    def _remove(self, block: _Block) -> None:
        del self.blocks[block.address]
        self.order.pop(bisect.bisect_left(self.order, block.address))
        if block.free:
            self.free_keys.remove((block.size, block.address))

    def best_fit(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self.free_keys, (size, -1))
        if index == len(self.free_keys):
            return None
        return self.blocks[self.free_keys[index][1]]

    def new_segment(self, size: int) -> _Block:
        """Reserve a segment (or, expandable, grow the pool's range) so that a free block holds ``size``."""
        if self.expandable and self.segments:
            return self._grow(size)
        reserved = (
            segment_size(size) if not self.expandable else -(-size // self.page_bytes) * self.page_bytes
        )
        segment = next(self._addresses)
        block = _Block(address=segment * (1 << 50), size=reserved, segment=segment, free=True)
        self.segments[segment] = reserved
        self._add(block)
        return block

    def _grow(self, size: int) -> _Block:
        (segment,) = self.segments
        last = self.blocks[self.order[-1]]
        have = last.size if last.free else 0
        extra = -(-(size - have) // self.page_bytes) * self.page_bytes
        self.segments[segment] += extra
        if last.free:
            self._remove(last)
            last.size += extra
            self._add(last)
            return last
        block = _Block(address=last.address + last.size, size=extra, segment=segment, free=True)
        self._add(block)
        return block

    def take(self, block: _Block, size: int) -> _Block:
        """Hand out ``block`` for a request of ``size`` (rounded), splitting off the rest when worth it."""
        self._remove(block)
        remaining = block.size - size
        if _should_split(self.small, remaining):
            self._add(_Block(block.address + size, remaining, block.segment, free=True))
            block.size = size
        block.free = False
        self._add(block)
        return block

    def release(self, block: _Block) -> None:
        """Free ``block`` and merge it with free neighbours in its segment."""
        self._remove(block)
        block.free = True
        index = bisect.bisect_left(self.order, block.address)
        if index < len(self.order):
            after = self.blocks[self.order[index]]
            if after.free and after.segment == block.segment and after.address == block.address + block.size:
                self._remove(after)
                block.size += after.size
        if index > 0:
            before = self.blocks[self.order[index - 1]]
            if (
                before.free
                and before.segment == block.segment
                and before.address + before.size == block.address
            ):
                self._remove(before)
                before.size += block.size
                block = before
        self._add(block)

    def release_free_segments(self) -> None:
        """Give back every segment that is one free block (what the allocator does before an OOM)."""
        for address in list(self.order):
            block = self.blocks.get(address)
            if block is not None and block.free and block.size == self.segments.get(block.segment):
                self._remove(block)
                del self.segments[block.segment]


@dataclass(frozen=True)
class AllocatorPeaks:
    """Peaks of a replayed sequence: live (allocated, rounded) and reserved bytes, as torch reports them.

    ``out_of_memory``: the sequence does not run at the capacity it was replayed at (``reserved_at``).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    out_of_memory: bool = False


class CachingAllocatorModel:
    """Replays allocations and frees as the caching allocator serves them; tracks allocated / reserved.

    ``capacity_bytes``: the most the allocator may reserve (None: unlimited); a request beyond it,
    after the cached free segments are released, raises AllocatorOutOfMemoryError.
    """

    def __init__(self, *, expandable_segments: bool = False, capacity_bytes: int | None = None) -> None:
        addresses = itertools.count(1)
        self.pools = {
            small: _Pool(small=small, expandable=expandable_segments, addresses=addresses)
            for small in (True, False)
        }
        self.capacity_bytes = capacity_bytes
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self._handles: dict[int, tuple[_Pool, _Block]] = {}
        self._next_handle = itertools.count()

    @property
    def reserved_bytes(self) -> int:
        return sum(pool.reserved_bytes for pool in self.pools.values())

    def malloc(self, nbytes: int) -> int:
        """Serve a request of ``nbytes``; returns a handle for ``free``."""
        if nbytes < 0:
            raise ConfigError(f"nbytes must be >= 0, got {nbytes}")
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_REQUEST_BYTES]
        block = pool.best_fit(size)
        if block is None:
            block = self._reserve(pool, size)
        block = pool.take(block, size)
        handle = next(self._next_handle)
        self._handles[handle] = (pool, block)
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return handle

    def _reserve(self, pool: _Pool, size: int) -> _Block:
        before = self.reserved_bytes
        block = pool.new_segment(size)
        if self.capacity_bytes is not None and self.reserved_bytes > self.capacity_bytes:
            grown = self.reserved_bytes - before
            self._undo(pool, block, grown)
            for each in self.pools.values():
                each.release_free_segments()
            block = pool.new_segment(size)
            if self.reserved_bytes > self.capacity_bytes:
                self._undo(pool, block, self.reserved_bytes - before)
                raise AllocatorOutOfMemoryError(
                    f"a request of {size} B needs {grown} B more reserved; {self.reserved_bytes} B of "
                    f"{self.capacity_bytes} B are reserved"
                )
        return block

    @staticmethod
    def _undo(pool: _Pool, block: _Block, grown: int) -> None:
        """Take back what new_segment just reserved (a whole new segment, or an expandable range's growth)."""
        pool._remove(block)
        block.size -= grown
        pool.segments[block.segment] -= grown
        if pool.segments[block.segment] == 0:
            del pool.segments[block.segment]
        elif block.size > 0:
            pool._add(block)

    def free(self, handle: int) -> None:
        pool, block = self._handles.pop(handle)
        self.allocated_bytes -= block.size
        pool.release(block)


def replay(
    events: Iterable[int], *, expandable_segments: bool = False, capacity_bytes: int | None = None
) -> AllocatorPeaks:
    """Peaks of a sequence of events: n >= 0 allocates n bytes (0: nothing, as CUDA does), ``-k``
    frees the k-th allocation (counting from 1, in the order made). MemoryTracker(record_allocations=True)
    records such a sequence. With ``capacity_bytes`` the allocator may reserve no more (it releases
    its cached free segments first, as before a CUDA OOM); AllocatorOutOfMemoryError when it must."""
    model = CachingAllocatorModel(expandable_segments=expandable_segments, capacity_bytes=capacity_bytes)
    handles: list[int | None] = []
    for event in events:
        if event >= 0:
            handles.append(model.malloc(event) if event > 0 else None)
        else:
            handle = handles[-event - 1]
            if handle is not None:
                model.free(handle)
    return AllocatorPeaks(model.peak_allocated_bytes, model.peak_reserved_bytes)


_CAPACITY: ContextVar[int | None] = ContextVar("microbatch_allocator_capacity", default=None)


@contextlib.contextmanager
def allocator_capacity(capacity_bytes: int | None) -> Iterator[None]:
    """Within the block, ``reserved_at`` replays at ``capacity_bytes`` when given none (None: unlimited).

    The planner sets the budget's share of the allocator around the profiling it runs, so each
    profiled run's reserved peak is the one the device has at the budget (profile/reserved.py).
    """
    token = _CAPACITY.set(capacity_bytes)
    try:
        yield
    finally:
        _CAPACITY.reset(token)


def current_capacity() -> int | None:
    """The capacity ``allocator_capacity`` set around the caller (None: unlimited)."""
    return _CAPACITY.get()


def reserved_at(
    events: Sequence[int], *, capacity_bytes: int | None, expandable_segments: bool = False
) -> AllocatorPeaks:
    """What the device does with ``events`` when the allocator may reserve ``capacity_bytes``.

    Running within a capacity C is not monotone in C: the allocator gives its cached free segments
    back only when a new segment does not fit, so a smaller device can run a sequence (it released
    a free segment early) that a larger one fails (it kept that segment cached, and later the
    cache's free blocks are split the wrong way). So the answer is the replay at the budget's own
    capacity, not a bisection over capacities.

    The replay at C: its peaks, at most C reserved. When it runs out, the peaks of the unlimited
    replay with ``out_of_memory=True``: that peak exceeds C, because both replays are the same
    until the first request the capacity cannot serve, and there the unlimited one reserves
    more than C. ``capacity_bytes=None``: the unlimited replay, an upper bound of the reserved
    peak at every capacity the sequence runs at (by the same argument: up to the first release
    the two are the same, and after it the capped one stays within C, below that first excess).
    """
    if capacity_bytes is None:
        return replay(events, expandable_segments=expandable_segments)
    try:
        return replay(events, expandable_segments=expandable_segments, capacity_bytes=capacity_bytes)
    except AllocatorOutOfMemoryError:
        unlimited = replay(events, expandable_segments=expandable_segments)
        return dataclasses.replace(unlimited, out_of_memory=True)


def least_reserved(
    events: Sequence[int], *, expandable_segments: bool = False, resolution_bytes: int = ROUND_LARGE_BYTES
) -> AllocatorPeaks:
    """An estimate: the peaks of ``events`` at about the least capacity C they run at.

    For a run that is not the memory of the plan it prices (a two-layer copy of a simulated
    architecture, the whole-model runs of a sharded plan), no capacity is its own: near the
    budget the allocator gives cached free segments back, so the unlimited replay's R overstates
    the reserved bytes, and this takes the device as tight instead. A bisection between the peak
    allocated bytes A and R, to within ``resolution_bytes`` (or 0.1 % of R): it assumes fitting
    is monotone in C, which it is not (``reserved_at``): a capacity above the one found may fail.
    Where the capacity is known, ``reserved_at`` is the answer.
    """
    unlimited = replay(events, expandable_segments=expandable_segments)
    low, high = unlimited.peak_allocated_bytes - 1, unlimited.peak_reserved_bytes  # fails, runs
    best = unlimited
    step = max(resolution_bytes, unlimited.peak_reserved_bytes // 1000)
    while high - low > step:
        middle = (low + high) // 2
        try:
            best = replay(events, expandable_segments=expandable_segments, capacity_bytes=middle)
        except AllocatorOutOfMemoryError:
            low = middle
            continue
        high = middle
    return best


def expandable_segments_enabled() -> bool:
    """True when ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable segments on (read by torch at CUDA init)."""
    import os

    config = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return any(part.replace(" ", "").lower() == "expandable_segments:true" for part in config.split(","))


def outside_allocator_bytes(device: torch.device) -> int:
    """Bytes in use on ``device`` that the caching allocator does not hold, measured now.

    The CUDA context, the cuBLAS and cuDNN handles (created here by a small matmul and convolution
    if they were not), and anything else on the device: NCCL's buffers once a collective ran, other
    processes. 0 off CUDA. Measured as (total - free) - reserved, from cudaMemGetInfo.
    """
    if device.type != "cuda":
        return 0
    with torch.no_grad():
        a = torch.ones(64, 64, device=device)
        (a @ a).sum()
        if torch.backends.cudnn.is_available():
            torch.nn.functional.conv2d(a.view(1, 1, 64, 64), a[:3, :3].reshape(1, 1, 3, 3))
        del a
    torch.cuda.synchronize(device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return max(0, int(total_bytes - free_bytes) - int(torch.cuda.memory_reserved(device)))


def ddp_bucket_bytes(
    model: torch.nn.Module, *, world_size: int, gradient_as_bucket_view: bool = False
) -> int:
    """DDP's gradient buckets: one more copy of the trainable gradients when more than one rank runs,
    none with ``gradient_as_bucket_view=True`` (the gradients then live in the buckets)."""
    if world_size <= 1 or gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def check_cuda_budget(
    budget_bytes: int, *, total_bytes: int, outside_bytes: int, name: str = "memory"
) -> None:
    """Refuse a budget above the device or within what the context and workspaces already take."""
    from .units import format_bytes

    if budget_bytes > total_bytes:
        raise ConfigError(
            f"{name}={format_bytes(budget_bytes)} is above the device's total memory "
            f"{format_bytes(total_bytes)}; give at most {format_bytes(total_bytes)} "
            "(or a fraction such as 0.9 of the free memory)"
        )
    if budget_bytes <= outside_bytes:
        raise InfeasibleBudgetError(
            f"{name}={format_bytes(budget_bytes)} is not above the {format_bytes(outside_bytes)} that the "
            "CUDA context, cuBLAS/cuDNN workspaces and other users of the device already take outside "
            f"the caching allocator; raise {name} above {format_bytes(outside_bytes)}",
            minimum_bytes=outside_bytes,
            parts={"outside the caching allocator": outside_bytes},
        )
