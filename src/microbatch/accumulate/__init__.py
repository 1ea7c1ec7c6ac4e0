"""Train: one optimizer step's exact gradient from many micro-batches.

Owns the ``Accumulator`` (``accumulator``) and what it is built from: the checks on steps, items and
losses (``micro``), iterating a loader by windows (``iteration``), the window's state with its one
discard path (``state``), the step arithmetic (``window``), feeding micro-batches to the device
(``feed``), wide float32 sums and compute dtypes (``precision``), BatchNorm momentum
(``batchnorm``), batch-size schedules (``schedules``), windows cut by tokens (``tokens``) and
gradient caching for losses that couple a batch (``cached``) and a mixture-of-experts router's
load-balancing loss over the window (``balance``).

May import: ``errors``, ``trees``, ``memory``, ``distributed``, ``stepping``. Never the profile, planner or
training. Invariant: a window's gradient is sum_i(items_i * grad loss_i) / sum_i(items_i) over every
micro-batch and every rank, for any split, a short last micro-batch and a partial last window;
the optimizer steps once per window (a step that began is never redone).
"""

from __future__ import annotations

from . import schedules
from .accumulator import Accumulator, StepsSchedule
from .balance import WindowLoadBalance
from .batchnorm import convert_batchnorm_to_groupnorm, corrected_momentum
from .cached import cached_backward
from .micro import Micro, WindowStats
from .tokens import TokenStats, TokenWindows, split_by_tokens

__all__ = [
    "Accumulator",
    "Micro",
    "StepsSchedule",
    "TokenStats",
    "TokenWindows",
    "WindowLoadBalance",
    "WindowStats",
    "cached_backward",
    "convert_batchnorm_to_groupnorm",
    "corrected_momentum",
    "schedules",
    "split_by_tokens",
]
