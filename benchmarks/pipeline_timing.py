"""Pipeline step time: the planner's prediction against what the ranks measure (benchmarks/pipeline.py).

Each rank plans with mb.plan(..., pipeline=S) (the link measured on the ranks, the profile on the
CPU clock), then runs the plan's pipeline for a few windows and records:

- wall: the window's wall-clock seconds (forward, backward, the window's collectives, the step);
- cpu: this rank's CPU seconds per window (time.thread_time of the thread that runs the schedule);
- its actions in order: every forward (with the loss on the last stage) and backward of a
  micro-batch, each with its CPU seconds.

On a shared 2-core machine the wall clock holds other jobs' time slices, and S > 2 ranks cannot
even run at once. So the step is also measured load-free: the ranks' actions replayed on their
dependency graph, each taking the CPU seconds it took (a forward waits for the previous stage's
forward of that micro-batch, a backward for the next stage's backward; each edge one message of
the measured link), plus each rank's CPU outside the actions (padding, counting, sums, norm), the
window's small collectives and the optimizer step: what the step takes with a core per rank.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from typing import Any

import torch

Action = tuple[str, int, int, float]  # (kind "F" / "B", pipeline step, micro-batch, CPU seconds)


def _instrument(pipe: Any, actions: list[Action], step: list[int]) -> None:
    """Record each forward (with its loss) and backward of this rank's stage, in order."""
    stage, schedule = pipe._stages[0], pipe._schedule

    def timed(name: str, kind: str | None) -> None:
        original = getattr(stage if kind else schedule, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                seconds = time.thread_time() - began
                if kind is None:  # the loss: part of the forward just recorded
                    k, s, i, before = actions[-1]
                    actions[-1] = (k, s, i, before + seconds)
                else:
                    actions.append((kind, step[0], int(args[0]), seconds))

        setattr(stage if kind else schedule, name, run)

    timed("forward_one_chunk", "F")
    timed("backward_one_chunk", "B")
    timed("_maybe_compute_loss", None)
    run_step = pipe._run_step

    def counted(chunk: Any) -> None:
        run_step(chunk)
        step[0] += 1

    pipe._run_step = counted


def run_windows(plan: Any, workload: Any, windows: int) -> dict[str, Any]:
    """Every rank: the plan's pipeline for ``windows`` windows (the first one not counted)."""
    import torch.distributed as dist

    from microbatch.planner.pipeline.on_ranks import stage_optimizer

    example = torch.zeros(
        plan.micro_batch_size, *workload.make_batch(1)["input_ids"].shape[1:], dtype=torch.long
    )
    pipe = plan.pipeline(copy.deepcopy(workload.model), example=example, loss_fn=workload.pipeline_loss)
    optimizer = stage_optimizer(workload, pipe.parameters())
    data = [workload.pipeline_inputs(workload.make_batch(size)) for size in plan.micro_batch_sizes]
    actions: list[Action] = []
    step = [0]
    _instrument(pipe, actions, step)
    measured: dict[str, list[float]] = defaultdict(list)
    kept: list[list[Action]] = []
    for window in range(windows):
        dist.barrier()
        actions.clear()
        step[0] = 0
        wall, cpu = time.perf_counter(), time.thread_time()
        pipe.backward(data)
        stepped = time.thread_time()
        pipe.step(optimizer)
        if window == 0:
            continue
        measured["wall"].append(time.perf_counter() - wall)
        measured["cpu"].append(time.thread_time() - cpu)
        measured["optimizer"].append(time.thread_time() - stepped)
        measured["other"].append(stepped - cpu - sum(a[3] for a in actions))
        kept.append(list(actions))
    return {"measured": dict(measured), "actions": kept, "stage": pipe.stage_indices[0]}


def replay(
    ranks: list[dict[str, Any]], window: int, stages: int, edge_seconds: float, fixed_seconds: float
) -> float:
    """One replica's window replayed on its dependency graph (see the module docstring), seconds;
    ``fixed_seconds``: the window's small collectives (the measured link's)."""
    queues = [ranks[s]["actions"][window] for s in range(stages)]
    done: dict[tuple[str, int, int, int], float] = {}
    clock, position = [0.0] * stages, [0] * stages
    while any(position[s] < len(queues[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(queues[s]):
                kind, step, index, seconds = queues[s][position[s]]
                neighbour = s - 1 if kind == "F" else s + 1
                if kind == "B" and s == stages - 1:
                    ready = done[("F", s, step, index)]  # its own forward, already replayed
                elif 0 <= neighbour < stages:
                    key = (kind, neighbour, step, index)
                    if key not in done:
                        break
                    ready = done[key] + edge_seconds
                else:
                    ready = 0.0
                clock[s] = max(clock[s], ready) + seconds
                done[(kind, s, step, index)] = clock[s]
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the recorded actions do not form a pipeline schedule")
    rest = max(
        ranks[s]["measured"]["other"][window] + ranks[s]["measured"]["optimizer"][window]
        for s in range(stages)
    )
    return max(clock) + rest + fixed_seconds


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def timing_rank(config: dict[str, Any]) -> dict[str, Any]:
    """Every rank: plan each case on the ranks, run its windows; the link as measured here."""
    import torch.distributed as dist

    import microbatch as mb
    from microbatch.distributed.link import measure_link
    from microbatch.models.gpt import GPTConfig
    from microbatch.models.workloads import gpt_workload
    from microbatch.profile import profile_workload

    workload = gpt_workload(GPTConfig(**config["gpt"]))
    world = dist.get_world_size()
    profile = (
        profile_workload(workload, clock="cpu", policies=["none", "full"]) if dist.get_rank() == 0 else None
    )
    cases = []
    for memory, schedule in config["cases"]:
        plan = mb.plan(
            workload,
            batch=config["batch"],
            memory=memory,
            pipeline=world,
            world_size=world,
            pipeline_schedule=schedule,
            profile=profile,
        )
        cases.append({"plan": plan.to_dict(), **run_windows(plan, workload, config["windows"])})
    link = measure_link()
    return {"cases": cases, "link": [link.latency_seconds, link.bytes_per_second, link.collective_seconds]}
