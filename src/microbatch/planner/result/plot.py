"""A picture of the frontier: peak memory against time per optimizer step, with the budget line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...memory import format_bytes
from .plans import Plan

MIB = 2**20


def save_frontier_plot(
    plan: Plan,
    path: str,
    *,
    title: str | None = None,
    baselines: Sequence[tuple[str, float, float]] = (),
) -> None:
    """Write ``plan``'s frontier to ``path`` (any format matplotlib knows by its extension).

    ``baselines``: extra (label, seconds_per_step, peak_bytes) points, drawn as crosses.
    Uses matplotlib's object API and the Agg canvas: no global pyplot state, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    points = sorted(plan.frontier, key=lambda p: p.seconds_per_step)
    axes.step(
        [p.seconds_per_step for p in points],
        [p.predicted_peak_bytes / MIB for p in points],
        where="post",
        marker="o",
        markersize=4,
        color="tab:blue",
        label="frontier (predicted)",
    )
    axes.axhline(
        plan.budget_bytes / MIB,
        color="tab:red",
        linestyle="--",
        label=f"budget {format_bytes(plan.budget_bytes)}",
    )
    _draw_chosen(axes, plan)
    for label, seconds, peak_bytes in baselines:
        axes.plot([seconds], [peak_bytes / MIB], marker="x", markersize=8, linestyle="none", label=label)
    axes.set_xlabel("time per optimizer step (s)")
    axes.set_ylabel("peak memory (MiB)")
    axes.set_title(
        title or f"{plan.workload}: batch {plan.batch_size}, plans that no other beats on both axes"
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)


def _draw_chosen(axes: Any, plan: Plan) -> None:
    """The chosen plan as a star at its predicted peak, and a bar at its measured one."""
    axes.plot(
        [plan.predicted_seconds_per_step],
        [plan.predicted_peak_bytes / MIB],
        marker="*",
        markersize=16,
        color="tab:orange",
        linestyle="none",
        label=f"chosen: micro-batch {plan.micro_batch_size} x {plan.steps}",
    )
    if plan.measured_peak_bytes is not None:
        axes.plot(
            [plan.predicted_seconds_per_step],
            [plan.measured_peak_bytes / MIB],
            marker="_",
            markersize=18,
            color="black",
            linestyle="none",
            label="chosen: measured peak",
        )
