"""Reading a loader for ``Accumulator.iterate`` with as little look-ahead as possible.

iterate() must know, when it hands out a micro-batch, whether the window ends with it. A loader
with a length answers that without fetching anything: ``remaining > 0``. Only a loader without one
(a generator, a DataLoader over an IterableDataset) is read one item ahead. Fetching ahead hands a
loader that refills one buffer in place the wrong data, and a stateful loader saved beside
``acc.state_dict()`` would have moved one micro-batch past the window boundary.

A length is trusted but checked where it claims the data ends: one ``next()`` there (on a correct
length it only sees StopIteration). If items remain, iteration goes on without a length; if the
loader ends before its length, ``take()`` raises UsageError.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ..errors import UsageError

logger = logging.getLogger(__name__)


def known_length(loader: Iterable[Any]) -> int | None:
    """``len(loader)`` where it is a count of items, else None (no length, or only an estimate)."""
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return None  # an estimate, split across workers; torch warns when it is wrong
    try:
        length = len(loader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None
    return length if isinstance(length, int) and length >= 0 else None


class Feed:
    """Items of one pass over a loader; ``has_more()`` looks ahead only when the length is unknown."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self._remaining = known_length(loader)
        self._iterator: Iterator[Any] = iter(loader)
        self._peeked: list[Any] = []  # at most one item fetched ahead
        self.taken = 0

    @property
    def looks_ahead(self) -> bool:
        """True when the loader has no trusted length, so ``has_more()`` fetches the next item."""
        return self._remaining is None

    def has_more(self) -> bool:
        if self._peeked:
            return True
        if self._remaining is not None and self._remaining > 0:
            return True
        try:
            self._peeked.append(next(self._iterator))
        except StopIteration:
            return False
        if self._remaining is not None:
            logger.warning(
                "the loader's len() said it ends after %d items but it has more; reading on without "
                "trusting its length (fix __len__ so micro-batches are not fetched ahead)",
                self.taken,
            )
            self._remaining = None
        return True

    def take(self) -> Any:
        if self._peeked:
            item = self._peeked.pop()
        else:
            try:
                item = next(self._iterator)
            except StopIteration:
                raise UsageError(
                    f"the loader ended after {self.taken} micro-batches although its len() promised "
                    f"{self.taken + (self._remaining or 0)}; the window in progress has no last micro-batch: "
                    "call acc.step(partial=True) to apply it or acc.discard_window() to drop it, and "
                    "fix the loader's __len__"
                ) from None
        if self._remaining is not None:
            self._remaining -= 1
        self.taken += 1
        return item
