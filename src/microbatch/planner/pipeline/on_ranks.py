"""A pipeline plan proved on its ranks: every rank runs its own stage of one trial window.

Under torchrun with the pipeline's W ranks, every rank calls ``mb.plan(..., pipeline=S)``. The ranks
measure their link (distributed/link.py: a point-to-point message's latency and bandwidth, a small
all-reduce's time) and profile at once (each beside the others' load, as in training), then rank 0
searches on its own profile (choose.py) and sends the plan to every rank; each rank builds
the plan's Pipeline from its own copy of the model (the same on every rank), creates its stage's
optimizer state, and runs one window (two pipeline steps at most: from the
second one on every backward starts from the same live memory) and the optimizer step under a
MemoryTracker. The ranks' peaks are gathered; each stage's is its worst replica's. Then, as for
every plan (planning.py):

- every stage within the budget: done; the plan holds predicted and measured peaks per stage;
- a stage over it: that stage's predictions get the difference added (a correction per stage) and
  rank 0 searches again; after ``max_trials`` rounds, InfeasibleBudgetError.

In one process, or for a simulated device, the plan is predicted only (a note says so).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import distributed
from ...distributed.link import LinkTimes, measure_link
from ...errors import InfeasibleBudgetError, WorkloadError
from ...memory import MemoryTracker, format_bytes
from ...workload import Workload, load_workload
from ..outcome import PlanRequest
from ..result.plans import Plan
from . import choose


def plan_pipeline(request: PlanRequest, compare: choose.Compare | None) -> Plan:
    """``plan(..., pipeline=S)``: on the ranks with trials when they are there, else predicted only."""
    began = time.perf_counter()
    world, _ = choose.ranks_of(request)
    on_ranks = distributed.is_initialized() and distributed.world_size() == world
    corrections: tuple[int, ...] = ()
    link = measure_link(_workload(request).device) if on_ranks and world > 1 else None
    if on_ranks and world > 1 and request.options.profile is None:
        # Every rank profiles at once (rank 0 keeps its own): timings taken beside busy ranks, as in
        # training. Rank 0 profiling alone on this 2-core machine ran 1.4-1.6x faster per CPU second
        # than the same stages beside a second rank, and the planned step time came out that short.
        with distributed.single_process():
            profile = choose.measured_profile(request)
        request = dataclasses.replace(request, options=dataclasses.replace(request.options, profile=profile))
    for trial in range(1, request.options.max_trials + 1):
        decide = functools.partial(_predicted, request, corrections, began, compare, link)
        plan = (
            distributed.decided_on_rank_zero(decide, what="planning the pipeline") if on_ranks else decide()
        )
        if plan.simulated or not request.options.trial or not on_ranks:
            if request.options.trial and not plan.simulated:
                plan = _noted(plan, "no trial: this process is not one of the pipeline's ranks")
            return plan
        measured = stage_peaks(plan, _workload(request))
        if all(peak <= plan.budget_bytes for peak in measured):
            note = "trial on the ranks: measured peak per stage " + ", ".join(map(format_bytes, measured))
            return choose.with_trial(plan, measured, trial, note)
        corrections = _corrected(corrections, measured, plan)
    raise InfeasibleBudgetError(
        f"memory={format_bytes(plan.budget_bytes)}: after {request.options.max_trials} trials on the ranks "
        f"a pipeline stage still measured {format_bytes(max(measured))}; raise memory, or use more stages",
        minimum_bytes=max(measured),
    )


def _corrected(corrections: tuple[int, ...], measured: tuple[int, ...], plan: Plan) -> tuple[int, ...]:
    """Each stage over the budget has its predictions raised by what the trial measured above them."""
    result = []
    for stage, (seen, guess) in enumerate(zip(measured, plan.stage_peak_bytes, strict=True)):
        current = corrections[stage] if stage < len(corrections) else 0
        result.append(current + max(1, seen - guess) if seen > plan.budget_bytes else current)
    return tuple(result)


def _predicted(
    request: PlanRequest,
    corrections: tuple[int, ...],
    began: float,
    compare: choose.Compare | None,
    link: LinkTimes | None,
) -> Plan:
    with distributed.single_process():
        setup = choose.prepare(request, corrections, link)
        result = choose.search(setup)
        return choose.plan_of(setup, request, result, began=began, compare=compare)


def _noted(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _workload(request: PlanRequest) -> Workload:
    return load_workload(request.workload) if isinstance(request.workload, str) else request.workload


# ---------------------------------------------------------------------- the trial window


def stage_optimizer(workload: Workload, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The workload's optimizer over one stage's parameters (a factory gets them as a ParameterList)."""
    held = nn.ParameterList(parameters)
    if isinstance(workload.optimizer, torch.optim.Optimizer):
        return type(workload.optimizer)(held.parameters(), **workload.optimizer.defaults)
    if callable(workload.optimizer):
        optimizer = workload.optimizer(held)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise WorkloadError(
                f"Workload(optimizer=...) of {workload.name!r} returned no torch.optim.Optimizer"
            )
        return optimizer
    return torch.optim.AdamW(held.parameters(), lr=1e-3)


def pipeline_io(workload: Workload) -> tuple[Callable[[Any], Any], Callable[..., Any]]:
    if workload.pipeline_inputs is None or workload.pipeline_loss is None:
        raise WorkloadError(
            f"workload {workload.name!r} has no pipeline_inputs / pipeline_loss: a pipeline needs the one "
            "tensor its first stage takes and the loss of the last stage's output; set "
            "Workload(pipeline_inputs=lambda batch: (inputs, labels), pipeline_loss=lambda out, labels: "
            "(loss, items))"
        )
    return workload.pipeline_inputs, workload.pipeline_loss


def _trial_batches(plan: Plan, workload: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The trial window's micro-batches, made on rank 0 and sent to every rank (all stages agree)."""
    inputs_of, _ = pipeline_io(workload)
    count = min(plan.steps, 2 * plan.pipeline_micro_batches)
    payload: list[Any] = [None]
    if distributed.rank() == 0:
        payload[0] = [
            tuple(t.cpu() for t in inputs_of(workload.make_batch(size)))
            for size in plan.micro_batch_sizes[:count]
        ]
    if distributed.world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    device = workload.device
    return [(inputs.to(device), labels.to(device)) for inputs, labels in payload[0]]


def stage_peaks(
    plan: Plan, workload: Workload, *, autocast_dtype: torch.dtype | None = None
) -> tuple[int, ...]:
    """Every rank: its stage's peak over one trial window and the optimizer step; each stage's worst
    replica, on every rank (a collective)."""
    _, loss_fn = pipeline_io(workload)
    batches = _trial_batches(plan, workload)
    example = torch.zeros((plan.micro_batch_size, *batches[0][0].shape[1:]), dtype=batches[0][0].dtype)
    pipe = plan.pipeline(
        copy.deepcopy(workload.model),  # torch's tracer cannot trace a model twice
        example=example.to(workload.device),
        loss_fn=loss_fn,
        autocast_dtype=autocast_dtype,
    )
    parameters = pipe.parameters()
    optimizer = stage_optimizer(workload, parameters)
    for parameter in parameters:  # the optimizer's state exists from the first window on
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with MemoryTracker(workload.device, model=nn.ParameterList(parameters), optimizer=optimizer) as tracker:
        pipe.backward(batches)
        pipe.step(optimizer)
    peaks = [0] * distributed.world_size()
    dist.all_gather_object(peaks, int(tracker.peak_bytes))
    stages = plan.pipeline_stages
    return tuple(max(peaks[r] for r in range(s, len(peaks), stages)) for s in range(stages))
