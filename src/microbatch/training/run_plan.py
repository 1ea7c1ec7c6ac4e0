"""The device, the memory budget, and the run's Plan: from the planner, a manual one, or a file.

Every plan is a ``microbatch.planner.Plan``. ``choose_plan`` runs on rank 0 only
(distributed.decided_on_rank_zero);
the planner profiles the model to train itself and restores it exactly, so the run starts from
the same weights and random state as without planning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .. import distributed
from ..checkpointing.api import find_blocks
from ..errors import ConfigError, InfeasibleBudgetError
from ..memory import format_bytes, parse_bytes
from ..models.corpus import ByteBatches
from ..models.workloads import gpt_inputs, gpt_loss, gpt_output_loss
from ..planner import Plan, plan, prove
from ..trees.batches import move_batch
from ..workload import Workload
from .config import TrainConfig

# progress(what, done, total) while the planner profiles and proves (mb.plan's progress=).
PlanProgress = Callable[[str, int, int], None]

logger = logging.getLogger(__name__)

# With no --memory: on CUDA, this fraction of the memory that is free when the run starts. On the CPU
# there is no allocator to ask and the RAM is shared with everything else, so the budget is a fixed,
# small-GPU-like 96 MiB: the default gpt-mini run (batch 64 needs about 160 MiB of peak tensor memory
# in one micro-batch) then plans accumulation, as it would on a small accelerator.
CUDA_FREE_MEMORY_FRACTION = 0.9
DEFAULT_CPU_MEMORY = "96MiB"


def resolve_device(name: str | None) -> torch.device:
    """The device to train on: ``name``, else CUDA (this rank's GPU under torchrun), else the CPU."""
    if name is not None:
        try:
            device = torch.device(name)
        except (RuntimeError, MemoryError) as error:
            raise ConfigError(f"device={name!r} is not a torch device: {error}") from error
        if device.type == "meta":
            raise ConfigError(
                "--device meta holds no data, so nothing can be trained there; use --device cpu or cuda "
                "(or mb.plan(..., simulate=True) to plan without allocating)"
            )
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


def planning_workload(
    config: TrainConfig, model: nn.Module, documents: tuple[bytes, ...], device: torch.device
) -> Workload:
    """The model to train, with batches from a stream of its own (the training stream stays untouched)."""
    block_size = int(getattr(getattr(model, "config", None), "block_size", 0)) or 1
    planning_data = ByteBatches(documents, block_size=block_size, seed=config.seed + 777)
    return Workload(
        model=model,
        make_batch=lambda b: move_batch(planning_data(b), device),
        loss=gpt_loss,
        name=config.model,
        pipeline_inputs=gpt_inputs,
        pipeline_loss=gpt_output_loss,
    )


def manual_plan(config: TrainConfig, workload: Workload, *, micro_batch: int, memory_bytes: int) -> Plan:
    """``--micro-batch``: Plan.manual, with ``--checkpoint-policy`` on every repeated block."""
    policy = "none" if config.checkpoint_policy == "auto" else config.checkpoint_policy
    policies = {} if policy == "none" else {name: policy for name, _ in find_blocks(workload.model, "auto")}
    return Plan.manual(
        batch_size=config.batch,
        micro_batch_size=micro_batch,
        policies=policies,
        world_size=distributed.world_size(),
        workload=config.model,
        budget_bytes=memory_bytes,
        parameters=sum(p.numel() for p in workload.model.parameters()),
        device=workload.device.type,
    )


def loaded_plan(config: TrainConfig, workload: Workload, path: str) -> Plan:
    """``--plan FILE``: the saved plan, checked against this run and model, proved unless ``--no-trial``."""
    loaded = Plan.load(path)
    world = distributed.world_size()
    if loaded.batch_size != config.batch or loaded.world_size != world:
        raise ConfigError(
            f"--plan {path!r} is for batch {loaded.batch_size} on {loaded.world_size} process(es), this run "
            f"is batch {config.batch} on {world}; pass --batch {loaded.batch_size}, or make a new plan"
        )
    loaded.check_model(workload.model, device=workload.device)
    if not config.trial:
        return loaded
    with distributed.single_process():  # rank 0 alone proves its own unwrapped model, as it plans
        return prove(loaded, workload)


def planned(
    config: TrainConfig, workload: Workload, *, memory_bytes: int, progress: PlanProgress | None = None
) -> Plan:
    """The planner's plan for this run's batch, budget and processes; ``progress`` as mb.plan's.

    The plan is made for what the loop runs: a GradScaler with fp16. On the CPU the loop's window of
    micro-batches (drawn at once, loop._window_batches) lives in the budgeted memory while the trial
    holds one micro-batch: the whole window's inputs are set aside from the budget.
    """
    policies = None if config.checkpoint_policy == "auto" else [config.checkpoint_policy]
    world = distributed.world_size()
    window_bytes = 0
    if workload.device.type == "cpu":
        window_bytes = _batch_bytes(workload.make_batch(1)) * (config.batch // world)
    try:
        made = plan(
            workload,
            batch=config.batch,
            memory=memory_bytes - window_bytes,
            world_size=world,
            policies=policies,
            trial=config.trial,
            progress=progress,
            scaler=config.precision == "fp16",
            max_grad_norm=config.max_grad_norm,
        )
    except InfeasibleBudgetError as error:
        raise InfeasibleBudgetError(
            f"--memory {format_bytes(memory_bytes)} is below the minimum of "
            f"{format_bytes(error.minimum_bytes + window_bytes)} for {workload.name}: {error}",
            minimum_bytes=error.minimum_bytes + window_bytes,
            parts=error.parts,
        ) from error
    if not window_bytes:
        return made
    measured = made.measured_peak_bytes
    return dataclasses.replace(
        made,
        budget_bytes=memory_bytes,
        predicted_peak_bytes=made.predicted_peak_bytes + window_bytes,
        measured_peak_bytes=measured + window_bytes if measured is not None else None,
        peak_parts=(*made.peak_parts, ("a window's inputs, drawn at once", window_bytes)),
    )


def _batch_bytes(batch: Any) -> int:
    """Bytes of the tensors in a batch (any nesting of lists, tuples and dicts)."""
    leaves = pytree.tree_leaves(batch)
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))


def choose_plan(
    config: TrainConfig, workload: Workload, *, memory_bytes: int, progress: PlanProgress | None = None
) -> Plan:
    """The plan for a new run: from ``--plan``, from ``--micro-batch``, or from the planner."""
    if config.plan is not None:
        return loaded_plan(config, workload, config.plan)
    if config.micro_batch is not None:
        return manual_plan(config, workload, micro_batch=config.micro_batch, memory_bytes=memory_bytes)
    return planned(config, workload, memory_bytes=memory_bytes, progress=progress)


def plan_without(config: TrainConfig, workload: Workload, failed: Plan) -> Plan:
    """After a training-time out-of-memory error: a plan that excludes ``failed`` and anything as big.

    A planner's plan: re-plan with the budget lowered to just below the failed plan's peak (the
    larger of predicted and measured), so the planner can choose neither it nor a plan predicted at
    least as large. A manual plan: half the micro-batch size. Same effective batch either way.
    """
    if failed.source == "manual" or failed.predicted_peak_bytes <= 0:
        if failed.micro_batch_size <= 1:
            raise InfeasibleBudgetError(
                "out of memory at micro-batch 1: no smaller split exists; use a smaller --model or "
                "more memory",
                minimum_bytes=failed.budget_bytes,
                parts={},
            )
        smaller = dataclasses.replace(config, checkpoint_policy=_manual_policy(failed))
        return manual_plan(
            smaller, workload, micro_batch=failed.micro_batch_size // 2, memory_bytes=failed.budget_bytes
        )
    peak = max(failed.predicted_peak_bytes, failed.measured_peak_bytes or 0)
    return planned(config, workload, memory_bytes=min(failed.budget_bytes, peak - 1))


def _manual_policy(failed: Plan) -> str:
    used = {policy for _, policy in failed.block_policies}
    return next(iter(used)) if len(used) == 1 else "none"


def plan_for_run(
    config: TrainConfig,
    workload: Workload,
    *,
    saved: Plan | None = None,
    saved_config: TrainConfig | None = None,
    progress: PlanProgress | None = None,
) -> Plan:
    """A new run's plan; a resumed run's saved plan, or a new one when ``--memory`` / ``--plan`` changed.

    Re-planning happens at the checkpoint's window boundary for the same effective batch: the
    windows hold the same samples under any split, so the gradient stays exact.
    """
    if saved is not None and saved_config is not None:
        if (config.memory, config.plan) == (saved_config.memory, saved_config.plan):
            return saved
        logger.info(
            "resuming with --memory %s (was %s): re-planning for the new budget",
            config.memory,
            saved_config.memory,
        )
    memory_bytes = memory_budget_bytes(config.memory, workload.device)
    return choose_plan(config, workload, memory_bytes=memory_bytes, progress=progress)
