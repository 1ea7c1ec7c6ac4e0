"""The planner's trial: one optimizer step of a candidate plan on the real model, its peak measured;
and whole windows of it timed, for the race between tied plans (race.py).

The window is cut to its first two micro-batches (trial_sizes; planning.py's docstring says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ...accumulate.accumulator import Accumulator
from ...checkpointing.api import checkpoint
from ...memory import MemoryTracker
from ...memory.oom import attempt, free_memory
from ...profile import NONE, preserved_state
from ...profile.runs import train_window
from ...profile.stash import optimizer_instance
from ...profile.user_calls import noted_user_call
from ...trees.batches import move_batch
from ...workload import Workload
from ..options import PlanOptions
from ..result.applying import inner_model
from ..search.sizes import Candidate


@dataclass(frozen=True)
class TrialResult:
    # On CUDA the caching allocator's peak reserved bytes (what an OOM is decided on); elsewhere
    # MemoryTracker's peak live tensor bytes. Memory outside the allocator is added by the caller.
    peak_bytes: int
    cuda_max_allocated_bytes: int | None
    cuda_max_reserved_bytes: int | None = None


def attempt_trial(workload: Workload, candidate: Candidate, options: PlanOptions) -> TrialResult | None:
    """``run_trial`` with the plan's options; None when it ran out of memory (memory freed)."""
    return attempt(
        lambda: run_trial(
            workload,
            candidate,
            accumulate_dtype=options.accumulate_dtype,
            scaler=options.scaler,
            max_grad_norm=options.max_grad_norm,
        ),
        workload.device,
    )


def run_trial(
    workload: Workload,
    candidate: Candidate,
    *,
    accumulate_dtype: torch.dtype | None = None,
    scaler: bool = False,
    max_grad_norm: float | None = None,
    sync_every_micro_batch: bool = False,
) -> TrialResult:
    """One optimizer step of ``candidate`` on the workload's model, under MemoryTracker, with the
    Accumulator options the plan is made for (``accumulate_dtype``, a GradScaler when ``scaler``,
    ``max_grad_norm``; FSDP2's sync every micro-batch). ``workload.model`` may be a DDP / FSDP2 /
    compiled wrapper, as for ``plan.apply``: the blocks are checkpointed in the module inside it.

    May raise an out-of-memory error; the model is restored either way.
    """
    options = _WindowOptions(accumulate_dtype, scaler, max_grad_norm, sync_every_micro_batch)
    with _applied(workload, candidate) as (model, optimizer):
        batches = _batches(workload, candidate, trial_sizes(candidate.micro_batch_sizes))
        with MemoryTracker(workload.device, model=model, optimizer=optimizer) as tracker:
            _window(workload, candidate, optimizer, batches, options)
    measured = tracker.peak_bytes
    if tracker.cuda_max_reserved_bytes is not None:
        measured = max(measured, tracker.cuda_max_reserved_bytes)
    return TrialResult(measured, tracker.cuda_max_allocated_bytes, tracker.cuda_max_reserved_bytes)


@dataclass(frozen=True)
class TimedWindows:
    seconds: list[float]  # each window's, on the clock
    peak_bytes: int | None  # the first window's peak (MemoryTracker, as run_trial's), when tracked


def time_windows(
    workload: Workload,
    candidate: Candidate,
    clock: Callable[[], float],
    *,
    windows: int,
    track_first: bool = False,
    accumulate_dtype: torch.dtype | None = None,
    scaler: bool = False,
    max_grad_norm: float | None = None,
) -> TimedWindows:
    """``windows`` whole windows of ``candidate`` (every micro-batch, one optimizer step each), each
    timed on ``clock`` (making its batches is not timed). With ``track_first`` the first window
    runs under MemoryTracker (its time then counts the tracker's too: take it as a warm-up), the
    others never. The model is restored afterwards."""
    options = _WindowOptions(accumulate_dtype, scaler, max_grad_norm, False)
    seconds, peak = [], None
    with _applied(workload, candidate) as (model, optimizer):
        for index in range(windows):
            batches = _batches(workload, candidate, candidate.micro_batch_sizes)
            if index == 0 and track_first:
                with MemoryTracker(workload.device, model=model, optimizer=optimizer) as tracker:
                    seconds.append(_window(workload, candidate, optimizer, batches, options, clock))
                peak = max(tracker.peak_bytes, tracker.cuda_max_reserved_bytes or 0)
            else:
                seconds.append(_window(workload, candidate, optimizer, batches, options, clock))
    return TimedWindows(seconds, peak)


@dataclass(frozen=True)
class _WindowOptions:
    accumulate_dtype: torch.dtype | None
    scaler: bool
    max_grad_norm: float | None
    sync_every_micro_batch: bool


@contextlib.contextmanager
def _applied(
    workload: Workload, candidate: Candidate
) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """The model in training mode with ``candidate``'s checkpointing and a fresh optimizer whose
    state exists; everything restored on leaving (gradients cleared)."""
    model = workload.model
    # Segments cached by earlier runs would count as reserved: start from what is alive.
    free_memory(workload.device)
    with preserved_state(model, optimizer=optimizer_instance(workload)):
        model.train()
        optimizer = workload.make_optimizer()
        _create_optimizer_state(model, optimizer)
        policies = dict(candidate.block_policies)
        recomputes = any(p != NONE for p in policies.values())
        handle = checkpoint(inner_model(model), policy=policies) if recomputes else None
        try:
            yield model, optimizer
        finally:
            if handle is not None:
                handle.remove()
            for parameter in model.parameters():
                parameter.grad = None


def _what(candidate: Candidate) -> str:
    return f"mb.plan tried micro-batch {candidate.micro_batch_size} x {candidate.steps} in a window"


def _batches(workload: Workload, candidate: Candidate, sizes: Sequence[int]) -> list[object]:
    """The window's micro-batches, made before anything is measured (what make_batch loads, a
    corpus it slices from, is not the window's)."""
    with noted_user_call(workload.name, f"make_batch of {list(sizes)}", _what(candidate)):
        return [workload.make_batch(size) for size in sizes]


def _window(
    workload: Workload,
    candidate: Candidate,
    optimizer: torch.optim.Optimizer,
    batches: list[object],
    options: _WindowOptions,
    clock: Callable[[], float] | None = None,
) -> float:
    """One window of ``batches`` and its optimizer step; its seconds on ``clock`` (0 without one)."""
    device, what = workload.device, _what(candidate)

    def loader() -> Iterator[object]:
        # Each micro-batch reaches the device when its turn comes and is dropped after it.
        while batches:
            yield move_batch(batches.pop(0), device)

    grad_scaler = torch.amp.GradScaler(device.type) if options.scaler else None
    accumulator = Accumulator(
        workload.model,
        optimizer,
        steps=len(batches),
        accumulate_dtype=options.accumulate_dtype,
        scaler=grad_scaler,
        max_grad_norm=options.max_grad_norm,
        sync_every_micro_batch=options.sync_every_micro_batch,
    )
    accumulator._warned_batchnorm = True  # the trial's windows; the plan's note covers BatchNorm
    if clock is None:
        train_window(workload, accumulator, loader(), doing_what=what)
        return 0.0
    _synchronize(device)
    start = clock()
    train_window(workload, accumulator, loader(), doing_what=what)
    _synchronize(device)
    return clock() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trial_sizes(micro_batch_sizes: Sequence[int]) -> list[int]:
    """The window cut to the micro-batches that reach its peak: the first two.

    [b, b] for N >= 3 (the second holds all gradients at full size), [b, r] for N = 2, [b] for N = 1.
    """
    return list(micro_batch_sizes[:2])


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients: the optimizer's state exists from the window's start, as in training."""
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for parameter in model.parameters():
        parameter.grad = None
