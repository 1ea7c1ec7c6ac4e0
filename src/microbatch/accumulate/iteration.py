"""``Accumulator.iterate``: hand out micro-batches with their window positions.

A window ends at its planned length or where the data ends. Knowing that needs a look-ahead only
for a loader without a len() (feed.py). Across data-parallel ranks every rank must run the same
number of micro-batches per window: after every micro-batch but a window's last, one all_reduce of
one number (how many ranks have another micro-batch); at the window's last that number rides in
step()'s all_reduce. A rank whose data runs out first repeats its last micro-batch as padding
(weight 0) until the others finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import distributed
from ..errors import ConfigError, UsageError
from ..trees.batches import batch_size_of
from .feed import Feed
from .micro import Micro
from .state import WindowState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Windows:
    """What iteration needs from the Accumulator besides its window state."""

    model: nn.Module  # the (DDP-wrapped) model whose gradient sync is held back between micro-batches
    data_parallel: str | None  # distributed.data_parallel_kind(model)
    sync_every_micro_batch: bool
    steps_for: Callable[[int], int]  # planned micro-batches of a window
    start_window: Callable[[int], None]  # called with the planned steps before a window's first micro-batch
    samples_per_window: int | None = None  # the plan's per-rank batch: warn once when a window differs


@dataclass
class _Stream:
    """What iteration carries from one micro-batch (and window) to the next."""

    feed: Feed
    agree: bool  # data-parallel over more than one rank: windows' lengths are agreed on
    world: int
    last_batch: Any = None  # kept only to pad with
    exhausted: bool = False  # this rank's data ran out (data-parallel: it pads until the others end)
    warned: bool = False


def iterate_windows(state: WindowState, windows: Windows, loader: Iterable[Any]) -> Iterator[Micro]:
    """The body of ``Accumulator.iterate`` (see its docstring), window after window."""
    refuse_nested(state)
    state.iterating = True
    try:
        yield from _windows(state, windows, loader)
    finally:
        state.iterating = False


def refuse_nested(state: WindowState) -> None:
    if state.iterating:
        raise UsageError(
            "iterate() while another iterate() of this Accumulator is still running: the two would share "
            "one window. Finish (or break out of) the first loop before starting another"
        )


def _windows(state: WindowState, windows: Windows, loader: Iterable[Any]) -> Iterator[Micro]:
    world = distributed.world_size()
    stream = _Stream(Feed(loader), agree=windows.data_parallel is not None and world > 1, world=world)
    _require_data(stream)
    more = True
    while more:
        window = state.window
        ranks_with_more = yield from _window(state, windows, stream, window)
        if state.window == window:
            raise UsageError(
                f"window {window} ended (micro.is_last was True) but step() was not called; "
                "call acc.step() when micro.is_last"
            )
        more = ranks_with_more > 0
        _warn_once_if_uneven(stream, ranks_with_more, window)


def _require_data(stream: _Stream) -> None:
    has_data = stream.feed.has_more()
    if stream.agree:
        (ranks_with_data,) = distributed.all_reduce_values([float(has_data)])
        if ranks_with_data < stream.world:  # raised on every rank, so none waits for the others
            raise ConfigError(
                f"the loader given to iterate() is empty on {stream.world - round(ranks_with_data)} of "
                f"{stream.world} rank(s): every rank needs at least one micro-batch"
            )
    elif not has_data:
        raise ConfigError("the loader given to iterate() is empty: it produced no micro-batches")


def _window(
    state: WindowState, windows: Windows, stream: _Stream, window: int
) -> Generator[Micro, None, float]:
    """One window's micro-batches; returns how many ranks have another micro-batch after it."""
    steps = windows.steps_for(window)
    windows.start_window(steps)
    ranks_with_more = 0.0
    samples = 0
    for index in range(steps):
        padding = stream.exhausted
        batch = stream.last_batch if padding else stream.feed.take()
        stream.last_batch = batch if stream.agree else None
        at_window_end = index == steps - 1
        if padding:
            has_more = False
        elif at_window_end and not stream.agree:
            has_more = True  # decided after the window's step(), without fetching ahead
        else:
            has_more = stream.feed.has_more()
        stream.exhausted = not has_more
        ranks_with_more = float(has_more)
        if stream.agree and not at_window_end:  # at the window's end step() carries the count
            (ranks_with_more,) = distributed.all_reduce_values([ranks_with_more])
        is_last = at_window_end or ranks_with_more == 0
        micro = Micro(
            batch=batch, index=index, window=window, steps=steps, is_last=is_last, is_padding=padding
        )
        samples += _samples(batch) if not padding and windows.samples_per_window is not None else 0
        del batch
        state.current = micro
        state.has_more_local = has_more
        try:
            with distributed.ddp_sync(windows.model, enabled=is_last or windows.sync_every_micro_batch):
                yield micro
        finally:
            state.current = None
        del micro
        if is_last:
            if stream.agree and at_window_end and state.window != window:
                ranks_with_more = state.ranks_with_more
            elif at_window_end and not stream.agree:
                ranks_with_more = float(stream.feed.has_more())
            if at_window_end:  # a full window (by its planned count)
                _warn_once_if_not_the_plans_batch(state, windows, samples, steps, window, ranks_with_more > 0)
            return ranks_with_more
        _warn_once_if_uneven(stream, ranks_with_more, window)
    return ranks_with_more  # not reached: the window's last index is its end


def _warn_once_if_uneven(stream: _Stream, ranks_with_more: float, window: int) -> None:
    if stream.warned or not stream.agree or not (0 < ranks_with_more < stream.world):
        return
    stream.warned = True
    distributed.log_rank_zero(
        logger,
        logging.WARNING,
        "the data ran out on %d of %d ranks in window %d: they repeat their last micro-batch with "
        "weight 0 (Micro.is_padding) until the other ranks finish, so the gradient stays exact; "
        "shard the data evenly (DistributedSampler) to avoid this idle compute",
        stream.world - round(ranks_with_more),
        stream.world,
        window,
    )


def _samples(batch: Any) -> int:
    """The micro-batch's samples (its first tensor's first dimension; 0 when it has no tensor)."""
    try:
        return batch_size_of(batch)
    except (ConfigError, TypeError, ValueError, IndexError):
        return 0


def _warn_once_if_not_the_plans_batch(
    state: WindowState, windows: Windows, samples: int, steps: int, window: int, data_continues: bool
) -> None:
    """A full window fed more or fewer samples than the plan's per-rank batch (plan.apply sets it).

    The README's loop fed from DataLoader(batch_size=plan.micro_batch_size) trains, for a plan of
    19 x 6 + 14, windows of 7 x 19 = 133 samples instead of 128: exact gradients of another batch.
    Fewer samples in the data's last window are the data's end (a short last batch), not a misfeed.
    """
    expected = windows.samples_per_window
    if expected is None or samples in (0, expected) or state.warned_plan_batch:
        return
    if samples < expected and not data_continues:
        return
    state.warned_plan_batch = True
    distributed.log_rank_zero(
        logger,
        logging.WARNING,
        "window %d held %d samples in %d micro-batches, but the plan's batch is %d per rank: the loader "
        "does not feed the plan's split, so each step trains on another batch size. Feed the plan's "
        "micro-batch sizes (plan.micro_batch_sizes, e.g. plan.split(batch) on each rank's batch, or a "
        "batch_sampler that yields those sizes); DataLoader(batch_size=plan.micro_batch_size) is right "
        "only when the sizes are all equal",
        window,
        samples,
        steps,
        expected,
    )
