"""The profile extended up to the micro-batch the search chooses, when that is beyond the sizes measured.

Costs fitted on small micro-batches do not extrapolate to large ones (kernels leave the
launch-bound regime, attention switches backends), so a choice beyond the profiled sizes is
measured before it is trusted. Only a size the budget allows is profiled: the search chose it.

Only what the choice uses is profiled again: its policies (and none), at the profiler's sizes up
to the choice. The other policies keep their first profile's costs, their times scaled by the
ratio of the two profiles' "none" block times at the largest size both measured, so that both
sessions read on one scale (on a shared machine a profile's CPU clock reads a few per cent higher
or lower from one minute to the next). The README's main job (gpt-mini, batch 64, 96 MiB: the
search chose 32 x 2 without checkpointing from sizes up to 16) profiled all three policies a
second time, 2x the first profile; "none" alone is about a third of that.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from ...checkpointing.api import BlockSpec
from ...profile import NONE, Profile, ProgressFn
from ...profile.costs import Fit, PolicyCost, SegmentProfile
from ...workload import Workload
from .rules import SplitRules, profile_with_rules
from .sizes import search

logger = logging.getLogger("microbatch.planner.planning")  # plan()'s log


def extend_profile(
    workload: Workload,
    profile: Profile,
    *,
    per_rank_batch: int,
    capacity_bytes: int,
    blocks: BlockSpec,
    progress: ProgressFn | None,
    rules: SplitRules,
    profiler: Callable[..., Profile],
) -> Profile:
    """``profile``, or when the search's choice is beyond its sizes, the choice's policies measured
    up to it and the other policies' costs carried over (see the module docstring)."""
    best = search(
        profile, per_rank_batch=per_rank_batch, capacity_bytes=capacity_bytes, **rules.search_options()
    ).best
    measured_up_to = max(profile.micro_batch_sizes, default=0)
    if best is None or best.micro_batch_size <= measured_up_to:
        return profile
    used = sorted({policy for _, policy in best.block_policies} - {NONE})
    logger.info(
        "the search chose micro-batch %d, beyond the profiled sizes (up to %d): profiling %s up to it",
        best.micro_batch_size,
        measured_up_to,
        ", ".join([NONE, *used]),
    )
    size = best.micro_batch_size  # sizes no smaller than the rules allow
    kinds = {"blocks": blocks, "policies": used, "progress": progress}
    extended = profile_with_rules(profiler, workload, rules, size, size, **kinds)
    return carried_over(extended, profile)


def carried_over(extended: Profile, first: Profile) -> Profile:
    """``extended`` with each block's policies that only ``first`` measured, their times scaled to
    ``extended``'s clock reading (``session_ratio``)."""
    ratio = session_ratio(extended, first)
    segments = []
    earlier = {segment.name: segment for segment in first.blocks}
    for segment in extended.segments:
        old = earlier.get(segment.name)
        if not segment.is_block or old is None:
            segments.append(segment)
            continue
        costs = dict(segment.costs)
        for policy, cost in old.costs.items():
            costs.setdefault(policy, _scaled(cost, ratio))
        segments.append(dataclasses.replace(segment, costs=costs))
    return dataclasses.replace(extended, segments=tuple(segments))


def session_ratio(extended: Profile, first: Profile) -> float:
    """The blocks' "none" seconds in ``extended`` over those in ``first``, at the largest micro-batch
    size both measured; 1.0 when they share none or measured no time."""
    common = set(extended.micro_batch_sizes) & set(first.micro_batch_sizes)
    if not common:
        return 1.0
    size = max(common)
    new = _none_seconds(extended.blocks, size)
    old = _none_seconds(first.blocks, size)
    return new / old if new > 0 and old > 0 else 1.0


def _none_seconds(blocks: Sequence[SegmentProfile], size: int) -> float:
    return sum(segment.costs[NONE].seconds(size) for segment in blocks if NONE in segment.costs)


def _scaled(cost: PolicyCost, ratio: float) -> PolicyCost:
    """``cost`` with its forward and backward seconds times ``ratio`` (its bytes as they were)."""
    return dataclasses.replace(
        cost,
        forward_seconds=_times(cost.forward_seconds, ratio),
        backward_seconds=_times(cost.backward_seconds, ratio),
    )


def _times(fit: Fit, ratio: float) -> Fit:
    return dataclasses.replace(
        fit,
        intercept=fit.intercept * ratio,
        slope=fit.slope * ratio,
        values=tuple(v * ratio for v in fit.values),
    )
