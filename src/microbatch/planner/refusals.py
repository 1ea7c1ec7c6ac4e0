"""What the planner refuses, and how it says so: budgets below the weights, a make_batch that returns
the wrong number of samples, a batch that needs too many micro-batches per window, no plan that
fits (before or after trials). Every refusal names the minimum memory and what it is made of."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ConfigError, InfeasibleBudgetError, MicrobatchError, WorkloadError
from ..memory import format_bytes, format_bytes_at_least
from ..memory.optimizer_state import optimizer_state_bytes
from ..profile import Profile
from ..trees.batches import batch_size_of, tensor_bytes
from ..workload import Workload
from .result.plans import summarize_policies
from .search.sizes import Candidate, SearchResult
from .search.splits import MAX_STEPS_PER_WINDOW
from .target.reserve import BudgetReserve


def _outside(reserve: BudgetReserve | None) -> tuple[tuple[str, int], ...]:
    return reserve.parts if reserve is not None else ()


def _budget_words(model_budget_bytes: int, reserve: BudgetReserve | None) -> str:
    """The budget as the user gave it (the model's share plus what lives outside the model)."""
    outside = _outside(reserve)
    words = f"memory={format_bytes(model_budget_bytes + sum(v for _, v in outside))}"
    if outside:
        words += f" ({' + '.join(f'{n} {format_bytes(v)}' for n, v in outside)} of it outside the model)"
    return words


def _terms(parts: dict[str, int], reserve: BudgetReserve | None) -> str:
    named = (*_outside(reserve), *parts.items())
    return " + ".join(f"{name} {format_bytes(value)}" for name, value in named if value)


def refusal(
    message: str,
    model_minimum_bytes: int,
    parts: dict[str, int],
    reserve: BudgetReserve | None,
    *,
    lower_bound: bool = False,
) -> InfeasibleBudgetError:
    """The error for a budget refused: its one minimum is stated like the budget (the reserve added)."""
    outside = _outside(reserve)
    return InfeasibleBudgetError(
        message,
        minimum_bytes=model_minimum_bytes + sum(v for _, v in outside),
        parts={**dict(outside), **parts},
        minimum_is_lower_bound=lower_bound,
    )


def static_message(profile: Profile, budget_bytes: int, reserve: BudgetReserve | None = None) -> str | None:
    """When the static memory (plus the step's own peak) alone exceeds the budget, the words for it."""
    parts = profile.static_parts()
    total = sum(parts.values())
    if total + profile.step_peak_bytes <= budget_bytes:
        return None
    exceed = (
        "already exceed"
        if total > budget_bytes
        else (f"plus the {profile.step_peak_name} {format_bytes(profile.step_peak_bytes)} exceed")
    )
    outside = sum(v for _, v in _outside(reserve))
    return (
        f"{_terms(parts, reserve)} = {format_bytes(total + outside)} {exceed} the budget "
        f"{_budget_words(budget_bytes, reserve)}; no micro-batch size or checkpointing can fit"
    )


def refuse_budget_below_weights(
    workload: Workload, budget_bytes: int, reserve: BudgetReserve | None = None, *, shards: int = 1
) -> None:
    """Fail before profiling when parameters, gradients and optimizer state alone exceed the budget.

    The optimizer state is counted without allocating it (optimizer_state.optimizer_state_bytes:
    one dry step on the meta device, or the optimizer's known factor). The sum is a lower bound of
    every plan's peak (activations, the batch and temporaries come on top, unmeasured: nothing
    runs), and the error says so. ``budget_bytes``: the model's share of the budget (less
    ``reserve``). ``shards``: FSDP ranks sharing them.
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
    if total <= budget_bytes:
        return
    least = format_bytes_at_least(total + sum(v for _, v in _outside(reserve)))
    raise refusal(
        f"{_terms(parts, reserve)} = {least} already exceed the budget "
        f"{_budget_words(budget_bytes, reserve)}, "
        f"before any activation; no micro-batch size or checkpointing can fit. Every plan needs at least "
        f"{least} plus its activations, which are not measured: refused before profiling, so the exact "
        f"minimum is named only by planning with memory above {least}. "
        + _state_levers(parts, budget_bytes, shards),
        total,
        parts,
        reserve,
        lower_bound=True,
    )


def _state_levers(parts: dict[str, int], budget_bytes: int, shards: int) -> str:
    """The levers that shrink parameters, gradients and optimizer state, with the bytes each saves: the
    exact ones first (the same gradient), then those that change the training, marked as such. The
    loss head in chunks and a fused step cut activations and temporaries, not these, so they are not
    named (planner/levers/exact.py names them when a profile shows they would help)."""
    _, gradient_bytes, state_bytes = parts.values()
    static = sum(parts.values())
    # FSDP shards all three over the ranks: the smallest power of two that brings them under the budget
    # (activations come on top, so it is a lower bound on the ranks).
    doublings = max(1, math.ceil(math.log2(static / budget_bytes))) if budget_bytes > 0 else 1
    ranks = shards * 2**doublings
    exact = [
        f"FSDP over at least {ranks} ranks (shard='fsdp', world_size={ranks}): saves "
        f"{format_bytes(static - static * shards // ranks)} of parameters, gradients and optimizer state "
        "per rank",
        f"CPU offload of the optimizer state (not offered by microbatch; FSDP2's CPUOffloadPolicy, "
        f"DeepSpeed ZeRO-Offload): saves up to {format_bytes(state_bytes)}",
    ][: 2 if state_bytes else 1]
    changing = [
        f"8-bit optimizer state: saves about {format_bytes(state_bytes * 3 // 4)}",
        f"a stateless optimizer (SGD without momentum): saves {format_bytes(state_bytes)}",
    ] * bool(state_bytes) + [
        f"LoRA (frozen base weights): saves most of the gradients and optimizer state, up to "
        f"{format_bytes(gradient_bytes + state_bytes)}",
    ]
    return (
        "Exact levers (the same gradient): "
        + "; ".join(exact)
        + ". Levers that change the training: "
        + "; ".join(f"{line} [changes training]" for line in changing)
    )


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


def refuse_window_too_long(
    per_rank_batch: int, budget_bytes: int, result: SearchResult, reserve: BudgetReserve | None = None
) -> None:
    """A batch that needs more micro-batches per step than a window may have: a clear refusal."""
    least = -(-per_rank_batch // MAX_STEPS_PER_WINDOW)
    if least <= 1 or result.best is not None:
        return
    minimum = result.minimum
    outside = sum(v for _, v in _outside(reserve))
    raise refusal(
        f"batch of {per_rank_batch:,} samples per rank: within {MAX_STEPS_PER_WINDOW:,} micro-batches per "
        f"optimizer step a micro-batch must hold at least {least:,} samples, and none that large fits "
        f"{_budget_words(budget_bytes, reserve)} (the smallest such plan needs "
        f"{format_bytes_at_least(minimum.peak_bytes + outside)}); lower the batch, or raise memory",
        minimum.peak_bytes,
        dict(minimum.parts),
        reserve,
    )


def _smallest(minimum: Candidate) -> str:
    return (
        f"micro-batch {minimum.micro_batch_size} x {minimum.steps} steps with "
        f"{summarize_policies(minimum.block_policies)}"
    )


def infeasible_error(
    profile: Profile, result: SearchResult, budget_bytes: int, reserve: BudgetReserve | None = None
) -> InfeasibleBudgetError:
    """The error for a budget below every plan, naming one minimum: the smallest plan's peak as the
    search predicts it (with the safety margin, which covers the model's error in a trial), and its parts."""
    minimum = result.minimum
    need = format_bytes_at_least(minimum.peak_bytes + sum(v for _, v in _outside(reserve)))
    static = static_message(profile, budget_bytes, reserve)
    budget = _budget_words(budget_bytes, reserve)
    lead = f"{static}. The smallest plan" if static else f"no plan fits {budget}: the smallest"
    message = (
        f"{lead}, {_smallest(minimum)}, needs {need} = {_terms(dict(minimum.parts), reserve)}. "
        f"Raise memory to at least {need}"
    )
    return refusal(message, minimum.peak_bytes, dict(minimum.parts), reserve)


def candidate_key(candidate: Candidate) -> tuple[object, ...]:
    return (candidate.micro_batch_size, candidate.steps, candidate.block_policies)


def refuse_after_max_trials(
    chosen: Candidate,
    result: SearchResult,
    trials: int,
    max_trials: int,
    budget_bytes: int,
    notes: list[str],
    reserve: BudgetReserve | None = None,
) -> None:
    """After ``max_trials`` trials only the smallest plan (the last resort) may still be tried.
    ``budget_bytes``: the model's share of the budget."""
    if trials >= max_trials and candidate_key(chosen) != candidate_key(result.minimum):
        raise refusal(
            f"no plan proved to fit {_budget_words(budget_bytes, reserve)} in {max_trials} trials "
            f"(raise max_trials, or memory): " + "; ".join(notes[-trials:]),
            result.minimum.peak_bytes,
            dict(result.minimum.parts),
            reserve,
        )


def no_plan_error(
    profile: Profile,
    result: SearchResult,
    budget_bytes: int,
    trials: int,
    notes: Sequence[str],
    per_rank_batch: int,
    reserve: BudgetReserve | None = None,
    *,
    out_of_memory: bool = False,
) -> InfeasibleBudgetError:
    """No plan left: before any trial, the smallest plan's prediction; after trials, that prediction
    corrected by what the trials measured (a lower bound when a trial ran out of memory: the failed
    plan's real peak is unknown)."""
    refuse_window_too_long(per_rank_batch, budget_bytes, result, reserve)
    if trials == 0:
        return infeasible_error(profile, result, budget_bytes, reserve)
    minimum = result.minimum
    need = format_bytes_at_least(minimum.peak_bytes + sum(v for _, v in _outside(reserve)))
    why = (
        f"at least {need} (a trial ran out of memory before its peak, so its real need is unknown): raise "
        "memory above it, or free the device"
        if out_of_memory
        else f"{need} (predicted, corrected by the trials' measurements): raise memory to at least {need}"
    )
    return refusal(
        f"no plan fits {_budget_words(budget_bytes, reserve)} after {trials} trial(s). The smallest plan, "
        f"{_smallest(minimum)}, needs {why}. Trials: " + "; ".join(notes[-trials:]),
        minimum.peak_bytes,
        dict(minimum.parts),
        reserve,
        lower_bound=out_of_memory,
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
