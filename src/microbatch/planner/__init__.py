"""The planner: micro-batch size, accumulation steps and a checkpoint policy per block for a budget.

    profile (microbatch.profile) -> search/ (sizes x policies, priced) -> proof/ (one real window) -> Plan

Its rooms, lowest first (tests/test_structure.py holds the order: a room imports only rooms before it):

    search/        which micro-batch sizes, the peak and time model, the per-block policy solver
    result/        the Plan value: Plan, its checks when loaded, its text and plot, Plan.apply
    options.py     PlanOptions: plan()'s options with their defaults and checks
    target/        where the plan runs: per-rank memory (DDP / FSDP2), simulated devices, the reserve
    refusals.py    what the planner refuses, and how it says so
    proof/         the trial: one real window under the tracker; which plan to try next
    outcome.py     what plan() is asked and the Plan made of the chosen candidate
    pipeline/      plan(..., pipeline=S): stages, schedule, cuts, the trial on every rank
    planning.py    plan(): profile, search, prove, re-plan until it fits
    cached_plan.py plan_cached(): gradient caching's encode micro-batch for a budget

May import: ``errors``, ``trees``, ``memory``, ``workload``, ``distributed``, ``accumulate``,
``checkpointing``, ``profile``; it reaches the model only through the profile and the trial.
Never training, hf or the commands.
"""

from __future__ import annotations

from .options import PlanOptions
from .planning import plan
from .proof.prove import prove
from .result.plans import FrontierPoint, Plan

__all__ = ["FrontierPoint", "Plan", "PlanOptions", "plan", "prove"]
