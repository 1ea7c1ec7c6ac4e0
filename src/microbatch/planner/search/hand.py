"""The strategies a user picks by hand, as candidates the search always prices.

A planner exists to beat what a user does without it: no checkpointing at the largest micro-batch
that fits; every block checkpointed at the largest micro-batch that fits (HF's
``gradient_checkpointing_enable()``, Lightning users); ``torch.utils.checkpoint.checkpoint_sequential``
(the model cut into s segments, every segment but the last checkpointed). The per-size frontier
of the search (solve.frontier) holds the fastest choice for each peak, so these are on it or beaten
by a point of it; but the frontier is thinned and the sizes are a grid, so each hand strategy is
priced here at its own largest fitting micro-batch, and the search's choice is never predicted
slower than any of them (sizes.choose's ``bounds``).

checkpoint_sequential keeps only each segment's input, where a per-block "full" keeps every
block's input; in per-block policies its nearest form is "full" on the blocks of the
checkpointed segments and none on the last segment's (torch's split: len // s blocks per segment,
the remainder in the last): the same recompute, a little more memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ...profile import NONE, Profile
from .pricing import Candidate, Model
from .splits import WindowSizes

# Up to this batch per rank every micro-batch size is a hand strategy's size, not only the search's
# (the smallest b for each step count N): a user takes the largest b that fits, and its window
# (b, B - b, ...) can fit where the smallest b for its N does not. The first micro-batch runs before
# any gradient exists and the second, small, one holds them all: swin_t at batch 32 fits
# checkpoint_sequential at 29 + 3, measured 250.9 MB within a 251.5 MB budget, not at 16 + 16.
HAND_EVERY_SIZE = 64

# checkpoint_sequential's segment counts tried (and round(sqrt(blocks)), the classic choice
# sqrt(n) segments of sqrt(n) blocks: Chen et al. 2016, "Training Deep Nets with Sublinear
# Memory Cost").
SEQUENTIAL_SEGMENTS = (2, 4)
FULL = "full"


def hand_strategies(profile: Profile) -> list[tuple[str, dict[str, str]]]:
    """(name, block policies) of each hand strategy the profile can price, distinct, none first."""
    names = [segment.name for segment in profile.blocks if FULL in segment.policies]
    found: list[tuple[str, dict[str, str]]] = [("no checkpointing", {})]
    if not names:
        return found
    found.append(("every block full", dict.fromkeys(names, FULL)))
    counts = sorted({*SEQUENTIAL_SEGMENTS, round(math.sqrt(len(names)))})
    for segments in counts:
        if not 2 <= segments <= len(names):
            continue
        # torch's checkpoint_sequential: segments of len // s blocks; all but the last checkpointed.
        checkpointed = (len(names) // segments) * (segments - 1)
        policies = dict.fromkeys(names[:checkpointed], FULL)
        if policies and all(policies != other for _, other in found):
            found.append((f"checkpoint_sequential, {segments} segments", policies))
    return found


def hand_sizes(
    per_rank_batch: int, grid: Sequence[int], splits: Callable[[int], list[WindowSizes]]
) -> list[int]:
    """The micro-batch sizes the hand strategies are priced at: every size the rules allow up to
    HAND_EVERY_SIZE samples per rank, the search's ``grid`` above."""
    if per_rank_batch > HAND_EVERY_SIZE:
        return list(grid)
    return [b for b in range(per_rank_batch, 0, -1) if splits(b)]


def hand_candidates(
    model: Model,
    sizes: Sequence[int],
    splits: Callable[[int], list[WindowSizes]],
    capacity_bytes: float,
) -> list[Candidate]:
    """Each hand strategy at the largest of ``sizes`` (micro-batch sizes, any order) at which one of
    its splits fits ``capacity_bytes``: the fastest such split. A strategy that fits nowhere is left out.

    Sizes run largest first, every strategy priced at one size before the next (the model keeps the
    chains of the sizes being priced), until each strategy has its size.
    """
    waiting = [policies for _, policies in hand_strategies(model.profile)]
    found: list[Candidate] = []
    for b in sorted(sizes, reverse=True):
        if not waiting:
            break
        for policies in list(waiting):
            priced = [model.evaluate(window, _named(model.profile, policies)) for window in splits(b)]
            fitting = [candidate for candidate in priced if candidate.peak_bytes <= capacity_bytes]
            if fitting:
                found.append(min(fitting, key=lambda c: c.seconds_per_step))
                waiting.remove(policies)
    return found


def _named(profile: Profile, policies: dict[str, str]) -> dict[str, str]:
    """Every block's policy: those named, none for the rest (Model.evaluate's default, spelled out)."""
    return {segment.name: policies.get(segment.name, NONE) for segment in profile.blocks}
