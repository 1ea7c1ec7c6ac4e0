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
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..errors import ConfigError, UsageError
from .feed import Feed
from .micro import Micro

if TYPE_CHECKING:
    from .accumulator import Accumulator

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """What iteration carries from one micro-batch (and window) to the next."""

    feed: Feed
    agree: bool  # data-parallel over more than one rank: windows' lengths are agreed on
    world: int
    last_batch: Any = None  # kept only to pad with
    exhausted: bool = False  # this rank's data ran out (data-parallel: it pads until the others end)
    warned: bool = False


def iterate_windows(acc: Accumulator, loader: Iterable[Any]) -> Iterator[Micro]:
    """The body of ``Accumulator.iterate`` (see its docstring), window after window."""
    world = distributed.world_size()
    stream = _Stream(Feed(loader), agree=acc._data_parallel is not None and world > 1, world=world)
    _require_data(stream)
    more = True
    while more:
        window = acc.window
        ranks_with_more = yield from _window(acc, stream, window)
        if acc.window == window:
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


def _window(acc: Accumulator, stream: _Stream, window: int) -> Generator[Micro, None, float]:
    """One window's micro-batches; returns how many ranks have another micro-batch after it."""
    steps = acc.steps_for(window)
    acc._prepare_batchnorm(steps)
    ranks_with_more = 0.0
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
        del batch
        acc._current = micro
        acc._has_more_local = has_more
        try:
            with distributed.ddp_sync(acc.model, enabled=is_last or acc.sync_every_micro_batch):
                yield micro
        finally:
            acc._current = None
        del micro
        if is_last:
            if stream.agree and at_window_end and acc.window != window:
                ranks_with_more = acc._ranks_with_more
            elif at_window_end and not stream.agree:
                ranks_with_more = float(stream.feed.has_more())
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
