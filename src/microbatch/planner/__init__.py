"""The planner: micro-batch size, accumulation steps and a checkpoint policy per block for a budget.

    profile (microbatch.profile)  ->  search (solve per micro-batch size)  ->  trial  ->  Plan

``solve``: the exact per-size policy problem. ``search``: the peak and time model and the search
over micro-batch sizes. ``plan``: the Plan result, ``Plan.apply``, ``Plan.manual``, save / load.
``trial``: ``plan()``, which profiles, searches, proves the choice in one real window and re-plans
when it does not fit. ``prove``: one trial window for a plan made elsewhere (loaded, manual).
"""

from __future__ import annotations

from .plan import FrontierPoint, Plan
from .prove import prove
from .trial import plan

__all__ = ["FrontierPoint", "Plan", "plan", "prove"]
