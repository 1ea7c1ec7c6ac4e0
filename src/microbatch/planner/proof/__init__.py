"""The proof by trial: one real window of a plan under the tracker, and which plan to try next.

``trial_run``: one optimizer step of a candidate on the real model, its peak measured. ``prove``:
the trial for a plan made elsewhere (loaded, manual, sharded: on every rank). ``choices``: a faster
plan near the budget to try first, and the smallest plan after out-of-memory trials.

May import: what planner/ may; within the planner, search/, result/, target/, options and refusals.
"""
