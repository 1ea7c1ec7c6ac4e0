"""Prove a plan made elsewhere (a saved plan, a manual one) on this model: one real trial window."""

from __future__ import annotations

import dataclasses
import logging

from ..errors import InfeasibleBudgetError
from ..memory import format_bytes
from ..memory.oom import attempt
from ..workload import Workload
from .plans import Plan
from .reserve import outside_the_model
from .search import Candidate
from .trial import run_trial

logger = logging.getLogger(__name__)


def prove(plan: Plan, workload: Workload) -> Plan:
    """The plan with ``measured_peak_bytes`` from one real window of it on ``workload``'s model.

    Raises InfeasibleBudgetError when the window runs out of memory, or when its measured peak
    exceeds the plan's budget (a budget of 0, as in a manual plan, is not checked). The model is
    restored afterwards, as after any planner trial.
    """
    plan.check_model(workload.model, device=workload.device)
    candidate = Candidate(
        micro_batch_sizes=plan.micro_batch_sizes,
        block_policies=plan.block_policies,
        peak_bytes=plan.predicted_peak_bytes,
        seconds_per_step=plan.predicted_seconds_per_step,
    )
    what = f"micro-batch {plan.micro_batch_size} x {plan.steps}"
    # The plan's peaks count what lives outside the model (CUDA context, DDP buckets) as mb.plan does.
    reserve_bytes = (
        outside_the_model(
            workload, plan.budget_bytes, memory=plan.budget_bytes, world_size=plan.world_size
        ).total_bytes
        if plan.budget_bytes
        else 0
    )
    result = attempt(lambda: run_trial(workload, candidate), workload.device)
    if result is None:
        raise InfeasibleBudgetError(
            f"the plan ({what}) ran out of memory in its trial window on this device; make a new plan "
            "for this device (microbatch plan ... --out plan.json)",
            minimum_bytes=plan.budget_bytes,
            parts={},
        )
    peak_bytes = result.peak_bytes + reserve_bytes
    if plan.budget_bytes and peak_bytes > plan.budget_bytes:
        raise InfeasibleBudgetError(
            f"the plan ({what}) measured a peak of {format_bytes(peak_bytes)} in its trial window, "
            f"over its budget {format_bytes(plan.budget_bytes)}; make a new plan for this model and device",
            minimum_bytes=peak_bytes,
            parts={},
        )
    logger.info("plan proved: %s measured %s", what, format_bytes(peak_bytes))
    return dataclasses.replace(
        plan,
        measured_peak_bytes=peak_bytes,
        cuda_max_allocated_bytes=result.cuda_max_allocated_bytes,
        trials=plan.trials + 1,
    )
