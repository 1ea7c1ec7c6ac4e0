"""The search: which micro-batch sizes to try, the peak and time model, and the per-block policy solver.

``splits``: a window's micro-batch sizes and the sizes the search tries. ``pricing``: the peak and
time model of a candidate (``Model``, ``Candidate``). ``solve``: the policy per block for one size,
an exact chain knapsack (``solve_runs``: runs of identical blocks by counts). ``sizes``: the search
over micro-batch sizes and its ties. ``hand``: the hand strategies, always candidates. ``extend``:
the profile measured again up to a choice beyond its sizes, only the choice's policies. ``rules``:
how a batch may be split, what BatchNorm asks.

May import: what planner/ may; within the planner, nothing (it is the planner's lowest room).
"""
