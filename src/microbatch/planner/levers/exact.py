"""The search with the exact levers, and the refusal that names them.

When no plan fits with the optimizer's own step, the step's other implementations are measured and
the search runs again with the leanest (step_choice.py). When still nothing fits, the refusal lists
what would: the exact levers first, each with the bytes it saves, then the levers that change the
training, marked as such.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ...errors import InfeasibleBudgetError
from ..outcome import PlanRequest, Setup
from .step_choice import lower_step

Result = TypeVar("Result")


def search_with_levers(
    search_and_prove: Callable[[Setup, PlanRequest], Result], setup: Setup, request: PlanRequest
) -> tuple[Setup, Result]:
    """``search_and_prove(setup, request)``; when it finds no plan, again with a leaner optimizer step."""
    try:
        return setup, search_and_prove(setup, request)
    except InfeasibleBudgetError:
        leaner = lower_step(setup, request.options)
        if leaner is None:
            raise
    return leaner, search_and_prove(leaner, request)
