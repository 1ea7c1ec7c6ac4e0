"""The pipeline planner, ``plan(..., pipeline=S)``: schedule, micro-batches per step, cuts, policies.

``stage_cost``: a stage's peak bytes and seconds from the profile's segments. ``layouts``: the
search over schedules, micro-batches per step and cuts. ``choose``: profile, search and the Plan in
one process. ``on_ranks``: every rank profiles, rank 0 plans, each rank proves its own stage.

May import: what planner/ may; within the planner, everything but planning.
"""
