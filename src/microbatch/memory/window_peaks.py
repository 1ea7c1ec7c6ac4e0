"""Each window's peak memory, and the worst window of a run against the plan's budget.

Used by ``microbatch train`` (training/loop.py: summary.json) and ``fit_trainer`` (hf/trainer_peaks.py).

CUDA: the caching allocator's ``max_memory_reserved`` over the window (``reset_peak_memory_stats``
at its start), what an out-of-memory error is decided on and what the planner's trial measured;
free to read, so every window is measured. Elsewhere: MemoryTracker's peak live tensor bytes,
which makes a CPU window slower (15-30 % on gpt-mini, ~4x on gpt-nano, whose ops take microseconds),
so a window is measured only where it could be the worst:

- the first two windows of a process (the first creates the optimizer state; the second shows
  nothing else grew after it), and every ``every``-th as a spot check;
- a window holding a micro-batch not *covered* by one measured before: a measured micro-batch
  covers one with no more rows and no longer padded rows. Between windows only the micro-batches
  change (parameters, gradients and optimizer state keep their sizes), and a micro-batch's
  activations grow with its rows and with its length. (Covering by padded tokens and length, the
  token budget's argument, is not enough for a tracker's bound: on gpt-nano a window of more,
  shorter rows within the tokens of a measured one peaked 43 KiB, 3 %, above it.)

Drawn in random order, a new covering shape is a record, so after the first windows few are
measured (O(log n) of n windows per dimension). A window not measured records a bound instead
(``peak_measured`` False): the highest peak measured so far plus the bytes by which its inputs
(all its micro-batches, drawn at once and alive through the window) exceed the fewest input bytes
of a measured window. With H the highest measured peak and M any measured window,
static + activations(M) = peak(M) - inputs(M) <= H - min inputs, so a covered window W peaks at most
static + activations(covering) + inputs(W) <= H + inputs(W) - min inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..trees.batches import tensor_bytes, tensors_of
from .tracker import MemoryTracker

# (rows, padded length) of a micro-batch's token ids
Shape = tuple[int, int]


def micro_batch_shapes(micro_batches: Sequence[Any]) -> list[Shape]:
    """(rows, padded length) of each micro-batch: its first tensor's rows, its tensors' longest
    second dimension (1 when none has two)."""
    shapes = []
    for batch in micro_batches:
        tensors = [t for t in tensors_of(batch) if t.dim() > 0]
        rows = int(tensors[0].shape[0]) if tensors else 0
        shapes.append((rows, max((int(t.shape[1]) for t in tensors if t.dim() > 1), default=1)))
    return shapes


def covered(shape: Shape, measured: Sequence[Shape]) -> bool:
    """Whether a measured micro-batch has at least ``shape``'s rows and length."""
    return any(rows >= shape[0] and length >= shape[1] for rows, length in measured)


class PeakMemory:
    """Peak bytes of each optimizer step (see the module docstring for which are measured)."""

    def __init__(self, device: torch.device, *, model: Any, optimizer: Any, every: int) -> None:
        self.device, self.model, self.optimizer, self.every = device, model, optimizer, every
        self.source = "cuda-reserved" if device.type == "cuda" else "tracker"
        self.last_bytes = 0
        self.highest_bytes = 0
        self.highest_step: int | None = None
        self.measured = False
        self.measured_step: int | None = None  # the step last_bytes was measured on
        self.windows_measured = 0
        self.shapes: list[Shape] = []  # the micro-batch shapes measured in this process
        self.fewest_inputs_bytes: int | None = None  # of a window measured in this process

    def should_measure(self, step: int, micro_batches: Sequence[Any] | None) -> bool:
        """Whether window ``step`` (its ``micro_batches``, None: unknown) could be the worst yet."""
        if self.device.type == "cuda" or self.measured_step is None or step <= 2 or step % self.every == 0:
            return True
        if micro_batches is None:
            return False
        return not all(covered(shape, self.shapes) for shape in micro_batch_shapes(micro_batches))

    @contextlib.contextmanager
    def measure(self, step: int, micro_batches: Sequence[Any] | None = None) -> Iterator[None]:
        """Measure window ``step`` when it could be the worst. ``micro_batches``: its inputs, drawn
        before and all alive at once (counted from the start); None for windows of one shape."""
        # read before the window consumes the list
        inputs_bytes = tensor_bytes(micro_batches) if micro_batches is not None else 0
        if not self.should_measure(step, micro_batches):
            yield
            extra_bytes = max(0, inputs_bytes - (self.fewest_inputs_bytes or inputs_bytes))
            self.measured, self.last_bytes = False, self.highest_bytes + extra_bytes
            return
        shapes = micro_batch_shapes(micro_batches) if micro_batches is not None else []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            peak_bytes = int(torch.cuda.max_memory_reserved(self.device))
        else:
            with MemoryTracker(self.device, model=self.model, optimizer=self.optimizer) as tracker:
                if micro_batches is not None:
                    tracker.track(list(micro_batches))
                yield
            peak_bytes = int(tracker.peak_bytes)
        self.shapes.extend(shape for shape in shapes if not covered(shape, self.shapes))
        if micro_batches is not None:
            self.fewest_inputs_bytes = min(self.fewest_inputs_bytes or inputs_bytes, inputs_bytes)
        self.last_bytes, self.measured, self.measured_step = peak_bytes, True, step
        self.windows_measured += 1
        if peak_bytes >= self.highest_bytes:
            self.highest_bytes, self.highest_step = peak_bytes, step

    def record(self) -> dict[str, Any]:
        """The metrics line's peak fields for the window just measured (or not)."""
        return {
            "peak_bytes": self.last_bytes,
            "peak_measured": self.measured,
            "peak_step": self.measured_step if self.measured else self.highest_step,
        }


def worst_window(metrics: Sequence[dict[str, Any]], budget_bytes: int | None) -> dict[str, Any]:
    """The run's worst window against the plan's budget (None: no budget, a manual plan): the highest
    peak, measured or bounded (``worst_window_measured`` says which), over every window."""
    known = [r for r in metrics if int(r.get("peak_bytes", 0)) > 0]
    worst = max(known, key=lambda r: (int(r["peak_bytes"]), bool(r.get("peak_measured", True))), default=None)
    budget = budget_bytes if budget_bytes else None
    return {
        "budget_bytes": budget,
        "worst_window_peak_bytes": int(worst["peak_bytes"]) if worst is not None else None,
        "worst_window_step": int(worst["step"]) if worst is not None else None,
        "worst_window_measured": bool(worst.get("peak_measured", True)) if worst is not None else None,
        "windows_measured": sum(bool(r.get("peak_measured", True)) for r in known),
        "windows_over_budget": (
            sum(int(r["peak_bytes"]) > budget for r in known) if budget is not None else None
        ),
    }
