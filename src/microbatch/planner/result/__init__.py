"""The Plan value: the planner's one result type, its checks when loaded, its text and plot, its use.

``plans``: ``Plan``, ``FrontierPoint``, ``Plan.apply`` / ``remove`` / ``save`` / ``load``.
``checks``: a saved plan read within bounds, every field checked. ``text``: ``print(plan)``.
``plot``: the frontier picture. ``applying``: what ``Plan.apply`` holds to. ``pipeline_build``:
``plan.pipeline(...)``. ``token_budget``: ``plan.max_tokens`` from a row plan.

May import: what planner/ may; within the planner, search/.
"""
