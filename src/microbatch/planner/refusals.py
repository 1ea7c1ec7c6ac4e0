"""What the planner refuses, and how it says so: budgets below the weights, a make_batch that returns
the wrong number of samples, a batch that needs too many micro-batches per window, no plan that
fits (before or after trials). Every refusal names the minimum memory and what it is made of."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError, InfeasibleBudgetError, MicrobatchError, WorkloadError
from ..memory import format_bytes
from ..memory.optimizer_state import optimizer_state_bytes
from ..profile import Profile
from ..trees.batches import batch_size_of, tensor_bytes
from ..workload import Workload
from .result.plans import summarize_policies
from .search.sizes import Candidate, SearchResult
from .search.splits import MAX_STEPS_PER_WINDOW
from .target.reserve import BudgetReserve, with_reserve


def static_message(profile: Profile, budget_bytes: int) -> str | None:
    parts = profile.static_parts()
    total = sum(parts.values())
    if total + profile.step_peak_bytes <= budget_bytes:
        return None
    terms = " + ".join(f"{name} {format_bytes(value)}" for name, value in parts.items() if value)
    exceed = (
        "already exceed"
        if total > budget_bytes
        else (f"plus the {profile.step_peak_name} {format_bytes(profile.step_peak_bytes)} exceed")
    )
    return (
        f"{terms} = {format_bytes(total)} {exceed} the budget memory={format_bytes(budget_bytes)}; "
        "no micro-batch size or checkpointing can fit. Raise memory, or shrink the model or its "
        "optimizer state (a stateless or 8-bit optimizer, FSDP across more ranks)"
    )


def refuse_budget_below_weights(
    workload: Workload, budget_bytes: int, reserve: BudgetReserve | None = None, *, shards: int = 1
) -> None:
    """Fail before profiling when parameters, gradients and optimizer state alone exceed the budget.

    The optimizer state is counted without allocating it (optimizer_state.optimizer_state_bytes:
    one dry step on the meta device, or the optimizer's known factor). The sum is a lower bound of
    every plan's peak (activations, the batch and temporaries come on top), and the error says so.
    ``shards``: FSDP ranks sharing them.
    """
    parameters = list(workload.model.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters) // shards
    gradient_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad) // shards
    optimizer = workload.make_optimizer()
    state_bytes, _ = optimizer_state_bytes(workload.model, optimizer)
    parts = {
        "parameters": parameter_bytes,
        "gradients": gradient_bytes,
        f"{type(optimizer).__name__} state": state_bytes // shards,
    }
    del optimizer
    total = sum(parts.values())
    if total > budget_bytes:
        terms = " + ".join(f"{name} {format_bytes(value)}" for name, value in parts.items() if value)
        error = InfeasibleBudgetError(
            f"{terms} = {format_bytes(total)} already exceed the budget memory={format_bytes(budget_bytes)}, "
            "before any activation; no micro-batch size or checkpointing can fit. Raise memory to more than "
            f"{format_bytes(total)} (at least; activations come on top), or shrink the model or its "
            "optimizer state (a stateless or 8-bit optimizer, FSDP across more ranks, frozen parameters)",
            minimum_bytes=total,
            parts=parts,
            minimum_is_lower_bound=True,
        )
        raise with_reserve(error, reserve) if reserve is not None else error


def check_make_batch(workload: Workload, per_rank_batch: int) -> int:
    """make_batch(b) must return b samples (the profile and the trial rely on it), as verify checks.

    Returns the tensor bytes of one sample (a floor under a micro-batch's memory).
    """
    sample_bytes = 0
    for size in sorted({1, min(2, per_rank_batch)}, reverse=True):
        made = workload.make_batch(size)
        try:
            found = batch_size_of(made)
        except MicrobatchError as error:
            raise WorkloadError(f"make_batch({size}) of workload {workload.name!r}: {error}") from error
        if found != size:
            raise WorkloadError(
                f"make_batch({size}) of workload {workload.name!r} returned a batch of {found} samples; "
                f"make_batch(b) must return exactly b samples (along dimension 0 of every tensor)"
            )
        sample_bytes = tensor_bytes(made) // size
    return sample_bytes


def refuse_window_too_long(per_rank_batch: int, budget_bytes: int, result: SearchResult) -> None:
    """A batch that needs more micro-batches per step than a window may have: a clear refusal."""
    least = -(-per_rank_batch // MAX_STEPS_PER_WINDOW)
    if least <= 1 or result.best is not None:
        return
    raise InfeasibleBudgetError(
        f"batch of {per_rank_batch:,} samples per rank: within {MAX_STEPS_PER_WINDOW:,} micro-batches per "
        f"optimizer step a micro-batch must hold at least {least:,} samples, and none that large fits "
        f"memory={format_bytes(budget_bytes)} (the smallest such plan needs "
        f"{format_bytes(result.minimum.peak_bytes)}); lower the batch, or raise memory",
        minimum_bytes=result.minimum.peak_bytes,
        parts=dict(result.minimum.parts),
    )


def infeasible_error(profile: Profile, result: SearchResult, budget_bytes: int) -> InfeasibleBudgetError:
    """The error for a budget below every plan, saying the minimum and what it is made of."""
    minimum = result.minimum
    message = static_message(profile, budget_bytes)
    if message is None:
        terms = " + ".join(f"{name} {format_bytes(value)}" for name, value in minimum.parts if value)
        message = (
            f"no plan fits memory={format_bytes(budget_bytes)}: the smallest, micro-batch "
            f"{minimum.micro_batch_size} x {minimum.steps} steps with "
            f"{summarize_policies(minimum.block_policies)}, "
            f"needs {format_bytes(minimum.peak_bytes)} = {terms}. Raise memory to at least "
            f"{format_bytes(minimum.peak_bytes)}"
        )
    return InfeasibleBudgetError(message, minimum_bytes=minimum.peak_bytes, parts=dict(minimum.parts))


def candidate_key(candidate: Candidate) -> tuple[object, ...]:
    return (candidate.micro_batch_size, candidate.steps, candidate.block_policies)


def refuse_after_max_trials(
    chosen: Candidate, result: SearchResult, trials: int, max_trials: int, budget_bytes: int, notes: list[str]
) -> None:
    """After ``max_trials`` trials only the smallest plan (the last resort) may still be tried."""
    if trials >= max_trials and candidate_key(chosen) != candidate_key(result.minimum):
        raise InfeasibleBudgetError(
            f"no plan proved to fit memory={format_bytes(budget_bytes)} in {max_trials} trials: "
            + "; ".join(notes[-trials:]),
            minimum_bytes=result.minimum.peak_bytes,
            parts=dict(result.minimum.parts),
        )


def no_plan_error(
    profile: Profile,
    result: SearchResult,
    budget_bytes: int,
    trials: int,
    notes: Sequence[str],
    per_rank_batch: int,
) -> InfeasibleBudgetError:
    refuse_window_too_long(per_rank_batch, budget_bytes, result)
    if trials == 0:
        return infeasible_error(profile, result, budget_bytes)
    return InfeasibleBudgetError(
        f"no plan fits memory={format_bytes(budget_bytes)} after {trials} trial(s): "
        + "; ".join(notes[-trials:])
        + f". The smallest plan (micro-batch {result.minimum.micro_batch_size} with "
        f"{summarize_policies(result.minimum.block_policies)}) was tried or predicts more than the budget; "
        f"it needs at least {format_bytes(result.minimum.peak_bytes)} as predicted, more where a trial ran "
        "out of memory: raise memory, or free the device",
        minimum_bytes=result.minimum.peak_bytes,
        parts=dict(result.minimum.parts),
        minimum_is_lower_bound=True,
    )


def validate_batch(batch: int, world_size: int) -> int:
    for name, value in (("batch", batch), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if batch % world_size:
        raise ConfigError(
            f"batch={batch} is not divisible by world_size={world_size}: every rank must run the same number "
            f"of samples; choose a batch that is a multiple of {world_size}"
        )
    return batch // world_size
