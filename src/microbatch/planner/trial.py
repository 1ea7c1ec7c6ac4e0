"""``plan()``: profile, search, prove the choice in one real window, re-plan until it fits.

The trial runs one optimizer step of the chosen plan (its checkpointing, its micro-batches, the
Accumulator, the workload's optimizer with its state already created) under MemoryTracker, and
on CUDA reads the allocator's peak too. The window is cut to its first two micro-batches: from the
second on, every micro-batch starts from the same live memory (parameters, all gradients,
optimizer state), so the later ones of size b repeat the second one's peak, the short last one
stays below it, and the step's own peak comes after any of them. Then:

- measured peak <= budget: done; the plan reports predicted and measured peak.
- measured peak > budget: the model under-predicted by e = measured - predicted. Every prediction
  gets e added (a correction) and the search runs again; the failed plan now predicts over budget.
- out-of-memory error: memory is freed, and plans predicted above the midpoint between the
  smallest plan and the failed one (before correction) are ruled out; the search runs again. The
  failed plan never reached its peak, so the bisection is the most that is known.

Predictions carry a safety margin (search.SAFETY_MARGIN) for plans nobody has run. So the first
trial goes to the fastest plan that fits the budget without it, when that is faster than the
safe choice: if its measured peak fits, the measurement is the proof (its predicted peak, margin
included, may then exceed the budget by less than the margin); if not, the safe plan is next.

Each round rules out at least the plan that failed, so the loop ends; after ``max_trials`` rounds
without a fit the planner raises InfeasibleBudgetError. Nothing it runs changes the model: its
parameters, buffers, gradients, mode and the RNG are restored afterwards.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from ..accumulate import Accumulator
from ..batching import batch_size_of, move_batch
from ..checkpoint import BlockSpec, checkpoint
from ..compiled import eager_workload
from ..errors import ConfigError, InfeasibleBudgetError, MicrobatchError, WorkloadError
from ..memory import MemoryTracker, format_bytes
from ..oom import attempt, free_memory
from ..optimizer_state import optimizer_state_bytes
from ..profile import (
    NONE,
    Profile,
    ProgressFn,
    preserved_state,
    profile_workload,
)
from ..profile.stash import optimizer_instance
from ..workload import Workload, load_workload
from .plan import FrontierPoint, Plan, summarize_policies
from .ranks import shard_profile
from .reserve import BudgetReserve, outside_the_model, with_reserve
from .rules import SplitRules, batchnorm_note, beats, even_batch, profile_with_rules
from .search import Candidate, Model, SearchResult, search, tie_fraction
from .simulated import finish, profile_for, resolve_target, target_budget
from .tokens import token_budget
from .windows import MAX_STEPS_PER_WINDOW

logger = logging.getLogger(__name__)

DEFAULT_MAX_TRIALS = 6
DEFAULT_MAX_PROFILE_SIZE = 16


@dataclass(frozen=True)
class TrialResult:
    # On CUDA the caching allocator's peak reserved bytes (what an OOM is decided on); elsewhere
    # MemoryTracker's peak live tensor bytes. Memory outside the allocator is added by the caller.
    peak_bytes: int
    cuda_max_allocated_bytes: int | None
    cuda_max_reserved_bytes: int | None = None


def run_trial(workload: Workload, candidate: Candidate) -> TrialResult:
    """One optimizer step of ``candidate`` on the workload's model, under MemoryTracker.

    May raise an out-of-memory error; the model is restored either way.
    """
    model, device = workload.model, workload.device
    # Segments cached by earlier runs would count as reserved: start from what is alive.
    free_memory(device)
    with preserved_state(model, optimizer=optimizer_instance(workload)):
        model.train()
        optimizer = workload.make_optimizer()
        _create_optimizer_state(model, optimizer)
        policies = dict(candidate.block_policies)
        handle = checkpoint(model, policy=policies) if any(p != NONE for p in policies.values()) else None
        try:
            batches = [workload.make_batch(size) for size in trial_sizes(candidate.micro_batch_sizes)]

            def loader() -> Iterator[object]:
                # Each micro-batch reaches the device when its turn comes and is dropped after it.
                while batches:
                    yield move_batch(batches.pop(0), device)

            accumulator = Accumulator(model, optimizer, steps=len(batches))
            accumulator._warned_batchnorm = True  # the trial's cut window; the plan's note covers BatchNorm
            with MemoryTracker(device, model=model, optimizer=optimizer) as tracker:
                for micro in accumulator.iterate(loader()):
                    loss, items = workload.loss(model, micro.batch)
                    accumulator.backward(loss, items=items)
                    del loss
                    if micro.is_last:
                        accumulator.step()
        finally:
            if handle is not None:
                handle.remove()
            for parameter in model.parameters():
                parameter.grad = None
    measured = tracker.peak_bytes
    if tracker.cuda_max_reserved_bytes is not None:
        measured = max(measured, tracker.cuda_max_reserved_bytes)
    return TrialResult(measured, tracker.cuda_max_allocated_bytes, tracker.cuda_max_reserved_bytes)


def trial_sizes(micro_batch_sizes: Sequence[int]) -> list[int]:
    """The window cut to the micro-batches that reach its peak: the first two.

    [b, b] for N >= 3 (the second holds all gradients at full size), [b, r] for N = 2, [b] for N = 1.
    """
    return list(micro_batch_sizes[:2])


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients: the optimizer's state exists from the window's start, as in training."""
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for parameter in model.parameters():
        parameter.grad = None


def _static_message(profile: Profile, budget_bytes: int) -> str | None:
    parts = profile.static_parts()
    total = sum(parts.values())
    if total + profile.step_peak_bytes <= budget_bytes:
        return None
    terms = " + ".join(f"{name} {format_bytes(value)}" for name, value in parts.items() if value)
    exceed = (
        "already exceed"
        if total > budget_bytes
        else (f"plus the optimizer step's temporaries {format_bytes(profile.step_peak_bytes)} exceed")
    )
    return (
        f"{terms} = {format_bytes(total)} {exceed} the budget memory={format_bytes(budget_bytes)}; "
        "no micro-batch size or checkpointing can fit. Raise memory, or shrink the model or its "
        "optimizer state (a stateless or 8-bit optimizer, FSDP across more ranks)"
    )


def _refuse_budget_below_weights(
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


def _check_make_batch(workload: Workload, per_rank_batch: int) -> int:
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
        sample_bytes = _tensor_bytes(made) // size
    return sample_bytes


def _tensor_bytes(batch: object) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_tensor_bytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(value) for value in batch)
    return 0


def _refuse_window_too_long(per_rank_batch: int, budget_bytes: int, result: SearchResult) -> None:
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
    message = _static_message(profile, budget_bytes)
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


def _frontier(result: SearchResult, reserve_bytes: int = 0) -> tuple[FrontierPoint, ...]:
    """The search's frontier, its peaks stated like the budget (the reserve outside the model added)."""
    return tuple(
        FrontierPoint(
            micro_batch_size=c.micro_batch_size,
            steps=c.steps,
            block_policies=c.block_policies,
            predicted_peak_bytes=c.peak_bytes + reserve_bytes,
            seconds_per_step=c.seconds_per_step,
        )
        for c in result.frontier
    )


def _attempt(workload: Workload, candidate: Candidate) -> TrialResult | None:
    """The trial's result; None when it ran out of memory (memory freed)."""
    return attempt(lambda: run_trial(workload, candidate), workload.device)


def _faster_without_margin(
    profile: Profile,
    per_rank_batch: int,
    capacity: float,
    correction_bytes: int,
    safe: Candidate | None,
    rules: SplitRules | None = None,
    bytes_per_sample: int = 0,
) -> Candidate | None:
    """A plan faster than ``safe`` that fits the capacity without the safety margin (margin shown)."""
    rules = rules or SplitRules()
    bold = search(
        profile,
        per_rank_batch=per_rank_batch,
        capacity_bytes=capacity,
        correction_bytes=correction_bytes,
        safety_margin=0.0,
        bytes_per_sample=bytes_per_sample,
        **rules.search_options(),
    ).best
    tie = tie_fraction(profile)
    if bold is None or (safe is not None and not beats(bold, safe, prefer_large=rules.prefer_large, tie=tie)):
        return None  # not better beyond the timings' noise: the safe plan it is
    model = Model(profile, correction_bytes=correction_bytes, bytes_per_sample=bytes_per_sample)
    return model.evaluate(bold.micro_batch_sizes, dict(bold.block_policies))


def _extend_profile(
    workload: Workload,
    profile: Profile,
    *,
    per_rank_batch: int,
    capacity_bytes: int,
    blocks: BlockSpec,
    policies: Sequence[str] | None,
    progress: ProgressFn | None,
    rules: SplitRules | None = None,
) -> Profile:
    """The profile again, up to the micro-batch the search chooses, when that is beyond the sizes measured.

    Costs fitted on small micro-batches do not extrapolate to large ones (kernels leave the
    launch-bound regime, attention switches backends), so a choice beyond the profiled sizes is
    measured before it is trusted. Only a size the budget allows is profiled: the search chose it.
    """
    rules = rules or SplitRules()
    options = rules.search_options()
    best = search(profile, per_rank_batch=per_rank_batch, capacity_bytes=capacity_bytes, **options).best
    measured_up_to = max(profile.micro_batch_sizes, default=0)
    if best is None or best.micro_batch_size <= measured_up_to:
        return profile
    logger.info(
        "the search chose micro-batch %d, beyond the profiled sizes (up to %d): profiling up to it",
        best.micro_batch_size,
        measured_up_to,
    )
    size = best.micro_batch_size  # sizes no smaller than the rules allow
    options = {"blocks": blocks, "policies": policies, "progress": progress}
    return profile_with_rules(profile_workload, workload, rules, size, size, **options)


def _key(candidate: Candidate) -> tuple[object, ...]:
    return (candidate.micro_batch_size, candidate.steps, candidate.block_policies)


def _last_resort(
    chosen: Candidate | None,
    out_of_trials: bool,
    result: SearchResult,
    budget_bytes: int,
    tried: set[tuple[object, ...]],
    notes: list[str],
) -> Candidate | None:
    """The plan with the least predicted peak (smallest micro-batch, most checkpointing), if untried.

    After trials ran out of memory, the bisection of the predicted peak may rule out plans that fit
    (the model mispredicts what a device can hold): the smallest plan is tried before giving up.
    """
    if chosen is not None and not out_of_trials:
        return chosen
    smallest = result.minimum
    if _key(smallest) in tried or smallest.peak_bytes > budget_bytes:
        return None
    notes.append(f"trying the smallest plan after {len(tried)} trial(s), some out of memory")
    return smallest


def _refuse_after_max_trials(
    chosen: Candidate, result: SearchResult, trials: int, max_trials: int, budget_bytes: int, notes: list[str]
) -> None:
    """After ``max_trials`` trials only the smallest plan (the last resort) may still be tried."""
    if trials >= max_trials and _key(chosen) != _key(result.minimum):
        raise InfeasibleBudgetError(
            f"no plan proved to fit memory={format_bytes(budget_bytes)} in {max_trials} trials: "
            + "; ".join(notes[-trials:]),
            minimum_bytes=result.minimum.peak_bytes,
            parts=dict(result.minimum.parts),
        )


def _no_plan(
    profile: Profile,
    result: SearchResult,
    budget_bytes: int,
    trials: int,
    notes: Sequence[str],
    per_rank_batch: int,
) -> InfeasibleBudgetError:
    _refuse_window_too_long(per_rank_batch, budget_bytes, result)
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


def _validate(batch: int, world_size: int) -> int:
    for name, value in (("batch", batch), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if batch % world_size:
        raise ConfigError(
            f"batch={batch} is not divisible by world_size={world_size}: every rank must run the same number "
            f"of samples; choose a batch that is a multiple of {world_size}"
        )
    return batch // world_size


@distributed.single_process()
def plan(
    workload: Workload | str,
    *,
    batch: int,
    memory: str | int | float,
    world_size: int = 1,
    blocks: BlockSpec = "auto",
    policies: Sequence[str] | None = None,
    profile: Profile | None = None,
    trial: bool = True,
    max_trials: int = DEFAULT_MAX_TRIALS,
    max_profile_micro_batch_size: int | None = None,
    progress: ProgressFn | None = None,
    gradient_as_bucket_view: bool = False,
    min_micro_batch_size: int = 1,
    even: bool = False,
    prefer_large_micro_batches: bool = False,
    device: Any = None,
    simulate: bool = False,
    shard: str = "none",
) -> Plan:
    """The fastest plan for an effective batch of ``batch`` samples within ``memory`` bytes of peak.

    ``memory``: bytes, a size such as "8GiB", or a fraction of the device's memory (see parse_bytes).
    ``blocks`` / ``policies``: which blocks may be checkpointed and how (default: "auto", and none,
    full, selective, plus offload on accelerators). ``profile``: reuse one from ``profile_workload``.
    ``trial``: prove the plan in one real window (recommended; False trusts the model).
    ``device``: a torch device (profile there for real) or a DeviceSpec / preset name (simulate);
    ``simulate``: predict under fake tensors, no kernel run and no trial (see planner/simulated.py).
    ``shard``: none, ddp or fsdp across ``world_size`` ranks (per-rank memory, see planner/ranks.py).
    ``max_profile_micro_batch_size``: the largest size profiled; by default 16, extended to the
    micro-batch the search chooses when that is larger (profiled before it is trusted).
    ``gradient_as_bucket_view``: with world_size > 1 the plan counts DDP's gradient buckets, a
    second copy of the gradients, unless DDP will run with gradient_as_bucket_view=True.
    The budget: peak live tensor bytes on the CPU; on CUDA peak reserved bytes of the caching
    allocator plus what is measured outside it (see planner.reserve).
    ``min_micro_batch_size``, ``even``, ``prefer_large_micro_batches``: how the batch may be split
    (planner/rules.py). A torch.compile'd model is profiled eagerly (the module inside it).
    ``progress``: called as ``progress(what, done, total)`` while profiling runs (what is running,
    runs done, runs in all) and once per trial window (``total`` 1); the CLI draws it as a line.
    Without it, the planner still logs one INFO line per phase (profile, each trial, the choice)
    to ``logging.getLogger("microbatch.planner.trial")``.
    Raises InfeasibleBudgetError when no plan fits; never lets an out-of-memory error escape.
    """
    began = time.perf_counter()
    if isinstance(workload, str):
        workload = load_workload(workload)
    workload, compile_notes = eager_workload(workload)
    per_rank_batch = _validate(batch, world_size)
    rules = SplitRules(min_micro_batch_size, even, prefer_large_micro_batches)
    rules.check_batch(per_rank_batch, world_size)
    spec = resolve_target(workload, device, simulate)
    budget_bytes = target_budget(memory, spec, workload)
    reserve = outside_the_model(
        workload,
        budget_bytes,
        memory=memory,
        # shard="ddp" / "fsdp": ranks.shard_profile counts the data-parallel extras instead
        world_size=world_size if shard == "none" else 1,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    shards = world_size if shard == "fsdp" else 1
    _refuse_budget_below_weights(workload, budget_bytes - reserve.total_bytes, reserve, shards=shards)
    bytes_per_sample = _check_make_batch(workload, per_rank_batch)
    extend = profile is None and max_profile_micro_batch_size is None and spec is None
    if profile is None:
        options = {"blocks": blocks, "policies": policies, "progress": progress}
        largest = max_profile_micro_batch_size or DEFAULT_MAX_PROFILE_SIZE
        profile_fn = functools.partial(profile_for, spec=spec, real=profile_workload)
        profile = profile_with_rules(profile_fn, workload, rules, per_rank_batch, largest, **options)
        logger.info(
            "planning %s: profiled %d blocks at micro-batch sizes %s in %.1f s",
            workload.name,
            len(profile.blocks),
            list(profile.micro_batch_sizes),
            profile.profile_seconds,
        )
    if extend:
        profile = _extend_profile(
            workload,
            profile,
            per_rank_batch=per_rank_batch,
            capacity_bytes=budget_bytes - reserve.total_bytes,
            blocks=blocks,
            policies=policies,
            progress=progress,
            rules=rules,
        )
    profile, extras = shard_profile(profile, workload.model, shard=shard, world_size=world_size, spec=spec)
    trial = trial and spec is None
    # What the profiled model may use: the budget less what lives outside it (see BudgetReserve).
    model_budget_bytes = budget_bytes - reserve.total_bytes
    per_rank_batch, even_notes = even_batch(profile, per_rank_batch, model_budget_bytes, rules, world_size)
    batch = per_rank_batch * world_size
    notes = [*profile.notes, *reserve.notes, *compile_notes, *even_notes]
    correction_bytes = 0
    # After an out-of-memory error, plans predicted (before correction) at or above this are out.
    oom_limit_bytes = math.inf
    trials = 0
    measured: TrialResult | None = None
    margin_free_pending = trial
    out_of_memory = False  # a trial ran out of memory
    tried: set[tuple[object, ...]] = set()
    while True:
        capacity = min(model_budget_bytes, oom_limit_bytes - 1 + correction_bytes)
        result = search(
            profile,
            per_rank_batch=per_rank_batch,
            capacity_bytes=capacity,
            correction_bytes=correction_bytes,
            bytes_per_sample=bytes_per_sample,
            **rules.search_options(),
        )
        chosen, margin_free = result.best, False
        if margin_free_pending:
            # The safety margin guards plans nobody ran. A faster plan that fits without it gets one
            # trial first: if the measured peak fits, the measurement is the proof.
            margin_free_pending = False
            faster = _faster_without_margin(
                profile, per_rank_batch, capacity, correction_bytes, chosen, rules, bytes_per_sample
            )
            if faster is not None:
                chosen, margin_free = faster, True
        if out_of_memory:  # before giving up after out-of-memory trials: the smallest plan, once
            chosen = _last_resort(chosen, trials >= max_trials, result, model_budget_bytes, tried, notes)
        if chosen is None:
            raise with_reserve(
                _no_plan(profile, result, model_budget_bytes, trials, notes, per_rank_batch), reserve
            )
        if not trial:
            break
        _refuse_after_max_trials(chosen, result, trials, max_trials, budget_bytes, notes)
        trials += 1
        tried.add(_key(chosen))
        what = (
            f"micro-batch {chosen.micro_batch_size} x {chosen.steps} "
            f"with {summarize_policies(chosen.block_policies)}"
        )
        logger.info("planning %s: trial %d: %s", workload.name, trials, what)
        if progress is not None:
            progress(f"trial {trials}: {what}", 0, 1)
        measured = _attempt(workload, chosen)
        if measured is None:
            # The failed plan's real peak is unknown: bisect between the smallest plan and it.
            failed = chosen.peak_bytes - correction_bytes
            floor = result.minimum.peak_bytes - correction_bytes
            oom_limit_bytes = min(oom_limit_bytes, failed - max(1, (failed - floor) // 2))
            out_of_memory = True
            notes.append(f"trial {trials}: {what} ran out of memory; re-planned below it")
        elif measured.peak_bytes > model_budget_bytes:
            error_bytes = measured.peak_bytes - chosen.peak_bytes
            if error_bytes > 0 or not margin_free:  # a margin-free try that the margin covers needs none
                correction_bytes += max(1, error_bytes)
            notes.append(
                f"trial {trials}: {what} measured peak {format_bytes(measured.peak_bytes)} > budget "
                f"(predicted {format_bytes(chosen.peak_bytes)}); re-planned"
                + (f" with {format_bytes(correction_bytes)} more per plan" if correction_bytes else "")
            )
        else:
            if margin_free:
                notes.append(
                    f"trial {trials}: {what} fits without the model's safety margin: measured "
                    f"{format_bytes(measured.peak_bytes)} <= budget"
                )
            break
        logger.info(notes[-1])
    notes += [note for note in (batchnorm_note(workload.model, chosen, rules),) if note]
    logger.info(
        "planning %s: chose micro-batch %d x %d steps with %s in %.1f s",
        workload.name,
        chosen.micro_batch_size,
        chosen.steps,
        summarize_policies(chosen.block_policies),
        time.perf_counter() - began,
    )
    planned = Plan(
        workload=workload.name,
        batch_size=batch,
        world_size=world_size,
        micro_batch_size=chosen.micro_batch_size,
        steps=chosen.steps,
        micro_batch_sizes=tuple(chosen.micro_batch_sizes),
        block_policies=chosen.block_policies,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=chosen.peak_bytes + reserve.total_bytes,
        measured_peak_bytes=measured.peak_bytes + reserve.total_bytes if measured is not None else None,
        predicted_seconds_per_step=chosen.seconds_per_step,
        peak_parts=chosen.parts + reserve.parts,
        frontier=_frontier(result, reserve.total_bytes),
        minimum_bytes=result.minimum.peak_bytes + reserve.total_bytes,
        cuda_max_allocated_bytes=measured.cuda_max_allocated_bytes if measured is not None else None,
        trials=trials,
        planning_seconds=time.perf_counter() - began,
        notes=tuple(notes),
        max_tokens=token_budget(workload, chosen.micro_batch_size),
        parameters=sum(parameter.numel() for parameter in workload.model.parameters()),
        device=workload.device.type,
    )
    return finish(planned, workload=workload, profile=profile, spec=spec, shard=shard, extras=extras)
