"""``plan()``: profile, search, prove the choice in one real window, re-plan until it fits.

The trial runs one optimizer step of the chosen plan (its checkpointing, its micro-batches, the
Accumulator, the workload's optimizer with its state already created) under MemoryTracker, and
on CUDA reads the allocator's peak too. The window is cut to its first two micro-batches: from the
second on, every micro-batch starts from the same live memory (parameters, gradients, optimizer
state), so later ones repeat the second one's peak and the step's peak comes after them. Then:

- measured peak <= budget: done; the plan reports predicted and measured peak.
- measured peak > budget on the profile's kind of rows: the model under-predicted by e = measured -
  predicted; every prediction gets e added and the search runs again. When the trial drew heavier
  rows than the profile (proof/trial_data.py), that is data, not model error: re-profile on them.
- out-of-memory error: plans predicted above the midpoint between the smallest plan and the failed
  one (before correction) are ruled out (the failed plan never reached its peak); search again.

Predictions carry a safety margin (search.SAFETY_MARGIN) for plans nobody has run. So the first
trial goes to the fastest plan predicted near the budget without it (up to choices.TRIAL_REACH
over), when that is faster than the safe choice: if its measured peak fits, the measurement is the
proof (its predicted peak may then exceed the budget); if not, the safe plan is next.

Each round rules out at least the plan that failed, so the loop ends after ``max_trials`` rounds
(InfeasibleBudgetError). A proved choice with rivals the prediction cannot tell apart is raced
against them on the real model, the fastest measured kept (proof/race.py; ``race=False`` skips it).
Nothing it runs changes the model (parameters, buffers, mode, RNG kept).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import distributed
from ..checkpointing.compiled import eager_workload
from ..errors import InfeasibleBudgetError, MicrobatchError
from ..memory import format_bytes
from ..memory.allocator import allocator_capacity
from ..memory.device_specs import DeviceSpec
from ..profile import Profile, profile_workload
from ..workload import Workload, load_workload
from .levers.exact import search_with_levers
from .levers.head_choice import chosen_head
from .options import DEFAULT_MAX_PROFILE_SIZE, PlanOptions
from .outcome import PlanRequest, Setup, plan_of
from .pipeline.choose import ranks_of
from .pipeline.on_ranks import plan_pipeline
from .proof.choices import faster_without_margin, hands_within_margin, last_resort
from .proof.race import race_rivals
from .proof.trial_data import TrialData, differs_from_profile, recording, reprofile_on_trial_data
from .proof.trial_run import TrialResult, attempt_trial
from .refusals import (
    candidate_key,
    check_make_batch,
    no_plan_error,
    refuse_after_max_trials,
    refuse_budget_below_weights,
    validate_batch,
)
from .result.plans import Plan, summarize_policies
from .search.extend import extend_profile
from .search.rules import SplitRules, even_batch, only_policies, profile_with_rules
from .search.sizes import Candidate, SearchResult, search
from .target.reserve import outside_the_model
from .target.sharding import rank_profile, with_wide_gradients
from .target.simulated import profile_for, resolve_target, target_budget

logger = logging.getLogger(__name__)


def plan(
    workload: Workload | str,
    *,
    batch: int,
    memory: str | int | float,
    options: PlanOptions | None = None,
    **keywords: Any,
) -> Plan:
    """The fastest plan for an effective batch of ``batch`` samples within ``memory`` bytes of peak.

    ``memory``: bytes, a size such as "8GiB", or a fraction of the device's memory (see parse_bytes).
    Every other option is a field of PlanOptions (planner/options.py: world_size, blocks, policies,
    profile, trial, device, simulate, shard, ...), passed as a keyword (``trial=False``) or as
    ``options=PlanOptions(...)`` (keywords then replace its fields). A torch.compile'd model is
    profiled eagerly (the module inside it). Without ``progress``, the planner still logs one INFO
    line per phase (profile, each trial, the choice) to ``logging.getLogger("microbatch.planner.planning")``.
    Raises InfeasibleBudgetError when no plan fits; never lets an out-of-memory error escape.

    ``pipeline=S``: the model cut into S stages (planner/pipeline/choose.py): ``world_size`` is every
    rank (W / S data-parallel replicas). Under torchrun with those W ranks every rank calls plan():
    every rank profiles, rank 0 searches, every rank proves its own stage in a trial window
    (planner/pipeline/on_ranks.py); elsewhere the plan is predicted only. Build the stages with
    ``plan.pipeline(model, example=..., loss_fn=...)``.
    """
    request = PlanRequest(workload, batch, memory, PlanOptions.of(options, keywords))
    if request.options.pipeline > 1:
        return plan_pipeline(request, compare=_without_pipeline)
    with distributed.single_process():
        return _plan(request)


def _without_pipeline(request: PlanRequest, profile: Profile) -> Plan | str:
    """The plan without a pipeline on the same ranks, from the pipeline's profile (no trial); or why
    there is none."""
    world, _ = ranks_of(request)
    options = dataclasses.replace(
        request.options, pipeline=1, pipeline_schedule=None, world_size=world, profile=profile, trial=False
    )
    quiet = [
        logging.getLogger(name)
        for name in ("microbatch.planner.planning", "microbatch.planner.target.simulated")
    ]
    levels = [log.level for log in quiet]
    for log in quiet:  # its choice is not the plan's: said once, in the pipeline plan's note
        log.setLevel(logging.WARNING)
    try:
        with distributed.single_process():
            return _plan(dataclasses.replace(request, options=options))
    except InfeasibleBudgetError:
        return "no plan fits the budget: the pipeline is needed"
    except MicrobatchError as error:
        return f"no such plan ({error})"
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def _plan(request: PlanRequest) -> Plan:
    began = time.perf_counter()
    with chosen_head(_prepare(request), request, _prepare) as setup:  # the exact levers: planner/levers/
        setup, (chosen, result, trials) = search_with_levers(_search_and_prove, setup, request)
        measured, count = trials.measured, trials.count
        return plan_of(setup, request, chosen, result, measured=measured, trials=count, began=began)


def _prepare(request: PlanRequest) -> Setup:
    """Check the request, refuse what cannot fit before profiling, then profile (or take the profile)."""
    options = request.options
    workload = load_workload(request.workload) if isinstance(request.workload, str) else request.workload
    workload, compile_notes = eager_workload(workload)
    world_size, shard = options.world_size, options.shard
    per_rank_batch = validate_batch(request.batch, world_size)
    rules = SplitRules(options.min_micro_batch_size, options.even, options.prefer_large_micro_batches)
    rules.check_batch(per_rank_batch, world_size)
    spec = resolve_target(workload, options.device, options.simulate)
    budget_bytes = target_budget(request.memory, spec, workload)
    reserve = outside_the_model(
        workload,
        budget_bytes,
        memory=request.memory,
        # shard="ddp" / "fsdp": ranks.shard_profile counts the data-parallel extras instead
        world_size=world_size if shard == "none" else 1,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
    )
    shards = world_size if shard == "fsdp" else 1
    refuse_budget_below_weights(workload, budget_bytes - reserve.total_bytes, reserve, shards=shards)
    data = TrialData()  # what the profile draws, to tell a trial's different data from a model error
    workload = recording(workload, data)
    bytes_per_sample = check_make_batch(workload, per_rank_batch)
    model_budget_bytes = budget_bytes - reserve.total_bytes
    measured = _measure(request, workload, rules, spec, per_rank_batch, model_budget_bytes, bytes_per_sample)
    profile, extras, gradient_sync = measured
    per_rank_batch, even_notes = even_batch(profile, per_rank_batch, model_budget_bytes, rules, world_size)
    notes = [*profile.notes, *reserve.notes, *compile_notes, *even_notes]
    return Setup(
        workload,
        profile,
        extras,
        spec,
        rules,
        reserve,
        budget_bytes,
        per_rank_batch,
        bytes_per_sample,
        notes,
        gradient_sync,
        data,
    )


def _measure(
    request: PlanRequest,
    workload: Workload,
    rules: SplitRules,
    spec: DeviceSpec | None,
    per_rank_batch: int,
    model_budget_bytes: int,
    bytes_per_sample: int,
) -> tuple[Profile, tuple[tuple[str, int], ...], str]:
    """The per-rank profile (measured, or the request's), its sharding extras and gradient sync."""
    options = request.options
    with allocator_capacity(_allocator_share(options, spec, model_budget_bytes)):
        profile = _profile(request, workload, rules, spec, per_rank_batch, model_budget_bytes)
    profile = with_wide_gradients(profile, workload.model, options.accumulate_dtype)
    return rank_profile(
        profile,
        workload.model,
        shard=options.shard,
        world_size=options.world_size,
        spec=spec,
        gradient_sync=options.gradient_sync,
        per_rank_batch=per_rank_batch,
        capacity_bytes=model_budget_bytes,
        rules=rules,
        bytes_per_sample=bytes_per_sample,
    )


def _reprofile(setup: Setup, request: PlanRequest) -> None:
    """The profile measured again on the last trial's heavier rows (proof/trial_data.py)."""

    def remeasure(pinned: Workload) -> None:
        setup.bytes_per_sample = check_make_batch(pinned, setup.per_rank_batch)
        setup.profile, setup.extras, setup.gradient_sync = _measure(
            request, pinned, setup.rules, setup.spec, setup.per_rank_batch,
            setup.model_budget_bytes, setup.bytes_per_sample,
        )  # fmt: skip

    setup.workload = reprofile_on_trial_data(setup.workload, setup.trial_data, remeasure, setup.notes)


def _real_profiler(options: PlanOptions) -> Callable[..., Profile]:
    """profile_workload with the step as the plan will run it (clipping: Accumulator's max_grad_norm)."""
    return functools.partial(profile_workload, max_grad_norm=options.max_grad_norm)


def _allocator_share(options: PlanOptions, spec: DeviceSpec | None, model_budget_bytes: int) -> int | None:
    """What the caching allocator may reserve under the budget, for the profile's replays
    (profile/reserved.py): the budget less what lies outside the allocator (the reserve, and a
    simulated device's context allowance). None for a sharded plan: its runs hold the whole
    model, not a rank's memory, so their replays are estimates (allocator.least_reserved)."""
    if options.shard != "none" and options.world_size > 1:
        return None
    return model_budget_bytes - (spec.context_bytes if spec is not None else 0)


def _profile(
    request: PlanRequest,
    workload: Workload,
    rules: SplitRules,
    spec: DeviceSpec | None,
    per_rank_batch: int,
    capacity_bytes: int,
) -> Profile:
    """The request's profile, or one measured (simulated on ``spec``) and extended to the choice."""
    options = request.options
    profile = options.profile
    extend = profile is None and options.max_profile_micro_batch_size is None and spec is None
    if profile is not None and options.policies is not None:
        profile = only_policies(profile, options.policies)
    if profile is None:
        kinds = {"blocks": options.blocks, "policies": options.policies, "progress": options.progress}
        largest = options.max_profile_micro_batch_size or DEFAULT_MAX_PROFILE_SIZE
        profile_fn = functools.partial(profile_for, spec=spec, real=_real_profiler(options))
        profile = profile_with_rules(profile_fn, workload, rules, per_rank_batch, largest, **kinds)
        logger.info(
            "planning %s: profiled %d blocks at micro-batch sizes %s in %.1f s",
            workload.name,
            len(profile.blocks),
            list(profile.micro_batch_sizes),
            profile.profile_seconds,
        )
    if extend:
        profile = extend_profile(
            workload,
            profile,
            per_rank_batch=per_rank_batch,
            capacity_bytes=capacity_bytes,
            blocks=options.blocks,
            progress=options.progress,
            rules=rules,
            profiler=_real_profiler(options),
        )
    return profile


@dataclass
class _Trials:
    """What the trials so far have taught the search."""

    count: int = 0
    correction_bytes: int = 0  # added to every prediction: the model under-predicted by this much
    # After an out-of-memory error, plans predicted (before correction) at or above this are out.
    oom_limit_bytes: float = math.inf
    out_of_memory: bool = False  # a trial ran out of memory
    measured: TrialResult | None = None  # the last trial's
    tried: set[tuple[object, ...]] = field(default_factory=set)


def _search_and_prove(setup: Setup, request: PlanRequest) -> tuple[Candidate, SearchResult, _Trials]:
    """Search, try the choice in one real window, re-plan until a trial fits (see the module docstring)."""
    # A sharded plan's per-rank memory cannot be run in this one process: it is predicted only.
    sharded = request.options.shard != "none" and request.options.world_size > 1
    trial = request.options.trial and setup.spec is None and not sharded
    if request.options.trial and setup.spec is None and sharded:
        setup.notes.append(
            f"shard={request.options.shard!r} over {request.options.world_size} ranks: no trial in this one "
            "process (each rank's memory is predicted); prove it on every rank under torchrun with "
            "microbatch.planner.prove(plan, workload)"
        )
    trials = _Trials()
    margin_free_pending = trial
    while True:
        capacity = min(setup.model_budget_bytes, trials.oom_limit_bytes - 1 + trials.correction_bytes)
        result = search(
            setup.profile,
            per_rank_batch=setup.per_rank_batch,
            capacity_bytes=capacity,
            correction_bytes=trials.correction_bytes,
            bytes_per_sample=setup.bytes_per_sample,
            **setup.rules.search_options(),
        )
        chosen, margin_free = result.best, False
        if margin_free_pending:
            # The safety margin guards plans nobody ran. A faster plan predicted near the budget
            # (choices.py) gets one trial first: if the measured peak fits, the measurement is the proof.
            margin_free_pending = False
            faster = faster_without_margin(
                setup.profile,
                setup.per_rank_batch,
                capacity,
                trials.correction_bytes,
                chosen,
                setup.rules,
                setup.bytes_per_sample,
            )
            if faster is not None:
                chosen, margin_free = faster, True
        if trials.out_of_memory:  # before giving up after out-of-memory trials: the smallest plan, once
            budget = setup.model_budget_bytes
            chosen = last_resort(
                chosen, trials.count >= request.options.max_trials, result, budget, trials.tried, setup.notes
            )
        if chosen is None:
            raise no_plan_error(
                setup.profile,
                result,
                setup.model_budget_bytes,
                trials.count,
                setup.notes,
                setup.per_rank_batch,
                setup.reserve,
                out_of_memory=trials.out_of_memory,
            )
        if not trial:
            return chosen, result, trials
        if _prove(setup, request, trials, chosen, result, margin_free=margin_free):
            return _raced(setup, request, trials, chosen, result, capacity), result, trials


def _raced(
    setup: Setup,
    request: PlanRequest,
    trials: _Trials,
    chosen: Candidate,
    result: SearchResult,
    capacity: float,
) -> Candidate:
    """``chosen`` (proved), or the fastest measured of it, its rivals and the hand strategies that
    fit only without the safety margin (proof/race.py)."""
    if not request.options.race or trials.measured is None or trials.out_of_memory:
        return chosen  # after an out-of-memory trial the device holds less than predicted: no more tries
    near_margin = hands_within_margin(
        setup.profile,
        setup.per_rank_batch,
        capacity,
        trials.correction_bytes,
        result,
        setup.rules,
        setup.bytes_per_sample,
    )
    budget, measured = setup.model_budget_bytes, trials.measured
    raced = race_rivals(
        setup.workload, setup.profile, request.options, budget, chosen, measured, result.rivals, near_margin
    )
    if raced is None:
        return chosen
    setup.notes.append(raced.note)
    logger.info("planning %s: %s", setup.workload.name, raced.note)
    trials.measured = raced.measured
    return raced.winner


def _prove(
    setup: Setup,
    request: PlanRequest,
    trials: _Trials,
    chosen: Candidate,
    result: SearchResult,
    *,
    margin_free: bool,
) -> bool:
    """One trial of ``chosen``: True when its measured peak fits; else what it taught goes into ``trials``."""
    notes = setup.notes
    budget, reserve = setup.model_budget_bytes, setup.reserve
    refuse_after_max_trials(chosen, result, trials.count, request.options.max_trials, budget, notes, reserve)
    trials.count += 1
    trials.tried.add(candidate_key(chosen))
    policies = summarize_policies(chosen.block_policies)
    what = f"micro-batch {chosen.micro_batch_size} x {chosen.steps} with {policies}"
    logger.info("planning %s: trial %d: %s", setup.workload.name, trials.count, what)
    if request.options.progress is not None:
        request.options.progress(f"trial {trials.count}: {what}", 0, 1)
    setup.trial_data.start_trial()
    measured = trials.measured = attempt_trial(setup.workload, chosen, request.options)
    over = measured is not None and measured.peak_bytes > setup.model_budget_bytes
    if over and request.options.profile is None and differs_from_profile(setup.trial_data):
        _reprofile(setup, request)  # a data difference: like with like, no correction
    elif measured is None:
        # The failed plan's real peak is unknown: bisect between the smallest plan and it.
        failed = chosen.peak_bytes - trials.correction_bytes
        floor = result.minimum.peak_bytes - trials.correction_bytes
        trials.oom_limit_bytes = min(trials.oom_limit_bytes, failed - max(1, (failed - floor) // 2))
        trials.out_of_memory = True
        notes.append(f"trial {trials.count}: {what} ran out of memory; re-planned below it")
    elif measured.peak_bytes > setup.model_budget_bytes:
        error_bytes = measured.peak_bytes - chosen.peak_bytes
        # A margin-free try was taken at the edge of the model (often its largest micro-batch, beyond
        # the profiled sizes, where predictions are extrapolated): its error says little about the
        # safe plan, which is next and proves itself (a flat 14.5 MiB from swin_t's 32 x 1 put every
        # plan above micro-batch 4 over a budget that checkpoint_sequential at 29 fits; issue 32).
        if not margin_free:
            trials.correction_bytes += max(1, error_bytes)
        notes.append(
            f"trial {trials.count}: {what} measured peak {format_bytes(measured.peak_bytes)} > budget "
            f"(predicted {format_bytes(chosen.peak_bytes)}); re-planned"
            + (
                f" with {format_bytes(trials.correction_bytes)} more per plan"
                if trials.correction_bytes
                else ""
            )
        )
    else:
        if margin_free:
            notes.append(
                f"trial {trials.count}: {what}, predicted {format_bytes(chosen.peak_bytes)} with the safety "
                f"margin, measured {format_bytes(measured.peak_bytes)} <= budget: the measurement proves it"
            )
        return True
    logger.info(notes[-1])
    return False
