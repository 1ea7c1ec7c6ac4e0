"""The planner: micro-batch size, accumulation steps and a checkpoint policy per block for a budget.

    profile (microbatch.profile)  ->  search (solve per micro-batch size)  ->  trial  ->  Plan

``solve``: the exact per-size policy problem. ``search``: the peak and time model and the search
over micro-batch sizes. ``plans``: the Plan result, ``Plan.apply``, ``Plan.manual``, save / load.
``options``: PlanOptions, plan()'s options with their defaults and checks. ``trial``: ``plan()``,
which profiles, searches, proves the choice in one real window and re-plans when it does not fit.
``applying``: what ``Plan.apply`` holds to (options that change memory, wrapped models).
``proof``: ``prove``, one trial window for a plan made elsewhere (loaded, manual, sharded: on every rank).

May import: ``errors``, ``trees``, ``memory``, ``workload``, ``distributed``, ``accumulate``,
``checkpointing``, ``profile``; it reaches the model only through the profile and the trial.
Never training, hf or the commands.
"""

from __future__ import annotations

from .options import PlanOptions
from .plans import FrontierPoint, Plan
from .proof import prove
from .trial import plan

__all__ = ["FrontierPoint", "Plan", "PlanOptions", "plan", "prove"]
