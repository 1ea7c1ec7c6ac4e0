"""What plan() is asked (PlanRequest), what the search starts from (Setup), and the Plan made of the
chosen candidate: its peaks stated like the budget, with the reserve outside the model added."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..memory.device_specs import DeviceSpec
from ..profile import Profile
from ..workload import Workload
from .options import PlanOptions
from .proof.trial_data import TrialData
from .proof.trial_run import TrialResult
from .result.applying import dtype_name
from .result.plans import FrontierPoint, Plan, summarize_policies
from .result.token_budget import token_budget
from .search.rules import SplitRules, batchnorm_note
from .search.sizes import Candidate, SearchResult
from .target.reserve import BudgetReserve
from .target.simulated import finish

logger = logging.getLogger("microbatch.planner.planning")  # plan()'s log, documented under this name


@dataclass(frozen=True)
class PlanRequest:
    """plan()'s arguments: what to plan, for which batch and budget, and how (PlanOptions)."""

    workload: Workload | str
    batch: int
    memory: str | int | float
    options: PlanOptions


@dataclass
class Setup:
    """What the search starts from: the eager workload, its (per-rank) profile, the budget."""

    workload: Workload
    profile: Profile
    extras: tuple[tuple[str, int], ...]  # per-rank memory the sharding adds (ranks.shard_profile)
    spec: DeviceSpec | None  # the simulated target; None for the real device
    rules: SplitRules
    reserve: BudgetReserve
    budget_bytes: int
    per_rank_batch: int
    bytes_per_sample: int
    notes: list[str]
    gradient_sync: str = "window"  # FSDP2's sync mode, chosen with the per-rank profile (sharding.py)
    trial_data: TrialData = field(default_factory=TrialData)  # what the profile and trials drew
    # The exact levers chosen (planner/levers/): the optimizer step's implementation when it is not
    # the optimizer's own, and the loss head's tokens per chunk.
    optimizer_step: str | None = None
    head_chunk_tokens: int | None = None

    @property
    def model_budget_bytes(self) -> int:
        """What the profiled model may use: the budget less what lives outside it (see BudgetReserve)."""
        return self.budget_bytes - self.reserve.total_bytes


def plan_of(
    setup: Setup,
    request: PlanRequest,
    chosen: Candidate,
    result: SearchResult,
    *,
    measured: TrialResult | None,
    trials: int,
    began: float,
) -> Plan:
    """The Plan of ``chosen``, its peaks stated like the budget (the reserve outside the model added)."""
    workload, reserve = setup.workload, setup.reserve
    notes = [*setup.notes, *(note for note in (batchnorm_note(workload.model, chosen, setup.rules),) if note)]
    logger.info(
        "planning %s: chose micro-batch %d x %d steps with %s in %.1f s",
        workload.name,
        chosen.micro_batch_size,
        chosen.steps,
        summarize_policies(chosen.block_policies),
        time.perf_counter() - began,
    )
    planned = Plan(
        workload=workload.name,
        batch_size=setup.per_rank_batch * request.options.world_size,
        world_size=request.options.world_size,
        micro_batch_size=chosen.micro_batch_size,
        steps=chosen.steps,
        micro_batch_sizes=tuple(chosen.micro_batch_sizes),
        block_policies=chosen.block_policies,
        budget_bytes=setup.budget_bytes,
        predicted_peak_bytes=chosen.peak_bytes + reserve.total_bytes,
        measured_peak_bytes=measured.peak_bytes + reserve.total_bytes if measured is not None else None,
        predicted_seconds_per_step=chosen.seconds_per_step,
        peak_parts=chosen.parts + reserve.parts,
        frontier=frontier_of(result, reserve.total_bytes),
        minimum_bytes=result.minimum.peak_bytes + reserve.total_bytes,
        cuda_max_allocated_bytes=measured.cuda_max_allocated_bytes if measured is not None else None,
        trials=trials,
        planning_seconds=time.perf_counter() - began,
        notes=tuple(notes),
        max_tokens=token_budget(workload, chosen.micro_batch_size),
        parameters=sum(parameter.numel() for parameter in workload.model.parameters()),
        device=workload.device.type,
        accumulate_dtype=dtype_name(request.options.accumulate_dtype),
        scaler=request.options.scaler,
        max_grad_norm=request.options.max_grad_norm,
        gradient_sync=setup.gradient_sync,
        optimizer_step=setup.optimizer_step,
        head_chunk_tokens=setup.head_chunk_tokens,
    )
    spec, shard = setup.spec, request.options.shard
    return finish(
        planned, workload=workload, profile=setup.profile, spec=spec, shard=shard, extras=setup.extras
    )


def frontier_of(result: SearchResult, reserve_bytes: int = 0) -> tuple[FrontierPoint, ...]:
    """The search's frontier, its peaks stated like the budget (the reserve outside the model added)."""
    return tuple(
        FrontierPoint(
            micro_batch_size=c.micro_batch_size,
            steps=c.steps,
            block_policies=c.block_policies,
            predicted_peak_bytes=c.peak_bytes + reserve_bytes,
            seconds_per_step=c.seconds_per_step,
        )
        for c in result.frontier
    )
