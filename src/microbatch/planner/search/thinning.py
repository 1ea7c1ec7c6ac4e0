"""The one rule by which the per-block policy solvers bound their state sets: buckets of kept bytes.

Every policy solver of the planner (solve.py's chain: ``solve`` and ``minimum_peak``; the pipeline's
``stage_cost.solve_stage`` and ``least_stage``) is a dynamic program over the blocks in forward
order whose states are partial plans: P, the bytes the blocks so far keep until their backward,
the peaks reached so far, and the seconds so far. Exact pruning keeps the states no other beats
in all of them. For a long chain of different blocks that set can still grow past ``max_states``;
then this rule thins it:

    w = ceil((P_max - P_min + 1) / max_states)          the bucket width in bytes
    bucket(s) = (P(s) - P_min) // w                      at most max_states buckets
    keep, in each bucket, the state of least rank        rank: (seconds, peaks...) or (peak, ...)

Why this is safe and what it costs. (1) Every surviving state is a real partial plan and every
capacity check runs on its true sums, so a solver never returns a choice that does not fit. (2) A
dropped state d shares its bucket with a survivor s of rank(s) <= rank(d) and P(s) < P(d) + w. On
the chain, the future depends on the past only through P (solve.py's docstring: the later peaks
are P_{k-1} + peak_k), so any continuation of d, taken from s instead, is no slower and peaks at
most w - 1 bytes higher at every later block. By induction over the T thinning steps of a solve,
the choice found is at least as fast as the exact optimum at capacity C - T (w - 1): the rule
gives up at most T (w - 1) bytes of capacity, never feasibility. The solvers log w when they thin.
(3) A stage's states also carry the chain peaks (first and steady window); their rank puts the
lower chain first among equally fast states, so the same bound holds in P and the chains that a
survivor brings are the least of its bucket's fastest.

Applied only above ``max_states`` states (thousands): the chains of identical blocks that real
models are made of are solved by counts (solve_runs.py) and never reach it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

State = TypeVar("State")


def thin(
    states: Sequence[State],
    max_states: int,
    *,
    kept_bytes: Callable[[State], int],
    rank: Callable[[State], tuple[Any, ...]],
    solver: str,
) -> list[State]:
    """At most ``max_states`` states: in each bucket of kept bytes, the one of least ``rank``.

    The survivors come back in order of kept bytes. ``states`` of at most ``max_states`` come back
    as they are (module docstring: the rule and its bound).
    """
    if len(states) <= max_states:
        return list(states)
    low = min(kept_bytes(state) for state in states)
    high = max(kept_bytes(state) for state in states)
    width = max(1, math.ceil((high - low + 1) / max_states))
    best: dict[int, State] = {}
    for state in states:
        bucket = (kept_bytes(state) - low) // width
        current = best.get(bucket)
        if current is None or rank(state) < rank(current):
            best[bucket] = state
    logger.debug(
        "%s: thinned %d partial plans to %d (buckets of %d kept bytes)", solver, len(states), len(best), width
    )
    return [best[bucket] for bucket in sorted(best)]
