"""Which plan to try besides the search's safe choice: first a faster one that the model puts near the
budget (its trial is the proof), and after out-of-memory trials the smallest plan, once.

Near the budget: predicted without the safety margin, within TRIAL_REACH above the budget. The
predicted peak is a model with a few per cent of error either way (tests/test_planner.py holds it to
10 %), so a plan predicted just over the budget often measures under it: at a budget equal to the
measured peak of 8 x 8, the model may put 8 x 8 a hair above and choose 7 x 9 + 1, ten micro-batches.
One trial settles it; when it measures over the budget the safe plan is next (planning.py).
"""

from __future__ import annotations

from ...profile import Profile
from ..refusals import candidate_key
from ..search.rules import SplitRules, beats
from ..search.sizes import Candidate, Model, SearchResult, search, tie_fraction, tie_key

TRIAL_REACH = 0.03  # a faster plan predicted up to 3 % over the budget gets one trial


def faster_without_margin(
    profile: Profile,
    per_rank_batch: int,
    capacity: float,
    correction_bytes: int,
    safe: Candidate | None,
    rules: SplitRules | None = None,
    bytes_per_sample: int = 0,
) -> Candidate | None:
    """A plan faster than ``safe`` predicted, without the safety margin, within TRIAL_REACH above the
    capacity (its prediction with the margin shown)."""
    rules = rules or SplitRules()
    bold = search(
        profile,
        per_rank_batch=per_rank_batch,
        # The reach buys speed, not feasibility: with no safe plan only the margin is waived.
        capacity_bytes=capacity * (1 + TRIAL_REACH) if safe is not None else capacity,
        correction_bytes=correction_bytes,
        safety_margin=0.0,
        bytes_per_sample=bytes_per_sample,
        **rules.search_options(),
    ).best
    tie = tie_fraction(profile)
    if bold is None or (safe is not None and not _better(bold, safe, rules, tie)):
        return None  # neither faster beyond the timings' noise nor first among ties: the safe plan it is
    model = Model(profile, correction_bytes=correction_bytes, bytes_per_sample=bytes_per_sample)
    return model.evaluate(bold.micro_batch_sizes, dict(bold.block_policies))


def hands_within_margin(
    profile: Profile,
    per_rank_batch: int,
    capacity: float,
    correction_bytes: int,
    result: SearchResult,
    rules: SplitRules,
    bytes_per_sample: int = 0,
) -> list[Candidate]:
    """The hand strategies that fit ``capacity`` only without the safety margin (at a larger
    micro-batch than with it), fastest predicted first: each deserves its own trial, whatever its
    predicted time (issue 32: every block full at 2 on the tiny Llama, at 6 on resnet50, predicted
    0.4-2 % over the budget, measured within it and the fastest hand strategy)."""
    bold = search(
        profile,
        per_rank_batch=per_rank_batch,
        capacity_bytes=capacity,
        correction_bytes=correction_bytes,
        safety_margin=0.0,
        bytes_per_sample=bytes_per_sample,
        **rules.search_options(),
    )
    known = {candidate_key(hand) for hand in result.hands}
    near = [hand for hand in bold.hands if candidate_key(hand) not in known]
    return sorted(near, key=lambda hand: hand.seconds_per_step)


def _better(bold: Candidate, safe: Candidate, rules: SplitRules, tie: float) -> bool:
    """Faster beyond the noise, or a tie in time that the search's tie order puts first (no more
    recomputation, a larger micro-batch or fewer steps): on a noisy machine 8 x 8 and 7 x 9 + 1 tie.

    The tie is 2 x the profile's noise, 5-8 % (search/sizes.py): a hand strategy a hair
    over the budget with the margin and predicted faster than that (every block full at its largest
    micro-batch, 10-22 % faster in issue 32) gets its trial. Any smaller gain would not: a trial
    for every plan a hair faster would let the noise pick between two plans from run to run."""
    if beats(bold, safe, prefer_large=rules.prefer_large, tie=tie):
        return True
    tied = not beats(safe, bold, prefer_large=rules.prefer_large, tie=tie)
    return tied and tie_key(bold) < tie_key(safe)


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
