"""Each Trainer window's peak memory, and the run's worst window against the budget.

``record_window_peaks(trainer, budget_bytes=...)`` (``fit_trainer`` calls it) measures the
Trainer's windows with ``memory.window_peaks.PeakMemory``: a window starts when the Trainer has
drawn its micro-batches (``get_batch_samples``, wrapped: they are all alive through the window, so
they count from the start, and their shapes say whether the window could be the worst) and ends
after the callbacks' ``on_step_end`` (after the optimizer's step and ``zero_grad``). On CUDA every window's
``max_memory_reserved`` (its peak statistics reset at the window's start); elsewhere MemoryTracker
on the windows no measured one covers, the others bounded (memory/window_peaks.py).

After ``train()``: ``trainer.microbatch_window_peaks.summary()`` (also the last entry of
``trainer.state.log_history``, logged) gives ``worst_window_peak_bytes``, its step, ``budget_bytes``,
``windows_measured`` and ``windows_over_budget``; ``.records`` every window's.

Cost: nothing on CUDA; on the CPU a tracked window runs slower by the tracker's cost per op (15-30 %
on gpt-mini, ~3x on the tiny test models, whose ops take microseconds). Windows 1 and 2 are always
measured, then O(log n) of n: an 8-window epoch of the long-tail test measured 3 and took 1.74 s
instead of 0.97 s; ``trainer.microbatch_window_peaks.remove()`` stops it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..memory import format_bytes
from ..memory.window_peaks import PeakMemory, worst_window

logger = logging.getLogger(__name__)

__all__ = ["TrainerWindowPeaks", "record_window_peaks"]


class TrainerWindowPeaks:
    """The windows' peaks of one Trainer (see the module docstring)."""

    def __init__(self, trainer: Any, *, budget_bytes: int, every: int) -> None:
        self.trainer = trainer
        self.budget_bytes = budget_bytes
        device = next(trainer.model.parameters()).device
        self.peak = PeakMemory(device, model=trainer.model, optimizer=None, every=every)
        self.records: list[dict[str, Any]] = []
        self._open: contextlib.ExitStack | None = None
        self._restore: list[tuple[Any, str, Any]] = []  # (object, attribute, value before the wrapping)

    def remove(self) -> None:
        """Stop recording: the Trainer's own methods back (what a CPU run saves: see the module doc)."""
        self.close()
        for owner, name, value in self._restore:
            setattr(owner, name, value)
        self._restore.clear()
        if getattr(self.trainer, "microbatch_window_peaks", None) is self:
            del self.trainer.microbatch_window_peaks

    def start(self, micro_batches: list[Any]) -> None:
        """A window begins: its micro-batches drawn (the Trainer's optimizer exists by now)."""
        self.close()
        optimizer = self.trainer.optimizer
        self.peak.optimizer = getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper
        stack = contextlib.ExitStack()
        stack.enter_context(self.peak.measure(int(self.trainer.state.global_step) + 1, micro_batches))
        self._open = stack

    def end(self, step: int) -> None:
        """The window's optimizer step is done: its peak (or bound) recorded."""
        if self._open is None:
            return
        self.close()
        self.records.append({"step": step, **self.peak.record()})

    def close(self) -> None:
        if self._open is not None:
            stack, self._open = self._open, None
            stack.close()

    def summary(self) -> dict[str, Any]:
        return {**worst_window(self.records, self.budget_bytes), "peak_source": self.peak.source}

    def __str__(self) -> str:
        summary = self.summary()
        if summary["worst_window_peak_bytes"] is None:
            return "no training window measured"
        return (
            f"worst of {len(self.records)} windows {format_bytes(summary['worst_window_peak_bytes'])} "
            f"(step {summary['worst_window_step']}, {self.peak.source}) of the budget "
            f"{format_bytes(self.budget_bytes)}; {summary['windows_measured']} measured, "
            f"{summary['windows_over_budget']} over"
        )


def record_window_peaks(trainer: Any, *, budget_bytes: int, every: int = 50) -> TrainerWindowPeaks:
    """Measure ``trainer``'s windows from its next ``train()`` on; returns the recorder, also
    ``trainer.microbatch_window_peaks``. ``every``: the CPU tracker's spot check, in windows."""
    installed = getattr(trainer, "microbatch_window_peaks", None)
    if isinstance(installed, TrainerWindowPeaks):  # fit_trainer called again: the new budget
        installed.budget_bytes = budget_bytes
        return installed
    peaks = TrainerWindowPeaks(trainer, budget_bytes=budget_bytes, every=every)
    handler = trainer.callback_handler
    on_step_end, on_train_end = handler.on_step_end, handler.on_train_end

    def step_end_then_measured(args: Any, state: Any, control: Any) -> Any:
        # After every callback's on_step_end: a tracker a callback opened in the window (nested in
        # this one) is closed first, so the dispatch modes leave in the order they came.
        control = on_step_end(args, state, control)
        peaks.end(int(state.global_step))
        return control

    def train_end_with_summary(args: Any, state: Any, control: Any) -> Any:
        peaks.close()
        if peaks.records:  # in the log before the callbacks that report it see it
            state.log_history.append({"step": state.global_step, "microbatch_window_peaks": peaks.summary()})
            logger.info("fit_trainer: %s", peaks)
        return on_train_end(args, state, control)

    get_batch_samples = trainer.get_batch_samples
    train = trainer.train

    def measured_batch_samples(*args: Any, **kwargs: Any) -> Any:
        batch_samples, items = get_batch_samples(*args, **kwargs)
        if batch_samples and torch.is_grad_enabled():
            peaks.start(list(batch_samples))
        return batch_samples, items

    def train_closing(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:  # a window an exception left open: its tracker leaves the dispatch stack
            peaks.close()

    peaks._restore = [
        (trainer, "get_batch_samples", get_batch_samples), (trainer, "train", train),
        (handler, "on_step_end", on_step_end), (handler, "on_train_end", on_train_end),
    ]  # fmt: skip
    trainer.get_batch_samples = measured_batch_samples
    trainer.train = train_closing
    handler.on_step_end, handler.on_train_end = step_end_then_measured, train_end_with_summary
    trainer.microbatch_window_peaks = peaks
    return peaks
