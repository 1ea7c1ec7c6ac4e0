"""The search of ``plan(..., pipeline=S)``: schedule, micro-batches per step, stage cuts, a policy per block.

One replica takes B_r = B / R samples per optimizer step (R = W / S data-parallel replicas), cut into
N micro-batches of b (the last one padded up to b, as the Pipeline pads it) and run m at a time
through the schedule: ceil(N / m) pipeline steps per window. For every b (windows.candidate_sizes),
every m (N, and N halved until 1; 1F1B only with m >= S, as torch requires) and both schedules,
the stages are cut where the profile's seconds balance (stage_model.balanced_block_cuts) and each
stage gets the fastest policy per block whose peak fits the budget (stage_model.solve_stage).
Step time:

    seconds = p (m + S - 1) max_s (t_s + 2 send(b)) + max_s (step_s + replicas_s)

the slowest stage's micro-batch time (forward, backward, recompute, and the activation and gradient
it sends and receives, interconnect latency + bytes / bandwidth) in each of the m + S - 1 slots of a
pipeline step (m micro-batches plus the S - 1 of filling and draining: the bubble), then the
optimizer step, the gradient sum over the replicas of the slowest stage, and the window's few small
collectives (WINDOW_COLLECTIVES). Ties (predicted times
within 2 x the profile's noise, 5-8 %: search.tie_for_noise) go to less recompute, then 1F1B, then
the larger micro-batch and m.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...memory.device_specs import DeviceSpec
from ...profile import Profile
from ...profile.roofline import all_gather_seconds, all_reduce_seconds
from ..search.sizes import SAFETY_MARGIN, tie_for_noise
from ..search.splits import WindowSizes, candidate_sizes
from .stage_cost import (
    StageChoice,
    StageParameters,
    balanced_block_cuts,
    in_flight,
    least_stage,
    solve_stage,
    stage_parameters,
    stage_segments,
)

SCHEDULES = ("1f1b", "gpipe")
# The Pipeline's collectives per window besides the gradients (distributed/pipeline.py): the items
# over replicas, the loss checks, the tied weights' sum, the gradient norm.
WINDOW_COLLECTIVES = 4
# torch.distributed.pipelining.stage (2.13): an FSDP2 stage's backwards run with
# set_reshard_after_backward(False) and set_requires_gradient_sync(False); the step's last action
# reduce-scatters and reshards. So within a pipeline step a stage's parameters and gradients are whole.
FSDP_UNSHARDED = "FSDP2 stage parameters, unsharded through the pipeline step"


@dataclass(frozen=True)
class PipelineContext:
    """What every candidate is priced with: the profile, the layout, the budget, the link."""

    profile: Profile
    model: nn.Module
    num_stages: int
    replicas: int
    capacity_bytes: int  # per rank, for what the profile measures (the budget less the reserve)
    spec: DeviceSpec
    bytes_per_sample: int = 0
    output_bytes_per_sample: int = 0  # the model's output (logits) per sample: held on the last stage
    shard: str = "none"  # "fsdp": each stage sharded over its R replicas
    policies: Sequence[str] | None = None
    schedules: Sequence[str] = SCHEDULES
    corrections: tuple[int, ...] = ()  # per stage: bytes a trial measured above the prediction
    # The link: measured on the ranks (distributed/link.py) when planned there; else the spec's
    # bandwidth and a nominal latency.
    latency_seconds: float = 50e-6  # one point-to-point message's fixed cost
    link_bytes_per_second: float | None = None
    collective_seconds: float = 50e-6  # one small all-reduce

    @property
    def bandwidth(self) -> float:
        return self.link_bytes_per_second or self.spec.interconnect_bytes_per_second

    def correction(self, stage: int) -> int:
        return self.corrections[stage] if stage < len(self.corrections) else 0


@dataclass(frozen=True)
class PipelineCandidate:
    """One priced choice: the split, the schedule, the cuts and a policy per block of every stage."""

    schedule: str
    sizes: WindowSizes
    micro_batches: int  # m per pipeline step
    cuts: tuple[int, ...]
    choices: tuple[StageChoice, ...]
    stage_parts: tuple[tuple[tuple[str, int], ...], ...]  # per stage: its peak by part
    seconds_per_step: float
    time_parts: tuple[tuple[str, float], ...]

    @property
    def stage_peaks(self) -> tuple[int, ...]:
        return tuple(sum(value for _, value in parts) for parts in self.stage_parts)

    @property
    def peak_bytes(self) -> int:
        return max(self.stage_peaks)

    @property
    def pipeline_steps(self) -> int:
        return -(-len(self.sizes) // self.micro_batches)

    @property
    def bubble_fraction(self) -> float:
        stages = len(self.cuts) + 1
        return (stages - 1) / (self.micro_batches + stages - 1)

    @property
    def block_policies(self) -> tuple[tuple[str, str], ...]:
        return tuple(pair for choice in self.choices for pair in choice.policies)

    @property
    def extra_seconds(self) -> float:
        return sum(choice.extra_seconds for choice in self.choices)


@dataclass(frozen=True)
class PipelineSearch:
    best: PipelineCandidate | None
    frontier: tuple[PipelineCandidate, ...]  # Pareto-optimal in (worst stage peak, seconds), fastest first
    minimum: PipelineCandidate  # the least worst-stage peak of any candidate


def micro_batch_counts(total: int) -> list[int]:
    """m per pipeline step for a window of ``total`` micro-batches: all of them, then halved down to 1."""
    counts, m = [], total
    while m >= 1:
        counts.append(m)
        m = m // 2 if m > 1 else 0
    return sorted(set(counts), reverse=True)


def _static_parts(
    ctx: PipelineContext,
    params: StageParameters,
    stage: int,
    size: int,
    m: int,
    cuts: Sequence[int],
    steps: int,
) -> tuple[list[tuple[str, int]], int]:
    """A stage's bytes besides its activations (see stage_model) and its gradients' bytes."""
    profile, shards = ctx.profile, ctx.replicas if ctx.shard == "fsdp" else 1
    share = params.trainable_bytes / max(1, profile.gradient_bytes)
    blocks = profile.blocks
    incoming = blocks[cuts[stage - 1] - 1].boundary_bytes(size) if stage > 0 else 0
    outgoing = blocks[cuts[stage] - 1].boundary_bytes(size) if stage < len(cuts) else 0
    parts = [
        ("parameters", math.ceil(params.parameter_bytes / shards)),
        (f"{profile.optimizer_name} state", math.ceil(profile.optimizer_bytes * share / shards)),
        (f"receive buffers ({m} in, {m} back)", math.ceil(m * (incoming + outgoing))),
        ("the window's inputs", ctx.bytes_per_sample * size * (steps + m)),
        ("slack", profile.slack_bytes),
    ]
    if shards > 1:  # torch's stage keeps an FSDP2 stage unsharded from its first backward to the step's end
        unsharded = params.parameter_bytes
        if profile.gather_itemsize:  # MixedPrecisionPolicy (--precision mixed): gathered from fp32 in bf16
            unsharded = math.ceil(unsharded * profile.gather_itemsize / torch.float32.itemsize)
        parts.append((FSDP_UNSHARDED, unsharded))
    if ctx.correction(stage):
        parts.append(("trial correction", ctx.correction(stage)))
    return parts, params.trainable_bytes  # gradients unsharded through the pipeline step (torch syncs last)


def _held(schedule: str, stage: int, stages: int, m: int, pipeline_steps: int) -> tuple[int, int | None]:
    """Micro-batches held besides the one in backward: at the first backward, and at a later one."""
    k = in_flight(schedule, stages, m)[stage]
    if pipeline_steps > 1 or (schedule == "1f1b" and m > k):
        return k - 1, k - 1
    return k - 1, (k - 2 if m >= 2 else None)


def price(
    ctx: PipelineContext, schedule: str, sizes: WindowSizes, m: int, *, least: bool = False
) -> PipelineCandidate | None:
    """The candidate of (schedule, sizes, m), or None when a stage cannot fit; ``least``: the lowest
    peak per stage instead of the fastest choice that fits."""
    profile, stages, size = ctx.profile, ctx.num_stages, sizes.size
    cuts = tuple(balanced_block_cuts(profile, stages, size))
    names = [segment.name for segment in profile.blocks]
    params = stage_parameters(ctx.model, names, cuts)
    steps = -(-len(sizes) // m)
    choices, all_parts = [], []
    for stage, indices in enumerate(stage_segments(profile, cuts)):
        segments = [profile.segments[i] for i in indices]
        fixed, gradients = _static_parts(ctx, params[stage], stage, size, m, cuts, len(sizes))
        held_first, held_steady = _held(schedule, stage, stages, m, steps)
        last = stage == stages - 1
        common: dict[str, Any] = {
            "output_bytes": ctx.output_bytes_per_sample * size if last else 0,
            "size": size,
            "gradient_bytes": gradients,
            "held_first": held_first,
            "held_steady": held_steady,
        }
        fixed_bytes = sum(value for _, value in fixed)
        room = (ctx.capacity_bytes - fixed_bytes) / (1 + SAFETY_MARGIN)
        if least:
            choice: StageChoice | None = least_stage(segments, policies=ctx.policies, **common)
        else:
            choice = solve_stage(segments, capacity_bytes=room, policies=ctx.policies, **common)
        if choice is None:
            return None
        activations = choice.activation_peak(held_first, held_steady)
        # The stage's share of the step's temporaries; under FSDP2 those of its local shards (/ R).
        step = math.ceil(
            profile.step_peak_bytes
            * params[stage].trainable_bytes
            / max(1, profile.gradient_bytes)
            / (ctx.replicas if ctx.shard == "fsdp" else 1)
        )
        parts = [
            *fixed,
            (f"activations ({held_first + 1} in flight) and gradients", activations),
            (f"safety margin ({SAFETY_MARGIN:.0%})", math.ceil(SAFETY_MARGIN * activations)),
        ]
        step_moment = fixed_bytes + gradients + step
        if step_moment > sum(value for _, value in parts):  # the optimizer step peaks higher
            parts.append(("optimizer step", step_moment - sum(value for _, value in parts)))
        if not least and sum(value for _, value in parts) > ctx.capacity_bytes:
            return None
        choices.append(choice)
        all_parts.append(tuple(parts))
    seconds, time_parts = step_seconds(ctx, schedule, choices, params, cuts, size, m, steps)
    return PipelineCandidate(schedule, sizes, m, cuts, tuple(choices), tuple(all_parts), seconds, time_parts)


def step_seconds(
    ctx: PipelineContext,
    schedule: str,
    choices: Sequence[StageChoice],
    params: Sequence[StageParameters],
    cuts: Sequence[int],
    size: int,
    m: int,
    pipeline_steps: int,
) -> tuple[float, tuple[tuple[str, float], ...]]:
    """The module docstring's step time, and its parts."""
    profile, spec, stages = ctx.profile, ctx.spec, ctx.num_stages
    boundary = max((profile.blocks[cut - 1].boundary_bytes(size) for cut in cuts), default=0.0)
    send = ctx.latency_seconds + boundary / ctx.bandwidth
    slowest = max(choice.seconds for choice in choices) + profile.loop_seconds(size)
    shards = ctx.replicas if ctx.shard == "fsdp" else 1
    slots = pipeline_steps * (m + stages - 1)
    shares = [p.trainable_bytes / max(1, profile.gradient_bytes) for p in params]
    optimizer = profile.step_seconds * max(shares) / shards
    gather = 0.0
    if shards > 1:
        # FSDP2 inside a stage (FSDP_UNSHARDED): gathered for each forward before the first backward,
        # then held; the gradients reduce-scattered once per pipeline step.
        first = max(in_flight(schedule, stages, m))
        gather = pipeline_steps * max(
            (first + 1) * all_gather_seconds(p.parameter_bytes, shards, spec) for p in params
        )
        replicas = pipeline_steps * max(all_gather_seconds(p.trainable_bytes, shards, spec) for p in params)
    else:
        replicas = max(all_reduce_seconds(p.trainable_bytes, ctx.replicas, spec) for p in params)
    parts = (
        (f"{slots} slots x slowest stage's micro-batch", slots * slowest),
        (f"{slots} slots x activation and gradient sends", slots * 2 * send if stages > 1 else 0.0),
        ("FSDP2 all-gathers", gather),
        ("optimizer step", optimizer),
        ("gradients summed over replicas", replicas),
        (f"{WINDOW_COLLECTIVES} small collectives", WINDOW_COLLECTIVES * ctx.collective_seconds),
    )
    return sum(value for _, value in parts), parts


def search_pipeline(ctx: PipelineContext, per_replica_batch: int, noise: float = 0.0) -> PipelineSearch:
    """Every (b, m, schedule) priced; the fastest fitting one (ties as the module docstring says)."""
    fitting: list[PipelineCandidate] = []
    for size in candidate_sizes(per_replica_batch):
        sizes = WindowSizes(per_replica_batch, size)
        for m in micro_batch_counts(len(sizes)):
            for schedule in ctx.schedules:
                if schedule == "1f1b" and m < ctx.num_stages:  # torch's Schedule1F1B refuses it
                    continue
                candidate = price(ctx, schedule, sizes, m)
                if candidate is not None:
                    fitting.append(candidate)
    smallest = WindowSizes(per_replica_batch, 1)
    # The least memory: micro-batches of 1, one in flight per stage (GPipe with m = 1; 1F1B needs m >= S).
    minimum = price(ctx, "gpipe", smallest, 1, least=True)
    if minimum is None:  # least=True prices whatever the budget
        raise RuntimeError("internal error: the least pipeline layout was not priced")
    if not fitting:
        return PipelineSearch(None, (), minimum)
    fastest = min(c.seconds_per_step for c in fitting)
    tie = tie_for_noise(noise)
    ties = [c for c in fitting if c.seconds_per_step <= fastest * (1 + tie)]
    best = min(
        ties,
        key=lambda c: (
            round(c.extra_seconds / max(fastest, 1e-12), 3),
            c.schedule != "1f1b",
            -c.sizes.size,
            -c.micro_batches,
            c.peak_bytes,
        ),
    )
    return PipelineSearch(best, _frontier(fitting), minimum)


def _frontier(candidates: Sequence[PipelineCandidate]) -> tuple[PipelineCandidate, ...]:
    front: list[PipelineCandidate] = []
    for candidate in sorted(candidates, key=lambda c: (c.seconds_per_step, c.peak_bytes)):
        if not front or candidate.peak_bytes < front[-1].peak_bytes:
            front.append(candidate)
    return tuple(front)
