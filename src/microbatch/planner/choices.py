"""Which plan to try besides the search's safe choice: first a faster one that fits without the
safety margin (its trial is the proof), and after out-of-memory trials the smallest plan, once."""

from __future__ import annotations

from ..profile import Profile
from .refusals import candidate_key
from .rules import SplitRules, beats
from .search import Candidate, Model, SearchResult, search, tie_fraction


def faster_without_margin(
    profile: Profile,
    per_rank_batch: int,
    capacity: float,
    correction_bytes: int,
    safe: Candidate | None,
    rules: SplitRules | None = None,
    bytes_per_sample: int = 0,
) -> Candidate | None:
    """A plan faster than ``safe`` that fits the capacity without the safety margin (margin shown)."""
    rules = rules or SplitRules()
    bold = search(
        profile,
        per_rank_batch=per_rank_batch,
        capacity_bytes=capacity,
        correction_bytes=correction_bytes,
        safety_margin=0.0,
        bytes_per_sample=bytes_per_sample,
        **rules.search_options(),
    ).best
    tie = tie_fraction(profile)
    if bold is None or (safe is not None and not beats(bold, safe, prefer_large=rules.prefer_large, tie=tie)):
        return None  # not better beyond the timings' noise: the safe plan it is
    model = Model(profile, correction_bytes=correction_bytes, bytes_per_sample=bytes_per_sample)
    return model.evaluate(bold.micro_batch_sizes, dict(bold.block_policies))


def last_resort(
    chosen: Candidate | None,
    out_of_trials: bool,
    result: SearchResult,
    budget_bytes: int,
    tried: set[tuple[object, ...]],
    notes: list[str],
) -> Candidate | None:
    """The plan with the least predicted peak (smallest micro-batch, most checkpointing), if untried.

    After trials ran out of memory, the bisection of the predicted peak may rule out plans that fit
    (the model mispredicts what a device can hold): the smallest plan is tried before giving up.
    """
    if chosen is not None and not out_of_trials:
        return chosen
    smallest = result.minimum
    if candidate_key(smallest) in tried or smallest.peak_bytes > budget_bytes:
        return None
    notes.append(f"trying the smallest plan after {len(tried)} trial(s), some out of memory")
    return smallest
