"""The search with the exact levers, and the refusal that names them.

When no plan fits with the optimizer's own step, the step's other implementations are measured and
the search runs again with the leanest (step_choice.py). When still nothing fits, the refusal lists
what would: the exact levers first, each with the bytes it saves, then the levers that change the
training, marked as such.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from ...errors import InfeasibleBudgetError
from ...memory import format_bytes
from ..outcome import PlanRequest, Setup
from .step_choice import lower_step

Result = TypeVar("Result")


def search_with_levers(
    search_and_prove: Callable[[Setup, PlanRequest], Result], setup: Setup, request: PlanRequest
) -> tuple[Setup, Result]:
    """``search_and_prove(setup, request)``; when it finds no plan, again with a leaner optimizer step.

    With ``exact_levers=False`` (PlanOptions): the search alone, its refusal as it is.
    """
    if not request.options.exact_levers:
        return setup, search_and_prove(setup, request)
    try:
        return setup, search_and_prove(setup, request)
    except InfeasibleBudgetError as error:
        leaner = lower_step(setup, request.options)
        if leaner is None:
            raise naming_levers(error, setup, request) from None
    try:
        return leaner, search_and_prove(leaner, request)
    except InfeasibleBudgetError as error:
        raise naming_levers(error, leaner, request) from None


def lever_lines(setup: Setup, request: PlanRequest, minimum_bytes: int) -> list[str]:
    """What would fit, with the bytes each saves: exact levers first, then those that change training."""
    profile, budget = setup.profile, setup.model_budget_bytes
    # minimum_bytes is stated like the budget (refusals.refusal: the reserve outside the model added)
    over = max(0, minimum_bytes - setup.budget_bytes)
    minimum_bytes -= setup.reserve.total_bytes
    static = profile.parameter_bytes + profile.gradient_bytes + profile.optimizer_bytes
    exact = []
    if setup.head_chunk_tokens is None and request.options.head != ():
        exact.append(
            "the loss head in chunks (plan(..., head=[256, 1024, 4096]) on a model whose head microbatch "
            "chunks)"
        )
    if setup.optimizer_step is None:
        exact.append(
            "a fused optimizer step (torch.optim.AdamW(..., fused=True)) where the step's temporaries bind"
        )
    if request.options.shard != "fsdp":
        room = budget - (minimum_bytes - static)  # what the static part may take per rank
        ranks = 2 ** math.ceil(math.log2(static / room)) if room > 0 and static > room else 2
        exact.append(
            f"FSDP over {ranks} ranks (shard='fsdp', world_size={ranks}): saves "
            f"{format_bytes(static - static // ranks)} of parameters, gradients and optimizer state per rank"
        )
    # Exact too, but microbatch does not run it: name it with what it would save and who offers it.
    exact.append(
        f"CPU offload of the optimizer state (not offered by microbatch; FSDP2's CPUOffloadPolicy, "
        f"DeepSpeed ZeRO-Offload): saves up to {format_bytes(profile.optimizer_bytes)}"
    )
    changing = [
        f"8-bit optimizer state: saves about {format_bytes(profile.optimizer_bytes * 3 // 4)}",
        f"LoRA (frozen base weights): saves most of the gradients and optimizer state, up to "
        f"{format_bytes(profile.gradient_bytes + profile.optimizer_bytes)}",
    ]
    taken = [f"optimizer step {setup.optimizer_step}"] if setup.optimizer_step else []
    taken += [f"head chunks of {setup.head_chunk_tokens:,} tokens"] if setup.head_chunk_tokens else []
    already = f" (already taken: {', '.join(taken)})" if taken else ""
    return [
        f"{format_bytes(over)} over the budget{already}. Exact levers (the same gradient): "
        + "; ".join(exact)
        + ".",
        "Levers that change the training: " + "; ".join(f"{line} [changes training]" for line in changing),
    ]


def naming_levers(error: InfeasibleBudgetError, setup: Setup, request: PlanRequest) -> InfeasibleBudgetError:
    """``error`` with the levers that would make a plan fit, exact ones first."""
    lines = lever_lines(setup, request, error.minimum_bytes)
    return InfeasibleBudgetError(
        f"{error}. {' '.join(lines)}",
        minimum_bytes=error.minimum_bytes,
        parts=error.parts,
        minimum_is_lower_bound=error.minimum_is_lower_bound,
    )
