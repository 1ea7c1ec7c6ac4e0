"""The device, the memory budget, and the plan: micro-batch size, accumulation steps, checkpointing."""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..batching import micro_batch_sizes, move_batch
from ..errors import ConfigError, InfeasibleBudgetError
from ..memory import format_bytes, parse_bytes
from ..workload import Workload

logger = logging.getLogger(__name__)

# With no --memory: on CUDA, this fraction of the memory that is free when the run starts. On the CPU
# there is no allocator to ask and the RAM is shared with everything else, so the budget is a fixed,
# small-GPU-like 96 MiB: the default gpt-mini run (batch 64 needs about 160 MiB of peak tensor memory
# in one micro-batch) then plans accumulation, as it would on a small accelerator.
CUDA_FREE_MEMORY_FRACTION = 0.9
DEFAULT_CPU_MEMORY = "96MiB"
# The fixed plan's allowance for temporaries that autograd does not save (attention and MLP
# intermediates, the logits' gradient) on top of the saved activations it measures.
ACTIVATION_SAFETY_FACTOR = 1.5


@dataclass(frozen=True)
class TrainPlan:
    """How a window is run: ``steps`` micro-batches of up to ``micro_batch_size`` sequences per rank."""

    micro_batch_size: int
    steps: int
    checkpoint_policy: str | dict[str, str]
    budget_bytes: int
    predicted_peak_bytes: int
    minimum_bytes: int
    batch: int
    world_size: int
    source: str  # "planner", or "fixed" (the simple rule in fixed_plan)
    details: dict[str, Any] = field(default_factory=dict)

    def micro_batch_sizes(self) -> list[int]:
        return micro_batch_sizes(self.batch // self.world_size, self.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        policy = self.checkpoint_policy
        if isinstance(policy, dict):
            policy = f"{sum(p != 'none' for p in policy.values())} blocks checkpointed"
        return (
            f"batch {self.batch} = {self.steps} micro-batches of <= {self.micro_batch_size} x "
            f"{self.world_size} rank(s); checkpointing: {policy}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.budget_bytes)} "
            f"({self.source} plan)"
        )


# --------------------------------------------------------------------------------------------------
# Device, budget, plan


def resolve_device(name: str | None) -> torch.device:
    """The device to train on: ``name``, else CUDA (this rank's GPU under torchrun), else the CPU."""
    if name is not None:
        try:
            device = torch.device(name)
        except (RuntimeError, MemoryError) as error:
            raise ConfigError(f"device={name!r} is not a torch device: {error}") from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available; leave device unset to use the CPU")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def memory_budget_bytes(memory: str | int | None, device: torch.device) -> int:
    """``memory`` in bytes; without it, 90 % of the free CUDA memory, or DEFAULT_CPU_MEMORY on a CPU."""
    if memory is not None:
        return parse_bytes(memory, device=device, name="--memory")
    if device.type == "cuda":  # of the free memory, this process's cached memory included
        return parse_bytes(float(CUDA_FREE_MEMORY_FRACTION), device=device, name="--memory")
    return parse_bytes(DEFAULT_CPU_MEMORY, name="--memory")


def _saved_activation_bytes(workload: Workload, micro_batch_size: int) -> int:
    """Bytes autograd saves for backward in one forward of ``micro_batch_size`` samples, plus the output."""
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[(storage.data_ptr(), storage.device.index or 0)] = storage.nbytes()
        return tensor

    batch = move_batch(workload.make_batch(micro_batch_size), workload.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = workload.loss(workload.model, batch)
    return sum(seen.values()) + loss.numel() * loss.element_size()


def _checkpointed_bytes(workload: Workload, policy: str, plain_bytes: float) -> float:
    """Per-sample activation bytes with every block checkpointed under ``policy``: what stays saved,
    plus one block's own activations, alive again while it is recomputed in backward."""
    from ..checkpoint import checkpoint as apply_checkpointing

    handle = apply_checkpointing(workload.model, blocks="auto", policy=policy)
    try:
        kept_bytes = _saved_activation_bytes(workload, 2) / 2
        blocks = max(len(handle.policies), 1)
    finally:
        handle.remove()
    return kept_bytes + plain_bytes / blocks


def fixed_plan(
    workload: Workload, *, batch: int, memory_bytes: int, world_size: int, policy: str
) -> TrainPlan:
    """The simple rule used until the planner lands: largest micro-batch whose estimate fits.

    estimate(b) = model states + b * per-sample activations * ACTIVATION_SAFETY_FACTOR, with model
    states = parameters + gradients + two AdamW moments (4 x parameter bytes) and per-sample
    activations measured from the tensors autograd saves at b = 2 (with the block checkpointing in
    place; checkpointed runs add one block's activations, recomputed in backward). Micro-batches
    are then balanced: steps = ceil(B / b_max), b = ceil(B / steps).
    """
    per_rank_batch = batch // world_size
    state_bytes = 4 * sum(p.numel() * p.element_size() for p in workload.model.parameters())
    # "auto" tries no checkpointing first and measures full checkpointing only when that does not fit
    # (the first checkpointed forward imports torch._dynamo, which takes seconds).
    candidates = ["none", "full"] if policy == "auto" else [policy]
    plain_bytes = _saved_activation_bytes(workload, 2) / 2
    fitting: tuple[str, float, int] | None = None
    minimum_bytes = memory_bytes
    for candidate in candidates:
        per_sample_bytes = ACTIVATION_SAFETY_FACTOR * (
            plain_bytes if candidate == "none" else _checkpointed_bytes(workload, candidate, plain_bytes)
        )
        minimum_bytes = int(state_bytes + per_sample_bytes) if fitting is None else minimum_bytes
        if memory_bytes - state_bytes >= per_sample_bytes:
            fitting = (candidate, per_sample_bytes, int((memory_bytes - state_bytes) // per_sample_bytes))
            break
    if fitting is None:
        raise InfeasibleBudgetError(
            f"--memory {format_bytes(memory_bytes)} is below the minimum of {format_bytes(minimum_bytes)} "
            f"for {workload.name} (model states {format_bytes(state_bytes)} + one sequence's activations); "
            f"give --memory {format_bytes(minimum_bytes * 1.1)} or more, or a smaller --model",
            minimum_bytes=minimum_bytes,
            parts={"model_states": state_bytes, "activations_per_sample": minimum_bytes - state_bytes},
        )
    chosen, per_sample_bytes, largest = fitting
    steps = math.ceil(per_rank_batch / min(largest, per_rank_batch))
    micro_batch_size = math.ceil(per_rank_batch / steps)
    return TrainPlan(
        micro_batch_size=micro_batch_size,
        steps=steps,
        checkpoint_policy=chosen,
        budget_bytes=memory_bytes,
        predicted_peak_bytes=int(state_bytes + micro_batch_size * per_sample_bytes),
        minimum_bytes=minimum_bytes,
        batch=batch,
        world_size=world_size,
        source="fixed",
        details={"model_state_bytes": state_bytes, "activation_bytes_per_sample": int(per_sample_bytes)},
    )


def choose_plan(
    workload: Workload, *, batch: int, memory_bytes: int, world_size: int, policy: str, planner: str = "auto"
) -> TrainPlan:
    """The plan for this run: the planner's (microbatch.planner.plan) when it is there, else fixed_plan.

    The planner chooses the checkpoint policy per block itself; an explicit ``policy`` other than
    "auto", or ``planner="fixed"``, keeps the fixed rule (quick: one measured forward, no trial).
    """
    planner_plan: Callable[..., Any] | None = None
    if planner == "auto":
        try:
            from ..planner import plan as planner_plan
        except ImportError:
            planner_plan = None
    if planner_plan is None or policy != "auto":
        return fixed_plan(
            workload, batch=batch, memory_bytes=memory_bytes, world_size=world_size, policy=policy
        )
    # The planner measures a copy, so the model to train keeps its state and its RNG stream.
    probe = replace(workload, model=copy.deepcopy(workload.model))
    try:
        chosen = planner_plan(probe, batch=batch, memory=memory_bytes, world_size=world_size)
    except InfeasibleBudgetError as error:
        raise InfeasibleBudgetError(
            f"--memory {format_bytes(memory_bytes)} is below the minimum of "
            f"{format_bytes(error.minimum_bytes)} for {workload.name}: {error}",
            minimum_bytes=error.minimum_bytes,
            parts=error.parts,
        ) from error
    plan_dict = chosen.to_dict()
    return TrainPlan(
        micro_batch_size=int(chosen.micro_batch_size),
        steps=int(chosen.steps),
        checkpoint_policy=dict(chosen.policies),
        budget_bytes=memory_bytes,
        predicted_peak_bytes=int(plan_dict.get("predicted_peak_bytes", 0)),
        minimum_bytes=int(plan_dict.get("minimum_bytes", 0)),
        batch=batch,
        world_size=world_size,
        source="planner",
        details=plan_dict,
    )


def apply_checkpointing(model: nn.Module, policy: str | dict[str, str]) -> Any:
    if policy == "none" or (isinstance(policy, dict) and all(p == "none" for p in policy.values())):
        return None
    from ..checkpoint import checkpoint as apply_checkpointing

    return apply_checkpointing(model, blocks="auto", policy=policy)
