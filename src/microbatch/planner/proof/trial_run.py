"""The planner's trial: one optimizer step of a candidate plan on the real model, its peak measured.

The window is cut to its first two micro-batches (trial_sizes; planning.py's docstring says why).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ...accumulate.accumulator import Accumulator
from ...checkpointing.api import checkpoint
from ...memory import MemoryTracker
from ...memory.oom import free_memory
from ...profile import NONE, preserved_state
from ...profile.runs import train_window
from ...profile.stash import optimizer_instance
from ...profile.user_calls import noted_user_call
from ...trees.batches import move_batch
from ...workload import Workload
from ..result.applying import inner_model
from ..search.sizes import Candidate


@dataclass(frozen=True)
class TrialResult:
    # On CUDA the caching allocator's peak reserved bytes (what an OOM is decided on); elsewhere
    # MemoryTracker's peak live tensor bytes. Memory outside the allocator is added by the caller.
    peak_bytes: int
    cuda_max_allocated_bytes: int | None
    cuda_max_reserved_bytes: int | None = None


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
    model, device = workload.model, workload.device
    # Segments cached by earlier runs would count as reserved: start from what is alive.
    free_memory(device)
    with preserved_state(model, optimizer=optimizer_instance(workload)):
        model.train()
        optimizer = workload.make_optimizer()
        _create_optimizer_state(model, optimizer)
        policies = dict(candidate.block_policies)
        recomputes = any(p != NONE for p in policies.values())
        handle = checkpoint(inner_model(model), policy=policies) if recomputes else None
        try:
            what = f"mb.plan tried micro-batch {candidate.micro_batch_size} x {candidate.steps} in a window"
            sizes = trial_sizes(candidate.micro_batch_sizes)
            with noted_user_call(workload.name, f"make_batch of {sizes}", what):
                batches = [workload.make_batch(size) for size in sizes]

            def loader() -> Iterator[object]:
                # Each micro-batch reaches the device when its turn comes and is dropped after it.
                while batches:
                    yield move_batch(batches.pop(0), device)

            grad_scaler = torch.amp.GradScaler(device.type) if scaler else None
            accumulator = Accumulator(
                model,
                optimizer,
                steps=len(batches),
                accumulate_dtype=accumulate_dtype,
                scaler=grad_scaler,
                max_grad_norm=max_grad_norm,
                sync_every_micro_batch=sync_every_micro_batch,
            )
            accumulator._warned_batchnorm = True  # the trial's cut window; the plan's note covers BatchNorm
            with MemoryTracker(device, model=model, optimizer=optimizer) as tracker:
                train_window(workload, accumulator, loader(), doing_what=what)
        finally:
            if handle is not None:
                handle.remove()
            for parameter in model.parameters():
                parameter.grad = None
    measured = tracker.peak_bytes
    if tracker.cuda_max_reserved_bytes is not None:
        measured = max(measured, tracker.cuda_max_reserved_bytes)
    return TrialResult(measured, tracker.cuda_max_allocated_bytes, tracker.cuda_max_reserved_bytes)


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
