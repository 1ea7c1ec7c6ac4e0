"""``plan(device=..., simulate=...)``: which device a plan is for, and what a simulated plan reports.

``device`` is a torch device (the model moves there and is profiled for real, as without it) or a
DeviceSpec / preset name (a device that need not be here: the profile is simulated under fake
tensors and no trial runs). ``simulate=True`` on a present device predicts without running a
kernel, from a spec measured on it (``DeviceSpec.measure``). The string "cpu" is this machine's
CPU (real) unless ``simulate=True``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

from ...errors import ConfigError
from ...memory import format_bytes, parse_bytes
from ...memory.device_specs import DeviceSpec, check_preset_budget, device_spec, devices
from ...profile.costs import Profile
from ...profile.simulate import simulate_profile
from ...workload import Workload
from ..result.plans import Plan
from . import per_rank

logger = logging.getLogger(__name__)
_FRACTION = re.compile(r"^\s*(0?\.[0-9]+|1\.0*|1)\s*$")


def resolve_target(workload: Workload, device: Any, simulate: bool) -> DeviceSpec | None:
    """The spec to simulate on, or None to profile for real (after moving the model to ``device``)."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str) and device.strip().lower() in devices() and device.strip().lower() != "cpu":
        return device_spec(device)
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ConfigError(
                f"device={device!r} is neither a torch device nor a preset ({', '.join(devices())})"
            ) from error
        if simulate and target.type == "cpu":
            return devices()["cpu"]
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r}: CUDA is not available here; to plan for a GPU that is not here, "
                f"pass a preset ({', '.join(devices())}) or a mb.DeviceSpec"
            )
        workload.model.to(target)
    if not simulate:
        return None
    present = workload.device
    if present.type == "meta":
        raise ConfigError(
            "simulate=True on a model on the meta device needs device= (a preset or DeviceSpec)"
        )
    logger.info("measuring %s for the simulation", present)
    return DeviceSpec.measure(present, size=512)


def profile_for(
    workload: Workload, *, spec: DeviceSpec | None, real: Callable[..., Profile], **options: Any
) -> Profile:
    """The simulated profile on ``spec``, or without a spec ``real(workload, **options)``."""
    if spec is not None:
        return simulate_profile(workload, spec, **options)
    return real(workload, **options)


def target_budget(memory: str | int | float, spec: DeviceSpec | None, workload: Workload | None) -> int:
    """``memory`` in bytes; a fraction (0.8, "0.8") is of the spec's memory when simulating.

    A budget above the spec's memory is refused (check_preset_budget). ``workload`` (its device
    for a fraction of free memory) is needed only without a spec.
    """
    if spec is not None:
        fraction = None
        if isinstance(memory, float) and not isinstance(memory, bool) and 0 < memory <= 1:
            fraction = memory
        elif isinstance(memory, str) and _FRACTION.match(memory):
            fraction = float(memory)
        if fraction is not None:
            return int(fraction * spec.memory_bytes)
        budget_bytes = parse_bytes(memory, name="memory")
        check_preset_budget(budget_bytes, spec)
        return budget_bytes
    return parse_bytes(memory, device=workload.device if workload is not None else None, name="memory")


def _precision(workload: Workload) -> str:
    for parameter in workload.model.parameters():
        if parameter.is_floating_point():
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(parameter.dtype, "fp32")
    return "fp32"


def estimates(workload: Workload, profile: Profile, micro_batch_size: int) -> tuple[tuple[str, int], ...]:
    """The figures people use instead, for the chosen micro-batch, beside microbatch's own."""
    model = workload.model
    activations = per_rank.layer_activation_bytes(profile, micro_batch_size)
    result = [
        ("microbatch: parameters + gradients + optimizer state", profile.static_bytes),
        ("microbatch: layer activations, no checkpointing", activations),
        (
            "accelerate estimate-memory: training using Adam",
            per_rank.accelerate_estimate(model, _precision(workload)),
        ),
    ]
    try:
        with torch.random.fork_rng(devices=[]):
            seq_len = per_rank.sequence_length(workload.make_batch(1))
    except Exception:  # a batch that cannot be made here: no formula
        seq_len = None
    if seq_len is not None:
        formula = per_rank.korthikanti_bytes(model, seq_len=seq_len, micro_batch_size=micro_batch_size)
        if formula is not None:
            result.append(("Korthikanti sbh(34 + 5as/h), all layers", formula))
    return tuple(result)


def finish(
    plan: Plan,
    *,
    workload: Workload,
    profile: Profile,
    spec: DeviceSpec | None,
    shard: str,
    extras: tuple[tuple[str, int], ...],
) -> Plan:
    """The plan with what a simulated or sharded plan reports: device, per-rank parts, estimates.

    A plan profiled for real on one rank comes back as it was.
    """
    if spec is None and shard == "none":
        return plan
    context = spec.context_bytes if spec is not None else 0
    notes = list(plan.notes)
    if spec is not None:
        notes.append(
            f"simulated for {spec.name} under fake tensors (no kernel ran, no trial): peak in "
            f"{profile.peak_kind} from MemoryTracker's counting, time from a roofline at achieved rates "
            f"({spec.rates_summary}; {spec.source})"
        )
    breakdown = per_rank.rank_breakdown(plan.peak_parts, extras, context if spec is not None else 0)
    logger.info("plan peak per rank %s", format_bytes(plan.predicted_peak_bytes))
    return dataclasses.replace(
        plan,
        notes=tuple(notes),
        simulated=spec is not None,
        device=spec.kind if spec is not None else plan.device,
        device_name=spec.name if spec is not None else profile.device,
        shard=shard,
        rank_parts=breakdown,
        estimates=estimates(workload, profile, plan.micro_batch_size),
    )
