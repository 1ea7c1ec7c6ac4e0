"""``profile_workload``: which runs to make (each policy at each size, timed rounds), and making them.

runs.py runs one micro-batch or the optimizer step; assemble.py fits the runs into a Profile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..checkpointing.api import POLICIES, BlockSpec, checkpoint, find_blocks
from ..checkpointing.auto_blocks import describe_blocks
from ..checkpointing.recompute import failed_block
from ..errors import CheckpointError, ConfigError, InfeasibleBudgetError
from ..memory import device_memory_bytes
from ..memory.oom import attempt, is_out_of_memory
from ..workload import Workload
from . import stash
from .assemble import Measurements, assemble, gradient_bytes_by_segment, time_noise
from .clocks import AUTO, clock_note, profiling_clock
from .costs import NONE, Profile
from .routing import routing_note
from .runs import measure_step, micro_batch_run, preserved_state
from .timeline import Run

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]  # (what is running, runs done, runs in all)
# Timed rounds are repeated until the fastest two of a typical (policy, size) agree to within this
# fraction, half the narrowest tie the planner uses (search/sizes.py: ties are 2 x the noise, at least
# MIN_TIE_FRACTION = 6 %; a settled noise below this changes no choice), or EXTRA_ROUNDS more were run
# (each round is about a fifth of a gpt-mini profile: planning time, issue 32).
STABLE_NOISE = 0.025
EXTRA_ROUNDS = 2


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


@distributed.single_process()
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
    clock: str = AUTO,
    max_grad_norm: float | None = None,
) -> Profile:
    """Measure ``workload`` for the planner (see the package docstring).

    ``micro_batch_sizes`` defaults to 1, half of ``max_micro_batch_size`` and all of it. Each
    (policy, size) gets tracked runs for memory under a fresh checkpoint: its first call and the
    steady state after it. Then ``warmup`` untimed and ``repeats`` timed rounds run every
    (policy, size) once each, in turn, so that a slow moment of a shared machine hits every policy
    alike. Sizes that run out of memory are dropped. The batches come from the workload's
    make_batch; the model is left as it was. ``clock``: "auto" (default), "wall" or "cpu", what the
    times are read from (clocks.py: "auto" is one thread's CPU time on a CPU device, the wall clock
    elsewhere). The step clips to ``max_grad_norm`` as the plan's Accumulator will."""
    began = time.perf_counter()
    model, device = workload.model, workload.device
    sizes = _checked_sizes(micro_batch_sizes, max_micro_batch_size, repeats=repeats, warmup=warmup)
    found, chosen, notes = _blocks_and_policies(model, blocks, policies, device)
    threads = torch.get_num_threads()
    with (
        profiling_clock(clock, device) as (clock_name, read_clock),
        preserved_state(model, optimizer=stash.optimizer_instance(workload)),
    ):
        model.train()
        model.zero_grad(set_to_none=True)
        optimizer = workload.make_optimizer()
        step = measure_step(
            workload, optimizer, sizes[0], device, clock=read_clock, max_grad_norm=max_grad_norm
        )
        if step is None:
            raise _no_room_for_one_step(workload, device, sizes[0])
        session = _Session(workload, found, optimizer, chosen, sizes, progress)
        session.clock = read_clock
        session.notes.extend(notes)
        routing = routing_note(model)
        if routing is not None:
            session.notes.append(routing)
        session.total_runs = _run_count(len(sizes), len(chosen), rounds=warmup + repeats)
        session.measure_memory()
        session.measure_time(warmup=warmup, repeats=repeats)
    if progress is not None:
        progress("done", session.total_runs, session.total_runs)
    note = clock_note(clock_name, threads)
    session.notes.extend([note] if note else [])
    measured = _measurements(session, step, type(optimizer).__name__, gradient_bytes_by_segment(model, found))
    seconds = time.perf_counter() - began
    return assemble(workload, device, measured, notes=session.notes, seconds=seconds, clock=clock_name)


def _measurements(
    session: _Session,
    step: tuple[dict[str, int], int, float],
    optimizer_name: str,
    gradient_bytes: dict[str, int],
) -> Measurements:
    """What profile_workload measured, for assemble: the session's runs and the optimizer step's."""
    static, step_peak_bytes, step_seconds = step
    return Measurements(
        sizes=session.sizes,
        policies=session.policies,
        memory_runs=session.memory_runs,
        first_runs=session.first_runs,
        timed_runs=session.timed_runs,
        static=static,
        optimizer_name=optimizer_name,
        step_peak_bytes=step_peak_bytes,
        step_seconds=step_seconds,
        gradient_bytes=gradient_bytes,
        failed={policy: frozenset(names) for policy, names in session.failed.items()},
    )


def _no_room_for_one_step(workload: Workload, device: torch.device, size: int) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"workload {workload.name!r} runs out of memory on {device} in one training step at "
        f"micro-batch {size}, before any plan: the model and its optimizer state do not fit",
        minimum_bytes=device_memory_bytes(device),
    )


def _checked_sizes(
    micro_batch_sizes: Sequence[int] | None, max_micro_batch_size: int, *, repeats: int, warmup: int
) -> list[int]:
    sizes = sorted(set(micro_batch_sizes or default_micro_batch_sizes(max_micro_batch_size)))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"micro_batch_sizes must be positive integers, got {micro_batch_sizes!r}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    return sizes


def _run_count(sizes: int, policies: int, *, rounds: int) -> int:
    """Runs in all: tracked (checkpointed policies twice: first call and steady) and timed rounds."""
    checkpointed = policies - 1
    return sizes * (1 + 2 * checkpointed) + rounds * (policies * sizes + checkpointed)


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
        found = find_blocks(model, blocks)
        return found, chosen, [f"blocks='auto' picked {describe_blocks(found)}"] if blocks == "auto" else []
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
        self.failed: dict[str, set[str]] = {}  # policy -> blocks profiled without it (it raised)
        self.total_runs = self.done_runs = 0
        self.clock: Callable[[], float] = time.perf_counter

    def measure_memory(self) -> None:
        """Tracked runs: under a fresh checkpoint per size, its first call, then the steady state.
        A block whose checkpoint raises under a policy is profiled without it (``policy_failed``)."""
        for policy in list(self.policies):
            while policy in self.policies:
                try:
                    self._measure_memory(policy)
                    break
                except Exception as error:
                    self.policy_failed(policy, error, whole=False)

    def _measure_memory(self, policy: str) -> None:
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
        """Timed runs, round by round; each checkpoint's first (learning) call is not timed.

        After ``repeats`` timed rounds, more (up to EXTRA_ROUNDS) while the times have not
        settled: while the two fastest rounds of a typical run differ by more than STABLE_NOISE
        (assemble.time_noise), the planner could not tell plans that close apart."""
        for round_index in range(warmup + repeats):
            self._round(timed=round_index >= warmup)
        for _ in range(EXTRA_ROUNDS):
            if time_noise(self.timed_runs) <= STABLE_NOISE:
                break
            self.total_runs += len(self.policies) * len(self.sizes) + len(self.policies) - 1
            self._round(timed=True)

    def _round(self, *, timed: bool) -> None:
        for policy in list(self.policies):
            try:
                self._time_round(policy, timed=timed)
            except Exception as error:
                self.policy_failed(policy, error, whole=True)

    def _time_round(self, policy: str, *, timed: bool) -> None:
        with self.applied(policy):
            if policy != NONE and self.run(policy, self.sizes[0], track=False) is None:
                return
            for size in list(self.sizes):
                run = self.run(policy, size, track=False)
                if run is None:
                    break
                if timed:
                    self.timed_runs.setdefault((policy, size), []).append(run)

    def policy_failed(self, policy: str, error: Exception, *, whole: bool) -> None:
        """A run under ``policy`` raised (not for memory): the block it was raised in is profiled
        without the policy from now on, or every block is, when the block is unknown, when it is
        the last one left under the policy, or when ``whole`` (its memory was measured already)."""
        if policy == NONE or is_out_of_memory(error):
            raise error
        block = failed_block(error)
        failed = self.failed.setdefault(policy, set())
        names = [name for name, _ in self.blocks]
        reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        if whole or block not in names or len(failed) + 1 >= len(names):
            self.policies = tuple(p for p in self.policies if p != policy)
            self.failed.pop(policy)
            for runs in (self.memory_runs, self.first_runs, self.timed_runs):
                for key in [key for key in runs if key[0] == policy]:
                    del runs[key]
            where = f"in block {block!r}" if block else "outside the blocks"
            self.notes.append(f"policy {policy} raised {where} ({reason}); not profiled, so never planned")
        else:
            failed.add(block)
            self.notes.append(
                f"policy {policy} raised in block {block!r} ({reason}); planned without it there"
            )
        logger.warning("profiling: %s", self.notes[-1])

    def applied(self, policy: str) -> contextlib.AbstractContextManager[Any]:
        """Every block under ``policy`` for the duration of the ``with`` block."""
        if policy == NONE:
            return contextlib.nullcontext()
        failed = self.failed.get(policy, set())
        chosen = {name: NONE if name in failed else policy for name, _ in self.blocks}
        return checkpoint(self.workload.model, policy=chosen)

    def run(self, policy: str, size: int, *, track: bool) -> Run | None:
        """One micro-batch; None when it ran out of memory (the size and larger ones are dropped)."""
        if self.progress is not None:
            self.progress(f"policy {policy}, micro-batch {size}", self.done_runs, self.total_runs)
        self.done_runs += 1
        device = self.workload.device
        run = attempt(
            lambda: micro_batch_run(
                self.workload,
                self.blocks,
                size,
                device,
                track=track,
                optimizer=self.optimizer,
                clock=self.clock,
                phase=f"{'memory' if track else 'time'}, checkpoint policy {policy}",
            ),
            device,
        )
        if run is not None:
            return run
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
