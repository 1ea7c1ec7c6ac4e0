"""Exact memory levers beside the split and the checkpointing: the gradient stays the same.

``step_choice``: the optimizer step's implementation (foreach, fused, per-tensor: one update, other
temporaries), taken when no plan fits with the optimizer's own. ``head_choice``: the loss head in
chunks of c tokens (checkpointing/head.py), priced from a profile with it and chosen when it gives
a faster plan or the only one. ``exact``: the search with them, and a refusal that names what each
lever saves before the levers that change training.

May import: what planner/ may; within the planner, the rooms before it (search/, result/, options,
target/, refusals, proof/, outcome).
"""
