"""Per-rank memory and communication under data parallelism, and the formulas people use instead.

A profile describes one rank running the whole model. Data parallelism changes it so:

- ``ddp`` (DistributedDataParallel, ``gradient_as_bucket_view=False``, the default): every rank
  holds everything, plus gradient buckets, a flat copy of all gradients that the all-reduce runs
  on. Time: one all-reduce of the gradients per optimizer step (the Accumulator skips the sync on
  the window's other micro-batches), 2 (W - 1) / W * G / link.
- ``fsdp`` (FSDP2, ``fully_shard`` on each block and on the root): parameters, gradients and
  optimizer state are sharded by W. While a block runs, its parameters are all-gathered, and the
  next block's are prefetched: two blocks' full parameters in flight. The root's own parameters
  (embeddings, final norm, head) stay gathered through forward and backward. A block's backward
  copies its full gradients into a reduce-scatter buffer and keeps its shard of the result. Time:
  per micro-batch, parameters all-gathered in forward and again in backward and gradients
  reduce-scattered, (W - 1) / W * bytes / link each, taken as not overlapped with compute (an
  upper bound; FSDP2 overlaps them). The optimizer steps on each rank's local shards (FSDP2's
  parameters are DTensors whose local tensor is the shard), so its state and the step's
  temporaries (foreach's copies of the state, an fp32 master copy's casts) are the shard's: / W.
  With a MixedPrecisionPolicy (``Profile.gather_itemsize``, --precision mixed) the gathered
  parameters, and the all-gathers' bytes, are in its param_dtype.

FSDP2's gradient shards are held between windows. Each group's reduce-scatter output is allocated
in the reduce-scatter stream and the parameters' sharded gradients are views of it (torch's
distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce: "the GPU sharded gradient is
allocated in the RS stream"). The caching allocator returns a freed block to the pool of the
stream that allocated it, so after ``zero_grad(set_to_none=True)`` the shards' G / W bytes stay
reserved for the next window's reduce-scatters, and the default stream's activations cannot use
them: every micro-batch, a window's first too, runs with the G / W under it
(``Profile.gradients_held``; unsharded, the freed gradients' blocks serve the next forward). Left
out, the first micro-batch's peak (at the top of its backward, where no gradient of this window
exists yet) did not hold them while the plan's parts named G / W, so its activations, the peak
less the sharded parts, grew with W: by G (1/8 - 1/128) from 8 ranks to 128, 3.5 GiB for Llama
3.1 8B's fp32 gradients. Only where the profile models the CUDA caching allocator (its
``reserved_overhead_bytes``): off CUDA the peak is of live tensors, and freed shards are gone.

FSDP2's gradient sync with more than one micro-batch per window is a choice (``gradient_sync``):

- ``"micro-batch"``: every backward reduce-scatters (the Accumulator's sync_every_micro_batch):
  each rank holds only its gradient shard, G / W; the reduce-scatter runs every micro-batch.
- ``"window"``: only the window's last backward reduce-scatters. Until then every rank accumulates
  the *unsharded* gradient of every parameter (FSDP2's unsharded accumulated gradient, as FSDP1's
  no_sync): G per rank, growing block by block in the first backward exactly as without sharding,
  so the gradients keep their unsharded profile and carry their own name in the peak. The
  reduce-scatter runs once per window (counted in the step's time). The step after it holds the
  shards only, so its peak is over-counted by G (1 - 1/W): conservative. The shards' pool, held
  from the last window (above), is a part of its own beside the unsharded gradients.

With no device spec (a real profile here), the interconnect is this device's preset (the CPU's
gloo figure; the GPU's preset when its name matches one; else PCIe 4.0 x16), named in a note.

The fixed extra bytes join the profile's slack, so the search prices every plan with them; the
plan's ``rank_parts`` names them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ...memory.device_specs import DeviceSpec, devices
from ...profile.costs import NONE, Fit, Profile
from ...profile.roofline import all_gather_seconds, all_reduce_seconds
from ..options import SHARDS


def _parameter_bytes(module: nn.Module, floating_itemsize: int | None = None) -> int:
    """Bytes of the module's parameters (tied ones once); floating ones at ``floating_itemsize``."""
    seen: set[int] = set()
    total = 0
    for parameter in module.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            size = parameter.element_size()
            if floating_itemsize is not None and parameter.is_floating_point():
                size = floating_itemsize
            total += parameter.numel() * size
    return total


def _shifted(fit: Fit, seconds: float) -> Fit:
    return dataclasses.replace(
        fit, intercept=fit.intercept + seconds, values=tuple(v + seconds for v in fit.values)
    )


UNSHARDED_GRADIENTS = "gradients, unsharded (FSDP sync once per window)"
HELD_SHARDS = "FSDP gradient shards, held in the reduce-scatter stream's pool"
SHARDED_STEP = "optimizer step temporaries, of the local shards"


def interconnect_spec(device: torch.device) -> tuple[DeviceSpec, str]:
    """The link of the device that is here (see the module docstring), and a note naming it."""
    presets = devices()
    spec = presets["cpu"]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        matches = [p for key, p in presets.items() if key != "cpu" and key.split("-")[0] in name]
        spec = matches[0] if matches else DeviceSpec("cuda", "cuda", 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    note = (
        f"interconnect not measured: taken as {spec.interconnect}, "
        f"{spec.collective_bytes_per_second(1) / 1e9:.3g} GB/s bus bandwidth (pass device= a DeviceSpec "
        "to state it)"
    )
    return spec, note


def shard_profile(
    profile: Profile,
    model: nn.Module,
    *,
    shard: str,
    world_size: int,
    spec: DeviceSpec | None,
    gradient_sync: str = "micro-batch",
) -> tuple[Profile, tuple[tuple[str, int], ...]]:
    """The profile as one of ``world_size`` ranks sees it under ``shard``, and the extra parts."""
    if shard not in SHARDS:
        raise ConfigError(f"shard={shard!r}: choose one of {', '.join(SHARDS)}")
    if shard == "none" or world_size <= 1:
        return profile, ()
    if spec is None:
        spec, note = interconnect_spec(torch.device(profile.device))
        profile = dataclasses.replace(profile, notes=(*profile.notes, note))
    if shard == "ddp":
        buckets = profile.gradient_bytes
        seconds = all_reduce_seconds(profile.gradient_bytes, world_size, spec)
        parts: tuple[tuple[str, int], ...] = (("DDP gradient buckets", buckets),)
        changed = dataclasses.replace(
            profile,
            slack_bytes=profile.slack_bytes + buckets,
            step_seconds=profile.step_seconds + seconds,
            notes=(*profile.notes, f"DDP over {world_size} ranks: all-reduce {seconds:.3g} s per step"),
        )
        return changed, parts
    return _fsdp_profile(profile, model, world_size=world_size, spec=spec, gradient_sync=gradient_sync)


def _fsdp_profile(
    profile: Profile, model: nn.Module, *, world_size: int, spec: DeviceSpec, gradient_sync: str
) -> tuple[Profile, tuple[tuple[str, int], ...]]:
    """FSDP2's per-rank profile (the module docstring's parts) in either gradient sync mode."""
    modules = dict(model.named_modules())
    itemsize = profile.gather_itemsize  # MixedPrecisionPolicy(param_dtype=bf16): gathered in bf16
    block_bytes = [_parameter_bytes(modules[s.name], itemsize) for s in profile.blocks if s.name in modules]
    block_gradients = [segment.gradient_bytes for segment in profile.blocks]
    total_parameters = _parameter_bytes(model, itemsize)
    root_bytes = max(0, total_parameters - sum(block_bytes))
    largest = max(block_bytes, default=0)
    parts: tuple[tuple[str, int], ...] = (
        ("FSDP all-gathered parameters (2 blocks in flight)", 2 * largest),
        # Gathered as a copy beside the rank's shard in another dtype; else the shard is a part of it.
        ("FSDP root parameters, gathered", root_bytes if itemsize else root_bytes - root_bytes // world_size),
        ("FSDP reduce-scatter buffers", max(block_gradients, default=0)),
    )
    gather_seconds = 2 * all_gather_seconds(total_parameters, world_size, spec)
    scatter_seconds = all_gather_seconds(profile.gradient_bytes, world_size, spec)
    once = gradient_sync == "window"
    per_micro_batch = gather_seconds + (0.0 if once else scatter_seconds)
    segments, gradient_bytes = profile.segments, profile.gradient_bytes  # "window": unsharded
    shard_bytes = math.ceil(profile.gradient_bytes / world_size)
    pooled = profile.reserved_overhead_bytes is not None  # the caching allocator's pools: CUDA
    if once:
        if pooled:
            parts = (*parts, (HELD_SHARDS, shard_bytes))
    else:
        segments = tuple(
            dataclasses.replace(segment, gradient_bytes=math.ceil(segment.gradient_bytes / world_size))
            for segment in profile.segments
        )
        gradient_bytes = shard_bytes
    sync = (
        f"gradients unsharded through the window, reduce-scattered once ({scatter_seconds:.3g} s per step)"
        if once
        else "gradients reduce-scattered every micro-batch"
    )
    changed = dataclasses.replace(
        profile,
        segments=segments,
        parameter_bytes=math.ceil(profile.parameter_bytes / world_size),
        gradient_bytes=gradient_bytes,
        gradient_name=UNSHARDED_GRADIENTS if once else profile.gradient_name,
        gradients_held=pooled and not once,  # the shards (the module docstring); "window": a part
        optimizer_bytes=math.ceil(profile.optimizer_bytes / world_size),
        step_peak_bytes=math.ceil(profile.step_peak_bytes / world_size),
        step_peak_name=SHARDED_STEP,
        slack_bytes=profile.slack_bytes + sum(value for _, value in parts),
        step_seconds=profile.step_seconds + (scatter_seconds if once else 0.0),
        loop_seconds=_shifted(profile.loop_seconds, per_micro_batch),
        notes=(
            *profile.notes,
            f"FSDP2 over {world_size} ranks: parameters, gradients and optimizer state sharded, {sync}; "
            f"all-gathers {per_micro_batch:.3g} s per micro-batch on {spec.interconnect}, not overlapped",
        ),
    )
    return changed, parts


def rank_breakdown(
    parts: Sequence[tuple[str, int]], extras: Sequence[tuple[str, int]], context_bytes: int
) -> tuple[tuple[str, int], ...]:
    """The plan's peak parts with the slack split into what it holds (extras, the context allowance)."""
    result: list[tuple[str, int]] = []
    for name, value in parts:
        if name == "slack":
            rest = value - sum(v for _, v in extras) - context_bytes
            result.extend(extras)
            if context_bytes:
                result.append(("CUDA context and workspaces (allowance)", context_bytes))
            if rest:
                result.append(("slack", rest))
        else:
            result.append((name, value))
    return tuple(result)


def accelerate_estimate(model: nn.Module, precision: str) -> int:
    """What ``accelerate estimate-memory`` prints as "Training using Adam" for this model.

    accelerate sizes the model in float32 (its parameters and buffers), then for training with Adam
    takes the largest of model, gradients, optimizer state and step (``estimate_training_usage``):
    4x the float32 size for float32, 2x for float16 / bfloat16. No activations.
    """
    fp32_bytes = 4 * (sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()))
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    try:
        from accelerate.commands.estimate import estimate_training_usage

        usage: dict[str, Any] = estimate_training_usage(fp32_bytes, dtype)
        return int(max(usage.values()))
    except ImportError:
        return 4 * fp32_bytes if dtype == "float32" else 2 * fp32_bytes


def korthikanti_bytes(model: nn.Module, *, seq_len: int, micro_batch_size: int) -> int | None:
    """Activation bytes of all layers by Korthikanti et al. 2022: L * s b h (34 + 5 a s / h).

    None when the model has no transformer config (hidden size, heads, layers).
    """
    config = getattr(model, "config", None)
    h = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    a = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not (isinstance(h, int) and isinstance(a, int) and isinstance(layers, int)):
        return None
    s, b = seq_len, micro_batch_size
    return math.ceil(layers * s * b * h * (34 + 5 * a * s / h))


def layer_activation_bytes(profile: Profile, micro_batch_size: int) -> int:
    """microbatch's own count: what the blocks keep for backward, none checkpointed."""
    return math.ceil(sum(segment.costs[NONE].kept(micro_batch_size) for segment in profile.blocks))


def sequence_length(batch: Any) -> int | None:
    """The sequence length of a token batch (a dict with input_ids, or a 2-D integer tensor)."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids")
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point():
        return int(batch.shape[1])
    return None
