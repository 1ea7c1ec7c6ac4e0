"""Prove a plan made elsewhere (a saved plan, a manual one, a sharded one) on this model: one real
trial window, on every rank when the plan is for several.

A plan for W ranks (``mb.plan(..., world_size=W, shard="fsdp")``) cannot be tried in the one process
that made it: its per-rank memory is predicted. Under torchrun, each of the W ranks calls
``microbatch.planner.prove(plan, workload)`` with ``workload.model`` wrapped as it will train
(FSDP2's fully_shard, DDP): every rank runs the trial window with the plan's options (its gradient
sync, accumulate_dtype, scaler, max_grad_norm), the ranks' peaks are gathered, and the plan is
proved only when every rank's peak is within the budget; otherwise every rank raises the same
error, naming the ranks.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ... import distributed
from ...errors import ConfigError, InfeasibleBudgetError
from ...memory import format_bytes
from ...memory.oom import attempt
from ...workload import Workload
from ..result.plans import Plan
from ..search.sizes import Candidate
from ..target.reserve import outside_the_model
from .trial_run import TrialResult, run_trial

logger = logging.getLogger(__name__)


def prove(plan: Plan, workload: Workload) -> Plan:
    """The plan with ``measured_peak_bytes`` from one real window of it on ``workload``'s model.

    On W > 1 ranks (a process group of the plan's world size) every rank runs the window and the
    measured peak is the largest rank's. Raises InfeasibleBudgetError when the window runs out of
    memory, or when a measured peak exceeds the plan's budget (a budget of 0, as in a manual plan,
    is not checked). The model is restored afterwards, as after any planner trial.
    """
    plan.check_model(workload.model, device=workload.device)
    ranks = distributed.world_size()
    if ranks > 1 and ranks != plan.world_size:
        raise ConfigError(
            f"prove: the plan is for world_size={plan.world_size}, this process group has {ranks} ranks; "
            f"launch {plan.world_size} ranks, or make the plan with world_size={ranks}"
        )
    what = f"micro-batch {plan.micro_batch_size} x {plan.steps}"
    peaks, cuda_max_allocated_bytes = _rank_peaks(plan, workload, ranks)
    if any(peak is None for peak in peaks):
        failed = ", ".join(str(rank) for rank, peak in enumerate(peaks) if peak is None)
        where = f" on rank(s) {failed}" if ranks > 1 else " on this device"
        raise InfeasibleBudgetError(
            f"the plan ({what}) ran out of memory in its trial window{where}; make a new plan "
            "for this device (microbatch plan ... --out plan.json)",
            minimum_bytes=plan.budget_bytes,
            parts={},
        )
    measured = [int(peak) for peak in peaks if peak is not None]
    peak_bytes = max(measured)
    if plan.budget_bytes and peak_bytes > plan.budget_bytes:
        over = ", ".join(
            f"rank {rank} {format_bytes(peak)}"
            for rank, peak in enumerate(measured)
            if peak > plan.budget_bytes
        )
        raise InfeasibleBudgetError(
            f"the plan ({what}) measured a peak over its budget {format_bytes(plan.budget_bytes)} in its "
            f"trial window ({over}); make a new plan for this model and device",
            minimum_bytes=peak_bytes,
            parts={},
        )
    notes = plan.notes
    if ranks > 1:
        each = ", ".join(format_bytes(peak) for peak in measured)
        notes = (*notes, f"proved on {ranks} ranks, each within the budget: trial peaks {each}")
    logger.info("plan proved: %s measured %s", what, format_bytes(peak_bytes))
    return dataclasses.replace(
        plan,
        measured_peak_bytes=peak_bytes,
        cuda_max_allocated_bytes=cuda_max_allocated_bytes,
        trials=plan.trials + 1,
        notes=notes,
    )


def _rank_peaks(plan: Plan, workload: Workload, ranks: int) -> tuple[list[float | None], int | None]:
    """Every rank's trial peak (with what lives outside the model), None where it ran out of memory;
    and this rank's CUDA allocated peak."""
    candidate = Candidate(
        micro_batch_sizes=plan.micro_batch_sizes,
        block_policies=plan.block_policies,
        peak_bytes=plan.predicted_peak_bytes,
        seconds_per_step=plan.predicted_seconds_per_step,
    )
    # The plan's peaks count what lives outside the model (CUDA context, DDP buckets) as mb.plan
    # does; FSDP2's buffers are tensors the trial's tracker sees.
    reserve_bytes = (
        outside_the_model(
            workload,
            plan.budget_bytes,
            memory=plan.budget_bytes,
            world_size=1 if plan.shard == "fsdp" else plan.world_size,
        ).total_bytes
        if plan.budget_bytes
        else 0
    )
    accumulate_dtype = getattr(torch, plan.accumulate_dtype) if plan.accumulate_dtype else None
    every = plan.shard == "fsdp" and plan.gradient_sync == "micro-batch"

    def trial() -> TrialResult:
        return run_trial(
            workload,
            candidate,
            accumulate_dtype=accumulate_dtype,
            scaler=plan.scaler,
            max_grad_norm=plan.max_grad_norm,
            sync_every_micro_batch=every,
        )

    result = attempt(trial, workload.device)
    local = -1.0 if result is None else float(result.peak_bytes + reserve_bytes)
    # Each rank's peak in its own slot, summed: every rank learns every rank's (one all_reduce).
    slots = [0.0] * ranks
    slots[distributed.rank() if ranks > 1 else 0] = local
    gathered = distributed.all_reduce_values(slots, op="sum")
    allocated = result.cuda_max_allocated_bytes if result is not None else None
    return [None if value < 0 else value for value in gathered], allocated
