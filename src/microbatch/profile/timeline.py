"""Timing and live bytes of one forward and backward, cut into segments by hooks on the blocks.

Events, in time order: "start"; "pre NAME" and "post NAME" around each block's forward; "end
forward"; "bstart NAME" when the gradient of a block's output is ready (its backward starts) and
"bend NAME" when the gradient of its input is ready (its backward ended); "end". Each event reads
the clock and, with a MemoryTracker, the live bytes and the peak since the previous event.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import WorkloadError
from ..memory import MemoryTracker
from ..trees.batches import tensors_of

BEFORE, END_FORWARD, END = "start", "end forward", "end"
WHOLE_MODEL = "(whole model)"


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in tensors_of(value) if t.requires_grad), None)


def unique_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of the storages of the tensors in ``value`` (nested), each storage once."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors_of(value):
        storage = tensor.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += int(storage.nbytes())
    return total


@dataclass
class _Event:
    seconds: float
    live_bytes: int
    peak_bytes: int  # the most bytes live since the previous event (live_bytes without a tracker)


class Recorder:
    """Hooks that mark when each block's forward and backward start and end.

    Forward: module pre-hooks and hooks (a checkpoint recomputes inside the block's own forward, so
    these fire once). Backward: tensor hooks on the block's output (its gradient is ready: the
    block's backward starts) and on its input (its gradient is ready: the block's backward ended).
    With a tracker each event also reads the live bytes and the peak since the previous event.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[str, nn.Module]],
        *,
        tracker: MemoryTracker | None,
        device: torch.device,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.tracker = tracker
        self.device = device
        self.read_seconds = clock
        self.events: dict[str, _Event] = {}
        self.order: list[str] = []  # blocks in the order their forwards ran
        self.boundary_bytes: dict[str, int] = {}
        self.in_backward = False
        self._labels: dict[int, tuple[weakref.ref[torch.Tensor], list[str]]] = {}
        self._handles: list[Any] = []
        for name, module in blocks:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def mark(self, label: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = self.read_seconds()
        live = peak = 0
        if self.tracker is not None:
            live, peak = self.tracker.current_bytes, self.tracker.peak_bytes
            # Restart the running peak here, so the next event reads the peak of its own interval.
            self.tracker.peak_bytes = live
        if label in self.events:
            raise WorkloadError(
                f"profiling: {label!r} happened twice in one forward and backward; the planner needs each "
                "block to run once per forward (pass blocks= naming modules that do)"
            )
        self.events[label] = _Event(seconds, live, peak)

    def _on_gradient(self, tensor: torch.Tensor, label: str) -> None:
        """Mark ``label`` when ``tensor``'s gradient is ready.

        One tensor is often both a block's output and the next block's input. Its hooks then fire
        together, and the later block's end ("bend") must be marked before the earlier block's start
        ("bstart"), so one hook per tensor marks its labels in that order.
        """
        key = id(tensor)
        entry = self._labels.get(key)
        if entry is not None and entry[0]() is tensor:
            entry[1].append(label)
            return
        labels = [label]
        self._labels[key] = (weakref.ref(tensor), labels)

        def fire(grad: torch.Tensor) -> None:
            for found in sorted(labels, key=lambda text: not text.startswith("bend")):
                self.mark(found)

        tensor.register_hook(fire)

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.in_backward:
                return
            self.order.append(name)
            self.mark(f"pre {name}")
            self.boundary_bytes[name] = unique_bytes(args)
            tensor = _first_grad_tensor(args)
            if tensor is not None:
                self._on_gradient(tensor, f"bend {name}")

        return hook

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self.in_backward:
                return
            self.mark(f"post {name}")
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                self._on_gradient(tensor, f"bstart {name}")

        return hook


def gap_names(order: Sequence[str]) -> list[str]:
    """Names of the parts outside blocks: before the first, between neighbours, after the last.

    Without blocks the whole model is one part, "(whole model)".
    """
    if not order:
        return [WHOLE_MODEL, WHOLE_MODEL]
    between = [f"(between {a} and {b})" for a, b in itertools.pairwise(order)]
    return ["(before blocks)", *between, "(after blocks)"]


@dataclass
class SegmentRun:
    forward_seconds: float
    backward_seconds: float
    kept_bytes: int
    peak_bytes: int


@dataclass
class Run:
    segments: dict[str, SegmentRun]
    start_bytes: int  # live at the forward's start
    peak_bytes: int  # the most live bytes over the whole forward and backward
    seconds: float  # the whole micro-batch, from its batch in hand: forward, backward
    in_order: bool  # backward events came in reverse forward order
    order: tuple[str, ...]  # blocks in the order their forwards ran
    boundary_bytes: dict[str, int]  # each block's input
    # The peak in CUDA reserved bytes: the run's recorded allocations replayed (profile/reserved.py).
    reserved_peak_bytes: int | None = None


def split(recorder: Recorder, order: Sequence[str], seconds_from: float) -> Run:
    """Cut the events of one forward + backward into segments (see the module docstring)."""
    events = recorder.events
    gaps = gap_names(order)
    forward_labels = [BEFORE]
    for name in order:
        forward_labels += [f"pre {name}", f"post {name}"]
    forward_labels.append(END_FORWARD)
    backward_labels = [END_FORWARD]
    for name in reversed(order):
        backward_labels += [f"bstart {name}", f"bend {name}"]
    backward_labels.append(END)
    # A block whose input needs no gradient has no "bend": it ends at the next event that happened.
    resolved: dict[str, str] = {}
    following = END
    for label in reversed(backward_labels):
        following = label if label in events else following
        resolved[label] = following
    present = [label for label in backward_labels if label in events]
    in_order = all(events[a].seconds <= events[b].seconds for a, b in itertools.pairwise(present))

    # Segment j in forward order spans forward_labels[j:j + 2]; its backward spans the matching pair.
    names: list[str] = []
    backward_spans: list[tuple[str, str]] = []
    for index, name in enumerate(order):
        names += [gaps[index], name]
        after = f"bstart {order[index - 1]}" if index else END
        backward_spans += [(f"bend {name}", after), (f"bstart {name}", f"bend {name}")]
    names.append(gaps[-1])
    backward_spans.append((END_FORWARD, f"bstart {order[-1]}") if order else (END_FORWARD, END))

    segments: dict[str, SegmentRun] = {}
    for index, name in enumerate(names):
        begin, end = events[forward_labels[index]], events[forward_labels[index + 1]]
        peak = end.peak_bytes
        backward_begin, backward_end = (resolved[label] for label in backward_spans[index])
        backward_seconds = 0.0
        if backward_begin != backward_end:
            backward_seconds = events[backward_end].seconds - events[backward_begin].seconds
            peak = max(peak, events[backward_end].peak_bytes)
        segments[name] = SegmentRun(
            forward_seconds=end.seconds - begin.seconds,
            backward_seconds=max(0.0, backward_seconds),
            kept_bytes=end.live_bytes - begin.live_bytes,
            peak_bytes=max(0, peak - begin.live_bytes),
        )
    start = events[BEFORE]
    return Run(
        segments=segments,
        start_bytes=start.live_bytes,
        peak_bytes=max(event.peak_bytes for event in events.values()),
        seconds=events[END].seconds - seconds_from,
        in_order=in_order,
        order=tuple(order),
        boundary_bytes=dict(recorder.boundary_bytes),
    )
