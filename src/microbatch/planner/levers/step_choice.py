"""The optimizer step's implementation as a plan choice: foreach, fused or per-tensor, one update.

torch.optim's Adam, AdamW, SGD, Adagrad, ... compute the same update three ways
(torch/optim/adamw.py: ``_single_tensor_adamw``, ``_multi_tensor_adamw``, ``_fused_adamw``); they
differ in what the step allocates beside the state:

- **foreach** (CUDA's default): each intermediate is made for every parameter at once
  (``torch._foreach_sqrt(exp_avg_sqs)`` is the size of all parameters): for AdamW about the size of
  the parameters in float32, 4.62 GiB for Llama 3.2 1B.
- **per-tensor** (the CPU's default, ``foreach=False``): the same intermediates one parameter at a time.
- **fused** (``fused=True``; CUDA, and the CPU since torch 2.4): one kernel per group of tensors,
  no intermediates at all.

The update is the same up to the dtype's rounding (tests/test_step_choice.py). The planner keeps the
optimizer's own implementation unless no plan fits with it; then it measures the others (on the
simulated device's path too: profile/device_path.py) and takes the one whose step peaks lowest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ...memory import format_bytes
from ...memory.device_specs import DeviceSpec
from ...profile import Profile, preserved_state
from ...profile.runs import measure_step
from ...profile.simulate import _training_mode, simulation, static_costs
from ...workload import Workload
from ..options import PlanOptions
from ..outcome import Setup
from ..result.applying import set_step_, supported_steps


def default_step(optimizer: torch.optim.Optimizer, device_type: str) -> str | None:
    """What ``optimizer`` runs as built: its flags, or torch's default for the device (foreach on CUDA)."""
    if not supported_steps(optimizer):
        return None
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "per-tensor"
    return "foreach" if device_type == "cuda" and not group.get("differentiable") else "per-tensor"


def step_workload(workload: Workload, implementation: str) -> Workload:
    """``workload`` whose optimizers step with ``implementation`` (the trial runs what the plan will)."""
    make: Callable[[], torch.optim.Optimizer] = workload.make_optimizer

    def factory(_: torch.nn.Module) -> torch.optim.Optimizer:
        return set_step_(make(), implementation)

    return dataclasses.replace(workload, optimizer=factory)


def measured_step(
    workload: Workload, spec: DeviceSpec | None, implementation: str, *, max_grad_norm: float | None
) -> tuple[int, float] | None:
    """(the step's peak bytes above the static ones, its seconds) with ``implementation``: simulated on
    ``spec``'s path, or measured on the workload's device (the model restored exactly); None when the
    step ran out of memory (that implementation cannot be the leaner one)."""
    model = workload.model
    if spec is not None:
        with _training_mode(model), simulation(model, spec) as (_, clock):
            optimizer = set_step_(workload.make_optimizer(), implementation)
            _, peak_bytes, seconds = static_costs(model, optimizer, clock, cuda=spec.kind == "cuda")
        return peak_bytes, seconds
    with preserved_state(model):
        model.train()
        model.zero_grad(set_to_none=True)
        optimizer = set_step_(workload.make_optimizer(), implementation)
        measured = measure_step(workload, optimizer, 1, workload.device, max_grad_norm=max_grad_norm)
        model.zero_grad(set_to_none=True)
    if measured is None:
        return None
    return measured[1], measured[2]


def with_step(profile: Profile, implementation: str, peak_bytes: int, seconds: float) -> Profile:
    """``profile`` whose optimizer step is ``implementation``'s."""
    name = f"optimizer step temporaries ({implementation})"
    return dataclasses.replace(profile, step_peak_bytes=peak_bytes, step_seconds=seconds, step_peak_name=name)


def lower_step(setup: Setup, options: PlanOptions) -> Setup | None:
    """``setup`` with the step implementation whose peak is least, when below the current one's; else None.

    Sharded plans keep their step (their per-rank step is the shard's: target/per_rank.py).
    """
    if options.shard != "none" and options.world_size > 1:
        return None
    optimizer = setup.workload.make_optimizer()
    device_type = setup.spec.kind if setup.spec is not None else setup.workload.device.type
    current = setup.optimizer_step or default_step(optimizer, device_type)
    if current is None:
        return None
    best: tuple[str, int, float] | None = None
    for name in supported_steps(optimizer):
        if name == current:
            continue
        found = measured_step(setup.workload, setup.spec, name, max_grad_norm=options.max_grad_norm)
        if found is None:
            continue
        peak_bytes, seconds = found
        if peak_bytes < setup.profile.step_peak_bytes and (best is None or peak_bytes < best[1]):
            best = (name, peak_bytes, seconds)
    if best is None:
        return None
    name, peak_bytes, seconds = best
    note = (
        f"optimizer step: {name} instead of {current} (the same update): its temporaries "
        f"{format_bytes(peak_bytes)} instead of {format_bytes(setup.profile.step_peak_bytes)}"
    )
    return dataclasses.replace(
        setup,
        workload=step_workload(setup.workload, name),
        profile=with_step(setup.profile, name, peak_bytes, seconds),
        optimizer_step=name,
        notes=[*setup.notes, note],
    )
