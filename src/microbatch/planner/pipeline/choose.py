"""``plan(..., pipeline=S)`` in one process: profile, search (layouts.py), the Plan.

The profile is the ordinary one (measured here, or simulated for a device preset): per block and
policy, kept and peak bytes and seconds. Each stage is priced from its blocks' segments
(stage_cost.py), so a pipeline of identical decoder layers needs no tracer, on fake tensors or real
ones. The plan says what the search chose: schedule, micro-batches per pipeline step, the blocks
where stages begin, a policy per block, each stage's predicted peak, the bubble. Beside it, the
plan without a pipeline on the same ranks (data parallel, sharded as asked) is priced from the same
profile, and a note says whether the pipeline is worth its bubble.

A trial needs the ranks: trial.plan runs it when the process group holds the pipeline's ranks
(on_ranks.py); in one process the plan is predicted only, as a note says.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...checkpointing.compiled import eager_workload
from ...distributed.link import LinkTimes
from ...errors import ConfigError, InfeasibleBudgetError
from ...memory import format_bytes
from ...memory.device_specs import DeviceSpec, devices
from ...profile import Profile, profile_workload
from ...profile.simulate import fake_batch, simulation
from ...trees.batches import tensor_bytes
from ...workload import Workload, load_workload
from ..options import DEFAULT_MAX_PROFILE_SIZE, PlanOptions
from ..outcome import PlanRequest
from ..refusals import check_make_batch, validate_batch
from ..result.plans import FrontierPoint, Plan
from ..search.rules import SplitRules, profile_with_rules
from ..target.per_rank import interconnect_spec
from ..target.reserve import BudgetReserve, outside_the_model
from ..target.simulated import profile_for, resolve_target, target_budget
from .layouts import PipelineCandidate, PipelineContext, PipelineSearch, search_pipeline

# compare(request, profile) -> the plan without a pipeline on the same ranks, or why there is none
Compare = Callable[[PlanRequest, Profile], "Plan | str"]


@dataclass
class PipelineSetup:
    """What the pipeline search starts from (a pipeline's Setup)."""

    workload: Workload
    profile: Profile
    spec: DeviceSpec | None  # the simulated target; None for the real device
    reserve: BudgetReserve
    budget_bytes: int
    per_replica_batch: int
    bytes_per_sample: int
    context: PipelineContext
    notes: list[str]


def ranks_of(request: PlanRequest) -> tuple[int, int]:
    """(every rank, data-parallel replicas): world_size 1 means one replica of S ranks."""
    stages = request.options.pipeline
    world = request.options.world_size if request.options.world_size > 1 else stages
    return world, world // stages


def prepare(
    request: PlanRequest, corrections: tuple[int, ...] = (), link: LinkTimes | None = None
) -> PipelineSetup:
    """Check the request, profile (or take the profile), and build the search's context; ``link``:
    measured on the ranks (used for a device that is here)."""
    options = request.options
    workload = load_workload(request.workload) if isinstance(request.workload, str) else request.workload
    workload, notes = eager_workload(workload)
    notes = list(notes)
    _, replicas = ranks_of(request)
    per_replica_batch = validate_batch(request.batch, replicas)
    spec = resolve_target(workload, options.device, options.simulate)
    if options.shard == "fsdp" and spec is None:
        raise ConfigError(
            "shard='fsdp' with pipeline > 1 is simulated only: microbatch's Pipeline sums each stage's "
            "gradients over its replicas itself and refuses an FSDP2-wrapped stage; plan for a device "
            "preset (device='h100-80gb') to predict DP x PP x FSDP, or use shard='none' here"
        )
    _refuse_window_options(options)
    budget_bytes = target_budget(request.memory, spec, workload)
    reserve = outside_the_model(workload, budget_bytes, memory=request.memory, world_size=1)
    bytes_per_sample = check_make_batch(workload, per_replica_batch)
    profile = options.profile or _profile(request, workload, spec, per_replica_batch)
    interconnect = spec if spec is not None else interconnect_spec(workload.device)[0]
    context = PipelineContext(
        profile=profile,
        model=workload.model,
        num_stages=options.pipeline,
        replicas=replicas,
        capacity_bytes=budget_bytes - reserve.total_bytes,
        spec=interconnect,
        bytes_per_sample=bytes_per_sample,
        output_bytes_per_sample=output_bytes_per_sample(workload, spec),
        shard=options.shard,
        policies=options.policies,
        schedules=(options.pipeline_schedule,) if options.pipeline_schedule else ("1f1b", "gpipe"),
        corrections=corrections,
    )
    if link is not None and spec is None:
        context = dataclasses.replace(
            context,
            latency_seconds=link.latency_seconds,
            link_bytes_per_second=link.bytes_per_second,
            collective_seconds=link.collective_seconds,
        )
        notes.append(
            f"link measured on the ranks: {1e6 * link.latency_seconds:.0f} us + "
            f"{link.bytes_per_second / 1e9:.2g} GB/s per message, {1e6 * link.collective_seconds:.0f} us per "
            "small all-reduce"
        )
    notes += [*profile.notes, *reserve.notes]
    return PipelineSetup(
        workload, profile, spec, reserve, budget_bytes, per_replica_batch, bytes_per_sample, context, notes
    )


def _refuse_window_options(options: PlanOptions) -> None:
    """The Pipeline runs its own window (no Accumulator): options it would not honour are refused."""
    given = [
        name
        for name, value in (
            ("accumulate_dtype", options.accumulate_dtype),
            ("scaler", options.scaler),
            ("gradient_sync", options.gradient_sync),
        )
        if value
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} with pipeline={options.pipeline}: the Pipeline sums its stages' gradients "
            "in the parameters' dtype with no GradScaler and no FSDP sync choice; leave them out, or plan "
            "without pipeline="
        )


def output_bytes_per_sample(workload: Workload, spec: DeviceSpec | None) -> int:
    """Bytes of the model's output for one sample (a token LM's logits), from one forward of one sample
    under fake tensors (nothing allocated): torch's schedule keeps the last stage's latest output alive
    past its backward, one more output on the last stage than the profile's chain holds."""
    captured: list[int] = []

    def capture(module: nn.Module, inputs: object, output: object) -> None:
        if not captured:
            captured.append(tensor_bytes(output))

    hook = workload.model.register_forward_hook(capture)
    try:
        with torch.no_grad(), simulation(workload.model, spec or devices()["cpu"]) as (mode, _):
            workload.loss(workload.model, fake_batch(workload, 1, mode))
    finally:
        hook.remove()
    return captured[0] if captured else 0


def measured_profile(request: PlanRequest) -> Profile:
    """The profile ``prepare`` would measure for ``request`` (the eager workload, the per-replica batch)."""
    workload = load_workload(request.workload) if isinstance(request.workload, str) else request.workload
    workload, _ = eager_workload(workload)
    _, replicas = ranks_of(request)
    spec = resolve_target(workload, request.options.device, request.options.simulate)
    return _profile(request, workload, spec, validate_batch(request.batch, replicas))


def _profile(request: PlanRequest, workload: Workload, spec: DeviceSpec | None, rows: int) -> Profile:
    """The profile; on a CPU with one torch thread (each rank of a gloo launch) on the CPU clock,
    which other jobs on the machine do not slow down (profile/clocks.py)."""
    options = request.options
    kinds: dict[str, Any] = {"blocks": options.blocks, "policies": options.policies}
    kinds["progress"] = options.progress
    if spec is None and workload.device.type == "cpu" and torch.get_num_threads() == 1:
        kinds["clock"] = "cpu"
    largest = options.max_profile_micro_batch_size or DEFAULT_MAX_PROFILE_SIZE
    profile_fn = functools.partial(profile_for, spec=spec, real=profile_workload)
    return profile_with_rules(profile_fn, workload, SplitRules(), rows, largest, **kinds)


def search(setup: PipelineSetup) -> PipelineSearch:
    """The search; InfeasibleBudgetError naming the least peak when no stage layout fits."""
    result = search_pipeline(setup.context, setup.per_replica_batch, setup.profile.time_noise)
    if result.best is None:
        least = result.minimum.peak_bytes + setup.reserve.total_bytes
        stages = setup.context.num_stages
        raise InfeasibleBudgetError(
            f"memory={format_bytes(setup.budget_bytes)} per rank: no pipeline of {stages} stages fits; the "
            f"least any stage layout needs is {format_bytes(least)} (micro-batches of 1, one in flight, "
            "the blocks checkpointed); raise memory, or use more stages",
            minimum_bytes=least,
        )
    return result


def plan_of(
    setup: PipelineSetup,
    request: PlanRequest,
    result: PipelineSearch,
    *,
    began: float,
    compare: Compare | None = None,
) -> Plan:
    """The Plan of the search's choice (no trial yet), with the comparison without a pipeline."""
    chosen = result.best
    if chosen is None:  # search() raises when nothing fits: reaching here is a bug of ours
        raise RuntimeError("internal error: the pipeline search returned no plan and raised nothing")
    reserve = setup.reserve.total_bytes
    names = [segment.name for segment in setup.profile.blocks]
    worst = max(range(len(chosen.stage_peaks)), key=lambda s: chosen.stage_peaks[s])
    notes = [*setup.notes, _time_note(chosen)]
    if compare is not None:
        notes.append(_comparison_note(chosen, compare(request, setup.profile), request))
    _, replicas = ranks_of(request)
    return Plan(
        workload=setup.workload.name,
        batch_size=request.batch,
        world_size=replicas,
        micro_batch_size=chosen.sizes.size,
        steps=len(chosen.sizes),
        micro_batch_sizes=tuple(chosen.sizes),
        block_policies=chosen.block_policies,
        budget_bytes=setup.budget_bytes,
        predicted_peak_bytes=chosen.peak_bytes + reserve,
        measured_peak_bytes=None,
        predicted_seconds_per_step=chosen.seconds_per_step,
        peak_parts=chosen.stage_parts[worst] + setup.reserve.parts,
        frontier=tuple(_point(c, reserve) for c in result.frontier),
        minimum_bytes=result.minimum.peak_bytes + reserve,
        planning_seconds=time.perf_counter() - began,
        notes=tuple(notes),
        parameters=sum(parameter.numel() for parameter in setup.workload.model.parameters()),
        device=setup.spec.kind if setup.spec is not None else setup.workload.device.type,
        simulated=setup.spec is not None,
        device_name=setup.spec.name if setup.spec is not None else setup.profile.device,
        shard=request.options.shard,
        rank_parts=chosen.stage_parts[worst],
        pipeline_stages=request.options.pipeline,
        pipeline_schedule=chosen.schedule,
        pipeline_micro_batches=chosen.micro_batches,
        stage_starts=tuple(names[cut] for cut in chosen.cuts),
        stage_peak_bytes=tuple(peak + reserve for peak in chosen.stage_peaks),
        bubble_fraction=chosen.bubble_fraction,
        max_grad_norm=request.options.max_grad_norm,  # Pipeline.backward clips on the global norm
    )


def _point(candidate: PipelineCandidate, reserve_bytes: int) -> FrontierPoint:
    return FrontierPoint(
        micro_batch_size=candidate.sizes.size,
        steps=len(candidate.sizes),
        block_policies=candidate.block_policies,
        predicted_peak_bytes=candidate.peak_bytes + reserve_bytes,
        seconds_per_step=candidate.seconds_per_step,
    )


def _time_note(chosen: PipelineCandidate) -> str:
    parts = ", ".join(f"{name} {value:.3g} s" for name, value in chosen.time_parts if value)
    return f"pipeline step time = {parts}"


def _comparison_note(chosen: PipelineCandidate, flat: Plan | str, request: PlanRequest) -> str:
    """Whether the pipeline is worth its bubble: the plan without it on the same ranks."""
    world, _ = ranks_of(request)
    shard = request.options.shard
    how = f"{world} ranks, shard {shard}" if shard != "none" else f"{world} data-parallel ranks"
    bubble = f"bubble {chosen.bubble_fraction:.0%}"
    if isinstance(flat, str):
        return f"without a pipeline ({how}): {flat} ({bubble})"
    ratio = (
        chosen.seconds_per_step / flat.predicted_seconds_per_step if flat.predicted_seconds_per_step else 0.0
    )
    verdict = "worth its bubble" if ratio < 1 else "not worth its bubble"
    return (
        f"without a pipeline ({how}): micro-batch {flat.micro_batch_size} x {flat.steps}, "
        f"{flat.predicted_seconds_per_step:.3g} s per step, peak {format_bytes(flat.predicted_peak_bytes)}; "
        f"the pipeline takes {ratio:.2f}x that time ({bubble}): {verdict}"
    )


def with_trial(plan: Plan, measured: tuple[int, ...], trials: int, note: str) -> Plan:
    """The plan with its trial's per-stage peaks (each stage's worst rank)."""
    return dataclasses.replace(
        plan,
        measured_stage_peak_bytes=measured,
        measured_peak_bytes=max(measured),
        trials=trials,
        notes=(*plan.notes, note),
    )
