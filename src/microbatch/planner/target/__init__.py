"""Where a plan runs: per-rank memory (DDP / FSDP2), simulated devices, what a budget holds besides the model.

``per_rank``: a rank's share of a profile, and the formulas people use instead. ``sharding``: the
per-rank profile the search runs on. ``simulated``: ``device=`` / ``simulate=``. ``reserve``: the
allowance outside the model (CUDA context, allocator overhead) that defines a budget per device.

May import: what planner/ may; within the planner, search/, result/ and options.
"""
