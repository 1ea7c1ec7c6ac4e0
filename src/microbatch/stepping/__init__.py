"""The rules of one optimizer step made from many micro-batches, shared by every way of making one.

``step_guard``: how far a window's step got (``StepProgress``), the step-began guard (a step that
began is never repeated; work on the next window waits until it is finished or dropped), the
optimizer's fingerprint that tells a clean failure from a half-made step, the items > 0 rule, and
the refusal by name of an option a window maker does not honour. Used by ``accumulate`` (the
Accumulator) and ``distributed`` (the Pipeline), so both keep the same rules.

May import: ``errors``. Nothing above it: it is the bottom layer beside ``errors``.
"""

from __future__ import annotations

from .step_guard import (
    StepProgress,
    guarded_optimizer_step,
    optimizer_fingerprint,
    refuse_option,
    refuse_retry,
    refuse_work_while_step_unfinished,
    require_items,
)

__all__ = [
    "StepProgress",
    "guarded_optimizer_step",
    "optimizer_fingerprint",
    "refuse_option",
    "refuse_retry",
    "refuse_work_while_step_unfinished",
    "require_items",
]
