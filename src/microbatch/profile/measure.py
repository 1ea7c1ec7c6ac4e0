"""Running the workload for the profile: the optimizer's step, and each policy at each size."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..accumulate import Accumulator
from ..batching import move_batch
from ..checkpoint import POLICIES, BlockSpec, checkpoint, find_blocks
from ..errors import CheckpointError, ConfigError, InfeasibleBudgetError, WorkloadError
from ..memory import MemoryTracker, device_memory_bytes
from ..oom import free_memory, is_out_of_memory
from ..workload import Workload
from .costs import BYTES_FLOOR, NONE, SECONDS_FLOOR, Fit, PolicyCost, Profile, SegmentProfile
from .timeline import BEFORE, END, END_FORWARD, Recorder, Run, SegmentRun, gap_names, split, unique_bytes

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]  # (what is running, runs done, runs in all)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Parameters, gradients, buffers, train/eval mode and the global RNG come back as they were.

    Copies live in host memory, so the device holds nothing extra while profiling.
    """
    tensors = [*model.parameters(), *model.buffers()]
    saved = [tensor.detach().to("cpu", copy=True) for tensor in tensors]
    grads = [(p, p.grad) for p in model.parameters()]
    modes = [(module, module.training) for module in model.modules()]
    devices = [d.index or 0 for d in {t.device for t in tensors} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, copy in zip(tensors, saved, strict=True):
                    tensor.copy_(copy)
            for parameter, grad in grads:
                parameter.grad = grad
            for module, training in modes:
                module.training = training


def _micro_batch(
    workload: Workload,
    blocks: Sequence[tuple[str, nn.Module]],
    size: int,
    device: torch.device,
    *,
    track: bool,
    optimizer: torch.optim.Optimizer,
) -> Run:
    """One forward and backward of a fresh batch of ``size``, cut into segments.

    The backward goes through Accumulator.backward, as in the planned training loop, so the
    loop's own tensors (the weighted loss, the running sums) are counted as they will be.
    """
    model = workload.model
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    batch = workload.make_batch(size)
    accumulator = Accumulator(model, optimizer, steps=2)
    tracker = MemoryTracker(device, model=model, optimizer=optimizer) if track else None
    recorder = Recorder(blocks, tracker=tracker, device=device)
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            recorder.mark(BEFORE)
            batch = move_batch(batch, device)
            loss, items = workload.loss(model, batch)
            recorder.mark(END_FORWARD)
            recorder.in_backward = True
            accumulator.backward(loss, items=items)
            recorder.mark(END)
            del loss, batch
    finally:
        recorder.close()
    order = recorder.order
    missing = [name for name, _ in blocks if name not in order]
    if missing:
        raise WorkloadError(
            f"profiling: block(s) {', '.join(missing[:3])} did not run in the forward of workload "
            f"{workload.name!r}; pass blocks= naming modules the forward calls"
        )
    return split(recorder, order, started)


def _measure_optimizer(
    workload: Workload, optimizer: torch.optim.Optimizer, size: int, device: torch.device
) -> tuple[dict[str, int], int, float] | None:
    """Static bytes by category, the step's transient bytes and its seconds, after a real step.

    None when the first training step runs out of memory.
    """
    model = workload.model
    out_of_memory = False
    try:
        loss, _ = workload.loss(model, move_batch(workload.make_batch(size), device))
        loss.backward()
        del loss
        optimizer.step()  # creates the optimizer's state
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
        out_of_memory = True
    if out_of_memory:
        free_memory(device)
        return None
    with MemoryTracker(device, model=model, optimizer=optimizer) as tracker:
        start_bytes = tracker.current_bytes
        static = dict(tracker.breakdown)  # at entry: what the model and the optimizer hold
        _window_step(model, optimizer)
    step_peak_bytes = max(0, tracker.peak_bytes - start_bytes)
    timings = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        _window_step(model, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - began)
    return static, step_peak_bytes, statistics.median(timings)


def _window_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What Accumulator.step does besides the optimizer: rescale the gradients once, take their norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0)
        nn.utils.get_total_norm(grads, foreach=True)
    optimizer.step()


def default_micro_batch_sizes(max_micro_batch_size: int) -> tuple[int, ...]:
    """Up to three sizes: 1, half of ``max_micro_batch_size`` and all of it.

    Size 1 pins down the fixed costs (per-call overheads, parameter-sized temporaries) that
    dominate small micro-batches; the larger two the per-sample costs.
    """
    top = max(1, max_micro_batch_size)
    return tuple(sorted({1, max(1, top // 2), top}))


def default_policies(device: torch.device) -> tuple[str, ...]:
    """none, full and selective; offload too where the device is not host memory."""
    return (NONE, "full", "selective", *(("offload",) if device.type != "cpu" else ()))


def profile_workload(
    workload: Workload,
    *,
    micro_batch_sizes: Sequence[int] | None = None,
    max_micro_batch_size: int = 16,
    blocks: BlockSpec = "auto",
    policies: Sequence[str] | None = None,
    repeats: int = 3,
    warmup: int = 0,
    progress: ProgressFn | None = None,
) -> Profile:
    """Measure ``workload`` for the planner (see the package docstring).

    ``micro_batch_sizes`` defaults to 1, half of ``max_micro_batch_size`` and all of it. Each
    (policy, size) gets tracked runs for memory under a fresh checkpoint: its first call and the
    steady state after it. Then ``warmup`` untimed and ``repeats`` timed rounds run every
    (policy, size) once each, in turn, so that a slow moment of a shared machine hits every policy
    alike. Sizes that run out of memory are dropped. The batches come from the workload's
    make_batch; the model is left as it was.
    """
    began = time.perf_counter()
    model, device = workload.model, workload.device
    sizes = sorted(set(micro_batch_sizes or default_micro_batch_sizes(max_micro_batch_size)))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"micro_batch_sizes must be positive integers, got {micro_batch_sizes!r}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    found, chosen, notes = _blocks_and_policies(model, blocks, policies, device)
    with preserved_state(model):
        model.train()
        for parameter in model.parameters():
            parameter.grad = None
        optimizer = workload.make_optimizer()
        step = _measure_optimizer(workload, optimizer, sizes[0], device)
        if step is None:
            raise InfeasibleBudgetError(
                f"workload {workload.name!r} runs out of memory on {device} in one training step at "
                f"micro-batch {sizes[0]}, before any plan: the model and its optimizer state do not fit",
                minimum_bytes=device_memory_bytes(device),
            )
        session = _Session(workload, found, optimizer, chosen, sizes, progress)
        session.notes.extend(notes)
        checkpointed = len(chosen) - 1
        session.total_runs = len(sizes) * (1 + 2 * checkpointed) + (warmup + repeats) * (
            len(chosen) * len(sizes) + checkpointed
        )
        session.measure_memory()
        session.measure_time(warmup=warmup, repeats=repeats)
    if progress is not None:
        progress("done", session.total_runs, session.total_runs)
    static, step_peak_bytes, step_seconds = step
    return _assemble(
        workload=workload,
        device=device,
        sizes=session.sizes,
        policies=session.policies,
        memory_runs=session.memory_runs,
        first_runs=session.first_runs,
        timed_runs=session.timed_runs,
        static=static,
        optimizer_name=type(optimizer).__name__,
        step_peak_bytes=step_peak_bytes,
        step_seconds=step_seconds,
        gradient_bytes=_gradient_bytes(model, found),
        notes=session.notes,
        seconds=time.perf_counter() - began,
    )


def _blocks_and_policies(
    model: nn.Module, blocks: BlockSpec, policies: Sequence[str] | None, device: torch.device
) -> tuple[list[tuple[str, nn.Module]], tuple[str, ...], list[str]]:
    """The blocks to profile, the policies to run them under ("none" first), and notes."""
    chosen = tuple(policies) if policies is not None else default_policies(device)
    unknown = [p for p in chosen if p not in (NONE, *POLICIES)]
    if unknown:
        raise ConfigError(
            f"policies: {unknown} are not checkpoint policies; choose from none, {', '.join(POLICIES)}"
        )
    chosen = chosen if NONE in chosen else (NONE, *chosen)
    try:
        return find_blocks(model, blocks), chosen, []
    except CheckpointError:
        if blocks != "auto":
            raise
    # Nothing repeats: the micro-batch size is still worth planning, without checkpointing.
    note = (
        f"blocks='auto' found no repeated blocks in {type(model).__name__}: planning the micro-batch "
        "size only; name blocks (blocks=[...], --blocks) to let the planner checkpoint them"
    )
    return [], (NONE,), [note]


class _Session:
    """The state of one profiling: the sizes still in play, the runs so far, progress."""

    def __init__(
        self,
        workload: Workload,
        blocks: Sequence[tuple[str, nn.Module]],
        optimizer: torch.optim.Optimizer,
        policies: tuple[str, ...],
        sizes: list[int],
        progress: ProgressFn | None,
    ) -> None:
        self.workload, self.blocks, self.optimizer = workload, blocks, optimizer
        self.policies, self.sizes, self.progress = policies, sizes, progress
        self.memory_runs: dict[tuple[str, int], Run] = {}
        self.first_runs: dict[tuple[str, int], Run] = {}
        self.timed_runs: dict[tuple[str, int], list[Run]] = {}
        self.notes: list[str] = []
        self.total_runs = self.done_runs = 0

    def measure_memory(self) -> None:
        """Tracked runs: under a fresh checkpoint per size, its first call, then the steady state."""
        for policy in self.policies:
            for size in list(self.sizes):
                if size not in self.sizes:
                    break
                with self.applied(policy):
                    first = self.run(policy, size, track=True)
                    steady = self.run(policy, size, track=True) if first and policy != NONE else first
                if first is None or steady is None:
                    break
                self.first_runs[policy, size] = first
                self.memory_runs[policy, size] = steady

    def measure_time(self, *, warmup: int, repeats: int) -> None:
        """Timed runs, round by round; each checkpoint's first (learning) call is not timed."""
        for round_index in range(warmup + repeats):
            for policy in self.policies:
                with self.applied(policy):
                    if policy != NONE and self.run(policy, self.sizes[0], track=False) is None:
                        continue
                    for size in list(self.sizes):
                        timed = self.run(policy, size, track=False)
                        if timed is None:
                            break
                        if round_index >= warmup:
                            self.timed_runs.setdefault((policy, size), []).append(timed)

    def applied(self, policy: str) -> contextlib.AbstractContextManager[Any]:
        """Every block under ``policy`` for the duration of the ``with`` block."""
        if policy == NONE:
            return contextlib.nullcontext()
        return checkpoint(self.workload.model, policy={name: policy for name, _ in self.blocks})

    def run(self, policy: str, size: int, *, track: bool) -> Run | None:
        """One micro-batch; None when it ran out of memory (the size and larger ones are dropped)."""
        if self.progress is not None:
            self.progress(f"policy {policy}, micro-batch {size}", self.done_runs, self.total_runs)
        self.done_runs += 1
        device = self.workload.device
        out_of_memory = False
        try:
            return _micro_batch(
                self.workload, self.blocks, size, device, track=track, optimizer=self.optimizer
            )
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        if out_of_memory:  # outside the handler, so the failed run's tensors can be freed
            free_memory(device)
        self.notes.append(
            f"micro-batch {size} ran out of memory while profiling (policy {policy}); dropped it"
        )
        self.sizes[:] = [s for s in self.sizes if s < size]
        for runs in (self.memory_runs, self.first_runs, self.timed_runs):
            for key in [key for key in runs if key[1] >= size]:
                del runs[key]
        if not self.sizes:
            raise InfeasibleBudgetError(
                f"workload {self.workload.name!r} runs out of memory on {device} at micro-batch {size} "
                f"with policy {policy}, the smallest size profiled",
                minimum_bytes=device_memory_bytes(device),
            )
        return None


def _gradient_bytes(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> dict[str, int]:
    """Gradient bytes per segment: a block's own parameters; the rest to the part after the blocks,
    whose backward runs first (a conservative place for embeddings and tied weights)."""
    seen: set[int] = set()
    result: dict[str, int] = {}
    for name, module in blocks:
        params = [p for p in module.parameters() if p.requires_grad]
        result[name] = unique_bytes(params, seen)
    rest = [p for p in model.parameters() if p.requires_grad]
    result[gap_names([name for name, _ in blocks])[-1]] = unique_bytes(rest, seen)
    return result


def _activation_peak(parts: Sequence[tuple[float, float]]) -> float:
    """max_k (P_{k-1} + peak_k) over a chain of (kept_bytes, peak_bytes): see planner/solve.py."""
    kept, peak = 0.0, 0.0
    for kept_bytes, peak_bytes in parts:
        peak = max(peak, kept + peak_bytes)
        kept += kept_bytes
    return peak


def _policy_cost(
    sizes: Sequence[int],
    *,
    steady: Sequence[SegmentRun],
    first: Sequence[SegmentRun],
    timed: Sequence[Sequence[SegmentRun]],
) -> PolicyCost:
    """One segment's fits under one policy: bytes from the tracked runs, seconds from the timed ones."""

    def bytes_fit(runs: Sequence[SegmentRun], quantity: str) -> Fit:
        return Fit.of(sizes, [getattr(run, quantity) for run in runs], interpolate=True)

    def seconds_fit(quantity: str) -> Fit:
        medians = [statistics.median(getattr(run, quantity) for run in runs) for runs in timed]
        return Fit.of(sizes, medians, nonnegative=True)

    differs = any(
        (a.kept_bytes, a.peak_bytes) != (b.kept_bytes, b.peak_bytes)
        for a, b in zip(first, steady, strict=True)
    )
    return PolicyCost(
        kept_bytes=bytes_fit(steady, "kept_bytes"),
        peak_bytes=bytes_fit(steady, "peak_bytes"),
        forward_seconds=seconds_fit("forward_seconds"),
        backward_seconds=seconds_fit("backward_seconds"),
        first_kept_bytes=bytes_fit(first, "kept_bytes") if differs else None,
        first_peak_bytes=bytes_fit(first, "peak_bytes") if differs else None,
    )


def _assemble(
    *,
    workload: Workload,
    device: torch.device,
    sizes: Sequence[int],
    policies: Sequence[str],
    memory_runs: Mapping[tuple[str, int], Run],
    first_runs: Mapping[tuple[str, int], Run],
    timed_runs: Mapping[tuple[str, int], Sequence[Run]],
    static: Mapping[str, int],
    optimizer_name: str,
    step_peak_bytes: int,
    step_seconds: float,
    gradient_bytes: Mapping[str, int],
    notes: list[str],
    seconds: float,
) -> Profile:
    """Fit every measured quantity over the sizes and build the Profile."""
    reference = memory_runs[NONE, sizes[0]]
    block_names = set(reference.order)
    segments: list[SegmentProfile] = []
    not_linear: list[str] = []
    for name in reference.segments:
        is_block = name in block_names
        costs: dict[str, PolicyCost] = {}
        for policy in policies if is_block else (NONE,):
            cost = _policy_cost(
                sizes,
                steady=[memory_runs[policy, size].segments[name] for size in sizes],
                first=[first_runs[policy, size].segments[name] for size in sizes],
                timed=[[run.segments[name] for run in timed_runs[policy, size]] for size in sizes],
            )
            for quantity in ("kept_bytes", "peak_bytes", "forward_seconds", "backward_seconds"):
                fit: Fit = getattr(cost, quantity)
                floor = BYTES_FLOOR if quantity.endswith("bytes") else SECONDS_FLOOR
                if not fit.is_linear(floor=floor):
                    not_linear.append(f"{name} {policy} {quantity} ({fit.relative_miss():.0%})")
            costs[policy] = cost
        boundary = Fit.of(sizes, [memory_runs[NONE, size].boundary_bytes.get(name, 0) for size in sizes])
        segments.append(
            SegmentProfile(
                name=name,
                is_block=is_block,
                costs=costs,
                boundary_bytes=boundary,
                gradient_bytes=gradient_bytes.get(name, 0),
            )
        )
    if not_linear:  # for the curious only: the planner's ties (time_noise) absorb such misses
        logger.debug("profile of %s: not linear in the micro-batch size: %s", workload.name, not_linear)
    if not all(run.in_order for run in memory_runs.values()):
        notes.append("the blocks' backward passes did not run in reverse forward order; peaks may be off")

    parameter_bytes = static.get("parameters", 0)
    gradient_total = static.get("gradients", 0)
    optimizer_bytes = static.get("optimizer state", 0)
    static_bytes = parameter_bytes + gradient_total + optimizer_bytes
    none_runs = [memory_runs[NONE, size] for size in sizes]
    base = Fit.of(sizes, [max(0, run.start_bytes - static_bytes) for run in none_runs], interpolate=True)
    outside_segments = [
        statistics.median(
            max(0.0, run.seconds - sum(s.forward_seconds + s.backward_seconds for s in run.segments.values()))
            for run in timed_runs[NONE, size]
        )
        for size in sizes
    ]
    loop = Fit.of(sizes, outside_segments, nonnegative=True)
    # Slack: how far each tracked run's peak exceeded what the fitted chain predicts for it.
    slack = 0.0
    for runs, first_call in ((memory_runs, False), (first_runs, True)):
        for (policy, size), run in runs.items():
            parts = []
            for segment in segments:
                cost = segment.costs.get(policy, segment.costs[NONE])
                parts.append((cost.kept(size, first=first_call), cost.peak(size, first=first_call)))
            predicted = static_bytes + base(size) + _activation_peak(parts)
            slack = max(slack, run.peak_bytes - predicted)
    for note in notes:
        logger.debug("profile of %s: %s", workload.name, note)  # also in the plan's notes
    return Profile(
        name=workload.name,
        device=str(device),
        micro_batch_sizes=tuple(sizes),
        segments=tuple(segments),
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_total,
        optimizer_bytes=optimizer_bytes,
        optimizer_name=optimizer_name,
        base_bytes=base,
        step_peak_bytes=step_peak_bytes,
        step_seconds=step_seconds,
        loop_seconds=loop,
        slack_bytes=math.ceil(slack),
        profile_seconds=seconds,
        notes=tuple(notes),
        time_noise=_time_noise(timed_runs),
    )


def _time_noise(timed_runs: Mapping[tuple[str, int], Sequence[Run]]) -> float:
    """The median over (policy, size) of the timed rounds' (max - min) / median seconds."""
    spreads = []
    for runs in timed_runs.values():
        seconds = [run.seconds for run in runs]
        middle = statistics.median(seconds) if seconds else 0.0
        if len(seconds) >= 2 and middle > 0:
            spreads.append((max(seconds) - min(seconds)) / middle)
    return statistics.median(spreads) if spreads else 0.0
