"""The per-rank profile a plan is searched on: low-precision gradients summed wide, and under
``shard="fsdp"`` the gradient sync mode, chosen (planner/target/per_rank.py describes both modes).

Wide gradients (``accumulate_dtype``, accumulate/precision.py): each low-precision parameter's
gradient is moved into a sum of the wider dtype as soon as autograd writes it, so through the
window the gradients take ``numel x itemsize(accumulate_dtype)`` bytes where the low-precision
``.grad`` took ``numel x itemsize(dtype)``; at ``step()`` the sum is rounded back into ``.grad``, so
the step holds both. The profile's gradients scale by the wide / low ratio (segment by segment,
the same ratio: a conservative mean when only some parameters are narrow) and the step's
temporaries grow by the low-precision gradients.

FSDP sync: both per-rank profiles are searched at the budget, and the faster plan that fits wins
(ties: the smaller peak). With one micro-batch per window the modes are the same run: the
"micro-batch" profile (sharded gradients) is the exact one then.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ...memory.device_specs import DeviceSpec
from ...profile.costs import Profile
from ..result.applying import GRADIENT_SYNCS, dtype_name
from ..search.rules import SplitRules
from ..search.sizes import search
from .per_rank import shard_profile


def with_wide_gradients(profile: Profile, model: nn.Module, dtype: torch.dtype | None) -> Profile:
    """The profile with low-precision gradients summed in ``dtype`` (see the module docstring)."""
    if dtype is None:
        return profile
    width = torch.finfo(dtype).bits
    narrow = [
        p
        for p in model.parameters()
        if p.requires_grad and p.is_floating_point() and torch.finfo(p.dtype).bits < width
    ]
    low_bytes = sum(p.numel() * p.element_size() for p in narrow)
    if not low_bytes or not profile.gradient_bytes:
        return profile
    wide_bytes = sum(p.numel() for p in narrow) * (width // 8)
    ratio = (profile.gradient_bytes - low_bytes + wide_bytes) / profile.gradient_bytes
    segments = tuple(
        dataclasses.replace(segment, gradient_bytes=math.ceil(segment.gradient_bytes * ratio))
        for segment in profile.segments
    )
    return dataclasses.replace(
        profile,
        segments=segments,
        gradient_bytes=math.ceil(profile.gradient_bytes * ratio),
        gradient_name=f"gradients, summed in {dtype_name(dtype)}",
        step_peak_bytes=profile.step_peak_bytes + low_bytes,
        notes=(
            *profile.notes,
            f"accumulate_dtype={dtype_name(dtype)}: {low_bytes:,} B of low-precision gradients summed in "
            f"{wide_bytes:,} B through the window",
        ),
    )


def rank_profile(
    profile: Profile,
    model: nn.Module,
    *,
    shard: str,
    world_size: int,
    spec: DeviceSpec | None,
    gradient_sync: str | None,
    per_rank_batch: int,
    capacity_bytes: float,
    rules: SplitRules,
    bytes_per_sample: int,
) -> tuple[Profile, tuple[tuple[str, int], ...], str]:
    """The profile one rank runs, the parts sharding adds, and the gradient sync mode chosen."""
    if shard != "fsdp" or world_size <= 1:
        changed, extras = shard_profile(profile, model, shard=shard, world_size=world_size, spec=spec)
        return changed, extras, gradient_sync or "window"
    options = []
    for mode in [gradient_sync] if gradient_sync else list(GRADIENT_SYNCS):
        changed, extras = shard_profile(
            profile, model, shard=shard, world_size=world_size, spec=spec, gradient_sync=mode
        )
        best = search(
            changed,
            per_rank_batch=per_rank_batch,
            capacity_bytes=capacity_bytes,
            bytes_per_sample=bytes_per_sample,
            **rules.search_options(),
        ).best
        # Seconds to 9 significant digits: with one micro-batch per window both modes price the
        # same run, summed in another order (the reduce-scatter in the step or in the loop).
        seconds = float(f"{best.seconds_per_step:.9g}") if best else math.inf
        key = (best is None, seconds, best.peak_bytes if best else 0)
        options.append((key, mode == "window", changed, extras, mode))
    # Fits first, then faster, then smaller; with nothing fitting, the sharded-gradient profile.
    options.sort(
        key=lambda option: (option[0], option[1]) if not option[0][0] else (option[0][:1], option[1])
    )
    _, _, changed, extras, mode = options[0]
    return changed, extras, mode
