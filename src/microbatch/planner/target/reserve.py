"""What the budget must hold besides the profiled model: the definition of a budget on each device.

On the CPU a budget is peak live tensor bytes, and the only thing outside the profiled (unwrapped)
model is DDP's gradient buckets when more than one rank runs.

On CUDA a budget is the caching allocator's peak *reserved* bytes (its segments, with their
rounding and fragmentation: see microbatch.memory.allocator) plus what the allocator does not see: the
CUDA context, the cuBLAS/cuDNN handles and anything else already on the device (NCCL's buffers
once a collective ran, other processes), measured once when planning starts as
(total - free) - reserved. The trial measures reserved bytes; the search predicts them (the
profiled runs' allocations replayed through the allocator model: profile/reserved.py); both work
with the budget less this reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...memory import format_bytes, fraction_base_bytes
from ...memory.allocator import (
    check_cuda_budget,
    ddp_bucket_bytes,
    expandable_segments_enabled,
    outside_allocator_bytes,
)
from ...workload import Workload

OUTSIDE_ALLOCATOR = "outside the caching allocator (CUDA context, workspaces, other users)"
DDP_BUCKETS = "DDP gradient buckets"


@dataclass(frozen=True)
class BudgetReserve:
    """Bytes of the budget that the profiled model cannot use, by part, and what the plan says of them."""

    parts: tuple[tuple[str, int], ...]
    notes: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(value for _, value in self.parts)


def _is_fraction(memory: object) -> bool:
    if isinstance(memory, float):
        return 0 < memory <= 1
    if isinstance(memory, str):
        try:
            value = float(memory.strip())
        except ValueError:
            return False
        return 0 < value <= 1 and "." in memory
    return False


def outside_the_model(
    workload: Workload,
    budget_bytes: int,
    *,
    memory: object,
    world_size: int,
    gradient_as_bucket_view: bool = False,
) -> BudgetReserve:
    """The reserve for ``workload`` on its device; refuses a CUDA budget the device cannot hold.

    Raises ConfigError for a budget above the device's total memory and InfeasibleBudgetError for
    one not above what is already outside the allocator, each naming both numbers.
    """
    device = workload.device
    parts: list[tuple[str, int]] = []
    notes: list[str] = []
    if device.type == "cuda":
        outside = outside_allocator_bytes(device)
        total = int(torch.cuda.get_device_properties(device).total_memory)
        check_cuda_budget(budget_bytes, total_bytes=total, outside_bytes=outside)
        parts.append((OUTSIDE_ALLOCATOR, outside))
        notes.append(
            f"budget on {device}: peak reserved bytes of the caching allocator"
            f"{' (expandable segments)' if expandable_segments_enabled() else ''} + "
            f"{format_bytes(outside)} measured outside it"
        )
        if _is_fraction(memory):
            notes.append(
                f"memory={memory} is of the {format_bytes(fraction_base_bytes(device))} free on "
                f"{device} at plan time (this process's cached memory included), not of its "
                f"{format_bytes(total)} total"
            )
    buckets = ddp_bucket_bytes(
        workload.model, world_size=world_size, gradient_as_bucket_view=gradient_as_bucket_view
    )
    if buckets:
        parts.append((DDP_BUCKETS, buckets))
        notes.append(
            f"{world_size} ranks: DDP's gradient buckets, {format_bytes(buckets)}, are a second copy of the "
            "gradients (none with gradient_as_bucket_view=True)"
        )
    return BudgetReserve(parts=tuple(parts), notes=tuple(notes))
