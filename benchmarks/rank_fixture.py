"""Record a profile and the measured time of every fitting candidate, for tests/test_time_rank.py.

The profile is the planner's own (profile_workload with its defaults: the CPU clock of one thread
on a CPU). The candidates are each micro-batch size's no-checkpointing, every-block-full,
every-block-selective and checkpoint_sequential (2 segments) configurations, and the search's
choice, those whose predicted peak fits ``--memory``. Each trains whole windows of ``--batch``
samples (the planner's split, the Accumulator, mb.checkpoint) on one torch thread, timed by the
thread's CPU time; ``--rounds`` rounds visit every candidate in turn (each round in a rotated order,
each timed window after an untimed one of the same candidate), and a candidate's time is its fastest
window. The JSON holds the profile, its noise, and (sizes, policies, predicted, measured) per
candidate, so the test ranks predictions against measurements without timing anything.

    PYTHONPATH=src python benchmarks/rank_fixture.py [--model gpt-mini] [--batch 64]
        [--memory 96MiB] [--rounds 5] [--out tests/data/time_rank_gpt_mini.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from microbatch.accumulate.accumulator import Accumulator
from microbatch.checkpointing.api import checkpoint
from microbatch.memory import parse_bytes
from microbatch.planner.search.hand import hand_strategies
from microbatch.planner.search.sizes import Model, search
from microbatch.planner.search.splits import WindowSizes, candidate_sizes
from microbatch.profile import NONE, profile_workload
from microbatch.profile.runs import train_window
from microbatch.workload import Workload, load_workload


def candidates(model: Model, batch: int, budget: int) -> list[tuple[list[int], dict[str, str]]]:
    """(window sizes, block policies) of every configuration in the docstring that fits ``budget``."""
    blocks = [segment.name for segment in model.profile.blocks]
    strategies = [policies for _, policies in hand_strategies(model.profile)]
    strategies.append(dict.fromkeys(blocks, "selective"))
    found: list[tuple[list[int], dict[str, str]]] = []
    for b in sorted(candidate_sizes(batch)):
        for policies in strategies:
            sizes = WindowSizes(batch, b, balanced=True)
            if model.evaluate(sizes, policies).peak_bytes <= budget:
                found.append((list(sizes), dict(policies)))
    best = search(model.profile, per_rank_batch=batch, capacity_bytes=budget).best
    if best is not None:
        chosen = (list(best.micro_batch_sizes), dict(best.block_policies))
        if chosen not in found:
            found.append(chosen)
    return found


def window_seconds(workload: Workload, sizes: list[int], policies: dict[str, str]) -> float:
    """One window of ``sizes`` under ``policies``, timed on this thread's CPU clock."""
    model = workload.model
    handle = checkpoint(model, policy=policies) if any(p != NONE for p in policies.values()) else None
    try:
        optimizer = workload.make_optimizer()
        batches = [workload.make_batch(size) for size in sizes]
        accumulator = Accumulator(model, optimizer, steps=len(batches))
        began = time.thread_time()
        train_window(workload, accumulator, iter(batches))
        return time.thread_time() - began
    finally:
        if handle is not None:
            handle.remove()
        model.zero_grad(set_to_none=True)


def record(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    workload = load_workload(args.model)
    profile = profile_workload(workload, max_micro_batch_size=min(args.batch, 16))
    budget = parse_bytes(args.memory)
    model = Model(profile)
    chosen = candidates(model, args.batch, budget)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds: list[list[float]] = [[] for _ in chosen]
        for round_index in range(args.rounds):
            # A rotated order, and each timed window after an untimed one of the same candidate: a
            # window right after another configuration's measured 9-11 % slower (planner_real.py).
            start = round_index * len(chosen) // args.rounds
            for index in [*range(start, len(chosen)), *range(start)]:
                window_seconds(workload, *chosen[index])
                seconds[index].append(window_seconds(workload, *chosen[index]))
    finally:
        torch.set_num_threads(threads)
    rows = [
        {
            "micro_batch_sizes": sizes,
            "block_policies": policies,
            "predicted_seconds": model.evaluate(sizes, policies).seconds_per_step,
            "measured_seconds": min(times),
        }
        for (sizes, policies), times in zip(chosen, seconds, strict=True)
    ]
    return {
        "model": args.model,
        "batch": args.batch,
        "budget_bytes": budget,
        "rounds": args.rounds,
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "PYTHONPATH=src python benchmarks/rank_fixture.py " + " ".join(sys.argv[1:]),
        "load": [load_before, os.getloadavg()[0]],  # 1-minute load average before and after
        "time_noise": profile.time_noise,
        "profile": profile.to_dict(),
        "candidates": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--memory", default="96MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="tests/data/time_rank_gpt_mini.json")
    args = parser.parse_args()
    report = record(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for row in report["candidates"]:
        print(
            f"{len(row['micro_batch_sizes']):>3} windows of <= {max(row['micro_batch_sizes']):>3} "
            f"{sorted(set(row['block_policies'].values())) or ['none']}: predicted "
            f"{row['predicted_seconds']:.3f} s, measured {row['measured_seconds']:.3f} s"
        )


if __name__ == "__main__":
    main()
