"""A token budget from a row plan, for workloads whose samples vary in length.

A workload declares variable lengths with ``Workload.max_length``: its samples have at most
``max_length`` tokens and ``make_batch(b)`` returns ``b`` rows padded to ``max_length``, the worst
case. The planner then profiles, searches and trials exactly as for rows, on those worst-case
batches, and reports ``Plan.max_tokens = micro_batch_size x max_length`` padded tokens.

Why that bound holds for every micro-batch ``split_by_tokens`` makes. The activation memory of a
micro-batch of r rows padded to length T is, per layer,

    a x (r T)          (everything per token: projections, MLP, norms, logits)
  + q x (r T) x T      (attention scores, when attention is quadratic: no flash / SDPA kernel)

on top of what does not depend on the data (parameters, gradients, optimizer state). A token
budget guarantees r T <= R L with R = micro_batch_size, L = max_length; and T <= L. So the linear
term is at most a R L and the quadratic one at most q (R L) L: both are largest for R rows of
length L, which is the micro-batch the trial ran and measured within the budget. The peak of any
token-budget micro-batch is therefore at most the plan's measured (worst-case) peak, with or
without quadratic attention. The bound is tight only for full-length rows; shorter ones leave room
that a finer, per-length budget could use, which this plan does not claim.
"""

from __future__ import annotations

from ...errors import WorkloadError
from ...workload import Workload


def token_budget(workload: Workload, micro_batch_size: int) -> int | None:
    """``micro_batch_size x workload.max_length`` padded tokens, or None for fixed-length workloads."""
    max_length = getattr(workload, "max_length", None)
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise WorkloadError(
            f"Workload.max_length must be a positive int (the longest sample, in tokens) or None, "
            f"got {max_length!r}"
        )
    return micro_batch_size * max_length
