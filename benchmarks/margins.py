"""Margins that do not cost speed: at a budget equal to a configuration's measured peak, the plan
is at least that configuration (a micro-batch no smaller, no more steps).

For the built-in GPT and a batch B, each configuration "micro-batch b, no checkpointing" is run as
the planner's trial runs a window (MemoryTracker over its first two micro-batches and the optimizer
step, planner/trial_window.py), and that peak becomes the budget of ``mb.plan(workload, batch=B,
memory=peak)``. The table shows the plan's micro-batch x steps and policies beside b, the trials it
needed, and whether it is at least the configuration.

    python benchmarks/margins.py [--model gpt-mini] [--batch 64] [--sizes 4,8,16] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import microbatch as mb
from microbatch.memory import format_bytes
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload
from microbatch.planner.plans import summarize_policies
from microbatch.planner.search import Model
from microbatch.planner.trial_window import run_trial
from microbatch.planner.windows import WindowSizes
from microbatch.profile import profile_workload


def measured_peak(workload: mb.Workload, profile: mb.Profile, batch: int, size: int) -> int:
    """The trial-window peak of micro-batch ``size``, no checkpointing, for a window of ``batch``."""
    sizes = list(WindowSizes(batch, size))
    candidate = Model(profile).evaluate(sizes, {segment.name: "none" for segment in profile.blocks})
    return run_trial(workload, candidate).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sizes", default="4,8,16")
    parser.add_argument("--quick", action="store_true", help="a 4-block 32-wide GPT, batch 32, sizes 4,8")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        workload = gpt_workload(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32), max_bytes=200_000)
        batch, sizes = 32, [4, 8]
    else:
        workload, batch = gpt_workload(args.model), args.batch
        sizes = [int(s) for s in args.sizes.split(",")]
    profile = profile_workload(workload, max_micro_batch_size=max(sizes), repeats=3)
    rows = []
    for size in sizes:
        peak = measured_peak(workload, profile, batch, size)
        plan = mb.plan(workload, batch=batch, memory=peak, profile=profile)
        rows.append(
            {
                "configuration": f"{size} x {math.ceil(batch / size)}, none",
                "budget_bytes": peak,
                "plan": f"{plan.micro_batch_size} x {plan.steps}, {summarize_policies(plan.block_policies)}",
                "trials": plan.trials,
                "measured_peak_bytes": plan.measured_peak_bytes,
                "at_least": plan.micro_batch_size >= size and plan.steps <= math.ceil(batch / size),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'configuration':<16} {'budget':>10}  {'plan':<34} {'trials':>6} {'measured':>10}  at least")
    for row in rows:
        print(
            f"{row['configuration']:<16} {format_bytes(row['budget_bytes']):>10}  {row['plan']:<34} "
            f"{row['trials']:>6} {format_bytes(row['measured_peak_bytes'] or 0):>10}  {row['at_least']}"
        )


if __name__ == "__main__":
    main()
