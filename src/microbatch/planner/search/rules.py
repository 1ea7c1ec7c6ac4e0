"""Rules on how a batch may be split, and what BatchNorm asks of a plan.

``min_micro_batch_size``: no micro-batch, profiled or planned (the short last one included), has
fewer samples. BatchNorm needs it: in training it normalises over the micro-batch's samples (and
positions), so a layer after global pooling sees one value per channel at micro-batch 1 and raises
"Expected more than 1 value per channel when training".

``even``: every micro-batch has the same size, micro x steps == batch (the HF Trainer cannot run a
short last micro-batch). When no even split of the batch fits, the nearest batch that has one is
planned instead, with a warning naming the change.

``prefer_large``: the largest micro-batch that fits wins, then the fastest. BatchNorm's statistics
come from each micro-batch, so a larger one is closer to the full batch's.

``only_policies``: a profile cut to the checkpoint policies the caller allows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...accumulate.batchnorm import batchnorm_layers
from ...checkpointing.api import POLICIES
from ...errors import ConfigError
from ...profile import NONE, Profile
from ...workload import Workload
from .sizes import Candidate, search

logger = logging.getLogger(__name__)

_BATCHNORM_ONE_VALUE = "Expected more than 1 value per channel"
NEAREST_SEARCH_LIMIT = 64  # batches tried on either side for an even split


@dataclass(frozen=True)
class SplitRules:
    min_micro_batch_size: int = 1
    even: bool = False
    prefer_large: bool = False

    def __post_init__(self) -> None:
        value = self.min_micro_batch_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"min_micro_batch_size must be a positive integer, got {value!r}")

    def search_options(self) -> dict[str, Any]:
        return {
            "min_micro_batch_size": self.min_micro_batch_size,
            "even": self.even,
            "prefer_large": self.prefer_large,
        }

    def check_batch(self, per_rank_batch: int, world_size: int) -> None:
        if per_rank_batch < self.min_micro_batch_size:
            raise ConfigError(
                f"min_micro_batch_size={self.min_micro_batch_size} exceeds the per-rank batch "
                f"{per_rank_batch} (batch / world_size={world_size}); lower it or raise batch"
            )

    def profile_sizes(self, per_rank_batch: int, max_profile_size: int) -> tuple[int, ...] | None:
        """Micro-batch sizes to profile: None (the profiler's default 1, half, top) without a floor."""
        floor = self.min_micro_batch_size
        if floor <= 1:
            return None
        top = max(floor, min(per_rank_batch, max_profile_size))
        return tuple(sorted({floor, max(floor, top // 2), top}))


def profiling_error(error: ValueError, rules: SplitRules) -> ConfigError | None:
    """A user-facing error for BatchNorm's failure on a too-small micro-batch; None for others."""
    if _BATCHNORM_ONE_VALUE not in str(error):
        return None
    floor = rules.min_micro_batch_size
    return ConfigError(
        f"profiling failed at micro-batch {floor}: a BatchNorm layer in training mode saw one value per "
        f"channel ({error}); BatchNorm after global pooling needs >= 2 samples per micro-batch. Pass "
        f"min_micro_batch_size={floor + 1} to plan() (--min-micro-batch {floor + 1} on the command line), "
        "or convert the model with microbatch.convert_batchnorm_to_groupnorm(model)"
    )


def batchnorm_note(model: nn.Module, chosen: Candidate, rules: SplitRules) -> str | None:
    """The plan's note when BatchNorm layers train and the batch is split."""
    micro_batch_size, steps = chosen.micro_batch_size, chosen.steps
    training = [name for name, layer in batchnorm_layers(model) if layer.training]
    if not training or steps <= 1:
        return None
    advice = (
        "the largest micro-batch that fits was preferred (prefer_large_micro_batches=True)"
        if rules.prefer_large
        else "prefer_large_micro_batches=True (--prefer-large-micro-batches) picks the largest that fits"
    )
    return (
        f"{len(training)} BatchNorm layer(s) train: each micro-batch of {micro_batch_size} is normalised "
        f"with its own statistics, not the batch's, so accumulation over {steps} steps is not exact; "
        f"{advice}; min_micro_batch_size sets a floor; convert_batchnorm_to_groupnorm makes it exact"
    )


def beats(candidate: Candidate, other: Candidate, *, prefer_large: bool, tie: float) -> bool:
    """True when ``candidate`` is the better plan: larger micro-batch first when ``prefer_large``, else
    faster by more than the fraction ``tie`` (the timings' noise)."""
    if prefer_large and candidate.micro_batch_size != other.micro_batch_size:
        return candidate.micro_batch_size > other.micro_batch_size
    return candidate.seconds_per_step < other.seconds_per_step / (1 + tie)


def nearest_even_batch(per_rank_batch: int, fits: Callable[[int], bool]) -> int | None:
    """The per-rank batch closest to ``per_rank_batch`` (larger first on ties) for which ``fits``."""
    for change in range(1, NEAREST_SEARCH_LIMIT + 1):
        for candidate in (per_rank_batch + change, per_rank_batch - change):
            if candidate >= 1 and fits(candidate):
                return candidate
    return None


def warn_batch_changed(batch: int, new_batch: int, rules: SplitRules) -> str:
    message = (
        f"even=True: no split of batch {batch} into equal micro-batches of >= "
        f"{rules.min_micro_batch_size} fits the budget; planned the nearest batch that has one, "
        f"{new_batch} (changed from {batch})"
    )
    logger.warning("%s", message)
    return message


def even_batch(
    profile: Profile, per_rank_batch: int, budget_bytes: int, rules: SplitRules, world_size: int
) -> tuple[int, list[str]]:
    """The per-rank batch to plan: ``per_rank_batch``, or with even=True the nearest with an even split."""
    if not rules.even:
        return per_rank_batch, []

    options = rules.search_options()

    def searched(candidate: int, **changes: Any) -> Candidate | None:
        found = {**options, **changes}
        return search(profile, per_rank_batch=candidate, capacity_bytes=budget_bytes, **found).best

    uneven = searched(per_rank_batch, even=False, prefer_large=True)  # the largest micro-batch that fits
    if uneven is None or searched(per_rank_batch) is not None:
        return per_rank_batch, []  # no split fits at all (the usual error follows), or an even one does
    floor, largest = rules.min_micro_batch_size, uneven.micro_batch_size

    def fits(candidate: int) -> bool:  # an even split needs a divisor in [floor, largest]
        divisible = any(candidate % size == 0 for size in range(floor, min(largest, candidate) + 1))
        return divisible and searched(candidate) is not None

    nearest = nearest_even_batch(per_rank_batch, fits)
    if nearest is None:
        return per_rank_batch, []
    return nearest, [warn_batch_changed(per_rank_batch * world_size, nearest * world_size, rules)]


def profile_with_rules(
    profile_fn: Callable[..., Profile],
    workload: Workload,
    rules: SplitRules,
    per_rank_batch: int,
    max_profile_size: int,
    **options: Any,
) -> Profile:
    """``profile_fn`` (profile_workload) at sizes no smaller than the rules allow; BatchNorm's
    failure at micro-batch 1 explained."""
    try:
        return profile_fn(
            workload,
            micro_batch_sizes=rules.profile_sizes(per_rank_batch, max_profile_size),
            max_micro_batch_size=min(per_rank_batch, max_profile_size),
            **options,
        )
    except ValueError as error:
        explained = profiling_error(error, rules)
        if explained is None:
            raise
        raise explained from error


def only_policies(profile: Profile, policies: Sequence[str]) -> Profile:
    """``profile`` with each block's costs cut to ``policies`` (and none, always measured).

    A policy that is no checkpoint policy, or that no block of the profile measured, is refused by
    name: the search cannot price what was not measured.
    """
    wanted = {NONE, *policies}
    unknown = sorted(wanted - {NONE, *POLICIES})
    if unknown:
        raise ConfigError(
            f"policies={list(policies)}: {', '.join(unknown)} are not checkpoint policies; choose from "
            f"none, {', '.join(POLICIES)}"
        )
    blocks = profile.blocks
    measured = {policy for segment in blocks for policy in segment.policies}
    missing = sorted(wanted - measured) if blocks else []
    if missing:
        raise ConfigError(
            f"policies={list(policies)}: the profile did not measure {', '.join(missing)} (it measured "
            f"{', '.join(sorted(measured))}); profile with them (profile_workload(..., policies=...)) or "
            "leave them out"
        )
    segments = tuple(
        dataclasses.replace(segment, costs={p: c for p, c in segment.costs.items() if p in wanted})
        if segment.is_block
        else segment
        for segment in profile.segments
    )
    return dataclasses.replace(profile, segments=segments)
