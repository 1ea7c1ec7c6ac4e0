"""One run of the workload for the profile: a micro-batch cut into segments, the optimizer step.

Both go through the Accumulator, as the planned training loop does, so the loop's own tensors
(the weighted loss, the running sums) and the step's work (rescaling the gradients once, their
norm, the optimizer) are measured as they will be. ``preserved_state`` puts the model back.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..accumulate.accumulator import Accumulator
from ..errors import WorkloadError
from ..memory import MemoryTracker
from ..memory.oom import attempt
from ..trees.batches import move_batch
from ..workload import Workload
from . import reserved, stash
from .timeline import BEFORE, END, END_FORWARD, Recorder, Run, split
from .user_calls import noted_user_call

# Timed repeats of the optimizer step (the median is used).
STEP_REPEATS = 3


@contextlib.contextmanager
def preserved_state(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Parameters, gradients, buffers, train/eval mode, ``optimizer``'s state and the RNG (CPU and
    every CUDA device of the model) come back exactly as they were.

    Never a second copy on the model's device (see stash.py): what may change is kept in host
    memory for a model on an accelerator and in a temporary file for a model in host memory.
    Frozen parameters (requires_grad=False) are not copied: no optimizer updates them.
    """
    with stash.preserved(model, optimizer=optimizer):
        yield


def micro_batch_run(
    workload: Workload,
    blocks: Sequence[tuple[str, nn.Module]],
    size: int,
    device: torch.device,
    *,
    track: bool,
    optimizer: torch.optim.Optimizer,
    clock: Callable[[], float] = time.perf_counter,
    phase: str = "memory and time",
) -> Run:
    """One forward and backward of a fresh batch of ``size``, cut into segments.

    Timed from the batch in hand: making it is the data pipeline's work (the same samples per step
    whatever the split, and usually overlapped by a DataLoader), and the Accumulator is made once
    per window, not per micro-batch. Counting them here charged every micro-batch about 0.5 ms
    more than a window spends on it (gpt-mini on CPU: 64 micro-batches of 1 over-predicted ~6 %).
    """
    model = workload.model
    doing = f"mb.plan profiled a micro-batch of {size} samples ({phase})"
    with noted_user_call(workload.name, f"make_batch({size})", doing):
        batch = workload.make_batch(size)
    accumulator = Accumulator(model, optimizer, steps=2)
    cuda = device.type == "cuda"  # record the allocations to replay them (profile/reserved.py)
    tracker = (
        MemoryTracker(device, model=model, optimizer=optimizer, record_allocations=cuda) if track else None
    )
    recorder = Recorder(blocks, tracker=tracker, device=device, clock=clock)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = clock()
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            recorder.mark(BEFORE)
            batch = move_batch(batch, device)
            with noted_user_call(workload.name, "loss(model, batch) (the forward)", doing):
                loss, items = workload.loss(model, batch)
            recorder.mark(END_FORWARD)
            recorder.in_backward = True
            with noted_user_call(workload.name, "the backward of loss(model, batch)", doing):
                accumulator.backward(loss, items=items)
            recorder.mark(END)
            del loss, batch
    finally:
        recorder.close()
    order = recorder.order
    missing = [name for name, _ in blocks if name not in order]
    if missing:
        raise WorkloadError(
            f"profiling: block(s) {', '.join(missing[:3])} did not run in the forward of workload "
            f"{workload.name!r}; pass blocks= naming modules the forward calls"
        )
    return reserved.with_reserved_peak(split(recorder, order, started), tracker)


def _one_window(workload: Workload, accumulator: Accumulator, size: int, device: torch.device) -> None:
    """The backward of one micro-batch of ``size``: the gradients a step then works on."""
    doing = f"mb.plan measured the optimizer step after a micro-batch of {size} samples"
    with noted_user_call(workload.name, f"make_batch({size}) or loss(model, batch)", doing):
        loss, items = workload.loss(workload.model, move_batch(workload.make_batch(size), device))
        accumulator.backward(loss, items=items)
    del loss


def train_window(
    workload: Workload,
    accumulator: Accumulator,
    micro_batches: Iterable[Any],
    *,
    count: Callable[[Any], Any] = lambda items: items,
    doing_what: str = "mb.plan ran its trial window",
) -> None:
    """One window of the workload through ``accumulator``: backward per micro-batch, step at its end.

    Each micro-batch's loss is dropped before the next forward, as in a training loop. ``count``
    maps the loss's item count (the simulation replaces a fake tensor's, which has no value).
    """
    model = workload.model
    for micro in accumulator.iterate(micro_batches):
        doing = f"{doing_what} (micro-batch {micro.index + 1} of the window)"
        with noted_user_call(workload.name, "loss(model, batch) or its backward", doing):
            loss, items = workload.loss(model, micro.batch)
            accumulator.backward(loss, items=count(items))
        del loss
        if micro.is_last:
            accumulator.step()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    workload: Workload,
    optimizer: torch.optim.Optimizer,
    size: int,
    device: torch.device,
    *,
    clock: Callable[[], float] = time.perf_counter,
    max_grad_norm: float | None = None,
) -> tuple[dict[str, int], int, float] | None:
    """Static bytes by category, the step's transient bytes and its seconds: Accumulator.step().

    A first window creates the optimizer's state; the next one's step is tracked, then
    STEP_REPEATS more are timed; a last backward leaves every gradient allocated for the runs
    that follow. None when the first training step runs out of memory.
    """
    model = workload.model
    accumulator = Accumulator(model, optimizer, steps=1, max_grad_norm=max_grad_norm)  # clipped as the plan's

    def first_steps() -> bool:
        _one_window(workload, accumulator, size, device)
        accumulator.step()  # creates the optimizer's state
        _one_window(workload, accumulator, size, device)
        return True

    if attempt(first_steps, device) is None:
        return None
    cuda = device.type == "cuda"
    with MemoryTracker(device, model=model, optimizer=optimizer, record_allocations=cuda) as tracker:
        start_bytes = tracker.current_bytes
        static = dict(tracker.breakdown)  # at entry: what the model and the optimizer hold
        accumulator.step()
    step_peak_bytes = reserved.step_peak_bytes(tracker, start_bytes)
    timings = []
    for _ in range(STEP_REPEATS):
        _one_window(workload, accumulator, size, device)
        _synchronize(device)
        began = clock()
        accumulator.step()
        _synchronize(device)
        timings.append(clock() - began)
    # The micro-batch runs that follow hold every gradient, as a window's later micro-batches do.
    _one_window(workload, accumulator, size, device)
    return static, step_peak_bytes, statistics.median(timings)
